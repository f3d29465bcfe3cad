"""Single-process checks of the pieces context parallelism is built from (no process group needed).

  shard_bounds            contiguous, balanced, covers [0, L), empty shards when L < N
  shard_pieces (zigzag)   rank r owns segments r and 2N-1-r of 2N; every rank's causal attention work (query-key
                          pairs) within one segment's worth of every other's; local chunks never straddle pieces
  resolve_layout          "auto" takes zigzag only where it runs; asking for it elsewhere names the key
  GDN transition [B | P]  S_end(S_0) == P S_0 + B for the plain token-by-token delta rule (affine in S_0);
  GDN one-pass outputs    the augmented run's [o(0) | q~] from [0 | I], corrected by q~ S_0 afterwards, == the token
                          loop's outputs from S_0 (chunk by chunk, as capture runs it)
                          the exclusive fold of segment summaries == the recurrence's state at each segment start
  conv-tail fold          == the last k-1 columns of the concatenated pre-conv projections (shards shorter than k-1)
  grads given merged lse  summing each key shard's dq share == dq of dense attention over all keys; each shard's
                          dk/dv == its slice of the dense dk/dv (ring-attention backward; lse and out both in the loss)
  capture cargo           with grouped-query attention the pages (K/V) are the cheaper cargo
Tolerances: float64, different association orders of the same sums: ~1e-14; asserted at 1e-12.
"""

from itertools import pairwise

import pytest
import torch

from ds_longstraw.arch.qwen3_5_scan import (
    corrected,
    extend_summary,
    extend_with_outputs,
    fold_states,
    fold_tails,
    identity_summary,
)
from ds_longstraw.config import LongstrawConfig
from ds_longstraw.grpo.cp.kinds.attention.ring import capture_move_bytes
from ds_longstraw.grpo.cp.kinds.sparse.selection import _rows_in
from ds_longstraw.kernels import partial_attention_reference, recurrent_gated_delta_rule
from ds_longstraw.kernels.attention import attention_delta, blockwise_grads_from_delta
from ds_longstraw.parallel import local_spans, shard_bounds, shard_pieces, visible_prefix


@pytest.mark.parametrize("length,size", [(22, 3), (5, 4), (2, 4), (8, 2), (1, 1)])
def test_shard_bounds(length, size):
    bounds = shard_bounds(length, size)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_prompt_shards_answer_what_each_use_derived(layout):
    """PromptShards (what CPContext.pieces gives) against the plain helpers it replaces, on a prompt that no rank
    count divides; it indexes and pickles (process launches carry it) as the plain list does."""
    import pickle

    from ds_longstraw.parallel.groups import PromptShards, local_starts, local_tokens, segments_in_order

    plain = shard_pieces(23, 3, layout)
    tokens = torch.arange(23)
    for rank in range(3):
        shards = PromptShards(plain, rank)
        assert list(shards) == [tuple(own) for own in plain] and shards[rank] == tuple(plain[rank])
        assert shards.mine == tuple(plain[rank]) and shards.starts == local_starts(plain[rank])
        assert shards.tokens == sum(hi - lo for lo, hi in plain[rank]) == shards.size(rank)
        assert shards.sizes == [sum(hi - lo for lo, hi in own) for own in plain] and sum(shards.sizes) == 23
        assert shards.largest == max(shards.sizes) and shards.order == segments_in_order(plain)
        assert torch.equal(shards.local_tokens(tokens), local_tokens(tokens, plain[rank]))
        copy = pickle.loads(pickle.dumps(shards))
        assert copy == shards and copy.rank == rank and isinstance(copy, PromptShards)


@pytest.mark.parametrize("length,size", [(22, 3), (9, 4), (5, 4), (1000, 8), (1, 2)])
def test_zigzag_pieces_balance_causal_attention(length, size):
    pieces = shard_pieces(length, size, "zigzag")
    covered = sorted(piece for own in pieces for piece in own)
    assert covered == shard_bounds(length, 2 * size)  # a partition of [0, L) into 2N segments
    assert all(own == (covered[r], covered[2 * size - 1 - r]) for r, own in enumerate(pieces))
    # causal work of rank r: each of its tokens at position p reads p + 1 keys
    work = [sum(sum(range(lo + 1, hi + 1)) for lo, hi in own) for own in pieces]
    segment = -(-length // (2 * size))
    assert max(work) - min(work) <= 2 * segment * segment + 2 * length
    if length >= 1000:  # contiguous shards: the last rank does (2N-1)/N^2 of the work; zigzag: within 1% of 1/N
        assert max(work) / sum(work) < 1.01 / size
    for own in pieces:
        spans = local_spans(own, 3)
        assert [b - a for a, b, _ in spans] and all(b - a <= 3 for a, b, _ in spans) or length < 2 * size
        for a, b, position in spans:  # a chunk lies in one piece, at the prompt position its local index says
            assert any(lo <= position and position + (b - a) <= hi for lo, hi in own)
            assert visible_prefix(own, position) == a


def test_visible_prefix_counts_earlier_tokens():
    assert visible_prefix(((0, 5), (15, 20)), 17) == 7
    assert visible_prefix(((5, 10), (10, 15)), 5) == 0
    assert visible_prefix(((5, 10), (10, 15)), 12) == 7


def _layout_specs(combines):
    from ds_longstraw.arch.specs import LayerState

    return [LayerState(layer=i, kind="x", label="x", combine=c) for i, c in enumerate(combines)]


@pytest.mark.parametrize("longstraw,combines,expected", [
    ({}, ["affine_scan", "lse"], "zigzag"),
    ({"prefix_grad": "exact"}, ["affine_scan", "lse"], "zigzag"),
    ({"cp_attention": "ulysses"}, ["lse"], "contiguous"),
    ({}, ["topk_lse"], "zigzag"),
    ({"cp_layout": "contiguous"}, ["lse"], "contiguous"),
    # a selection family in exact mode: contiguous where its prefix pass takes the turns, zigzag layer-major
    ({"prefix_grad": "exact", "cp_prefix": "turns"}, ["topk_lse"], "contiguous"),
    ({"prefix_grad": "exact", "cp_prefix": "layer_major"}, ["topk_lse"], "zigzag"),
    ({"prefix_grad": "exact", "cp_prefix": "turns", "cp_layout": "zigzag"}, ["topk_lse"], "zigzag"),
], ids=["detached", "exact", "ulysses", "topk", "asked", "topk-turns", "topk-layer-major", "topk-turns-asked"])
def test_auto_layout_takes_zigzag_where_it_runs(longstraw, combines, expected):
    from ds_longstraw.grpo.topology import resolve_layout

    assert resolve_layout(_FakeAdapter(combines), LongstrawConfig(cp_size=2, **longstraw)) == expected


def test_zigzag_refused_where_it_does_not_run():
    from ds_longstraw.grpo.topology import resolve_layout

    config = LongstrawConfig(cp_size=2, cp_layout="zigzag", cp_attention="ulysses")
    with pytest.raises(ValueError, match="'longstraw.cp_layout' = 'zigzag'.*cp_attention 'ulysses'"):
        resolve_layout(_FakeAdapter(["lse"]), config)


@pytest.mark.parametrize("length,size,layout", [(23, 2, "zigzag"), (46, 3, "zigzag"), (5, 4, "zigzag"),
                                                (17, 3, "contiguous")])
def test_local_and_prompt_positions_invert_each_other(length, size, layout):
    """A rank's local index i is its i-th token in prompt order; prompt_to_local marks exactly its own positions."""
    from ds_longstraw.parallel.groups import local_to_prompt, prompt_to_local

    everything = torch.arange(length)
    for own in shard_pieces(length, size, layout):
        expected = [p for lo, hi in own for p in range(lo, hi)]
        local = torch.arange(len(expected))
        assert local_to_prompt(local, own).tolist() == expected
        back, mine = prompt_to_local(everything, torch.ones(length, dtype=torch.bool), own)
        assert everything[mine].tolist() == expected
        assert back[mine].tolist() == list(range(len(expected)))


def test_candidate_sets_merge_in_canonical_order_whatever_their_positions():
    """merge_candidate_sets of two canonical sets over interleaved positions (two zigzag ranks' pieces) == one
    stable sort of every score by (score descending, position ascending), in either order, ties included."""
    from ds_longstraw.kernels import dsa

    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (5, 12), generator=gen).double()  # many ties
    ranks = [torch.tensor([0, 1, 2, 9, 10, 11]), torch.tensor([3, 4, 5, 6, 7, 8])]
    k = 4
    parts = []
    for positions in ranks:  # each rank's own canonical top-k (a stable sort in its position order)
        values, order = torch.sort(scores[:, positions], dim=-1, descending=True, stable=True)
        parts.append((values[:, :k], positions[order[:, :k]]))
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    empty = dsa.no_candidates(5, torch.float64, "cpu")
    for first, second in (parts, parts[::-1]):
        merged = dsa.merge_candidate_sets(dsa.merge_candidate_sets(empty, first, k), second, k)
        assert torch.equal(merged[0], values[:, :k]) and torch.equal(merged[1], order[:, :k])


class _FakeAdapter:
    """What resolve_prefix reads of an adapter: its family, specs and whether it runs its scan layers layer-major
    (the GDN layer's pass)."""

    def __init__(self, combines, scan_pass=True):
        self.family, self.specs = "test", _layout_specs(combines)
        self.layer_major_scan = scan_pass


@pytest.mark.parametrize("longstraw,combines,scan_pass,expected", [
    ({"cp_prefix": "layer_major"}, ["affine_scan", "lse"], True, "layer_major"),
    ({"cp_prefix": "layer_major", "cp_attention": "ulysses"}, ["affine_scan", "lse"], True, "layer_major"),
    ({}, ["topk_lse", "none"], True, "turns"),
    ({}, ["affine_scan"], False, "turns"),
    ({"cp_prefix": "turns"}, ["lse"], True, "turns"),
], ids=["asked", "ulysses", "none-combine", "no-scan-pass", "turns-asked"])
def test_prefix_schedule_where_it_runs(longstraw, combines, scan_pass, expected):
    """Where the combines rule layer-major out, "auto" takes the turns before weighing memory (the next test)."""
    from ds_longstraw.grpo.topology import resolve_prefix

    config = LongstrawConfig(cp_size=2, prefix_grad="exact", **longstraw)
    assert resolve_prefix(_FakeAdapter(combines, scan_pass), config) == expected


def test_auto_prefix_weighs_the_layer_inputs_against_the_kept_state():
    """"auto" takes the layer-major pass only where (1) the layer inputs it adds on the pages' tier (kept every k
    layers, and a group's recomputed ones) are at most 1.5x the state the transaction keeps there anyway, and (2)
    where a rank's captured tokens and the device's memory are known, what it holds on the device across a layer
    takes at most a quarter of it; prefix_inputs_every "auto" is the smallest k whose added bytes, those held on
    the device included, fit 1.5x, else the k that adds the fewest. Qwen3.6-27B (64 layers x 5,120 values a token,
    4.4x its state kept) fails at k = 1 and passes at k = 4 (16 kept + 3 recomputed layers' inputs); GLM-5.2 at
    k = 13 (no k fits with the held bytes; 13 adds the fewest) passes (1), and (2) at 2M tokens on 32 x 96 GB (15
    GiB of absorbed q, out and d(out) a rank), but not on 48 GB devices; asked for, layer-major runs anyway."""
    from models import tiny_qwen3_5

    from ds_longstraw.arch import adapter_for
    from ds_longstraw.grpo.topology import resolve_inputs_every, resolve_prefix
    from ds_longstraw.models.model_shape import load_config, shape_from_config
    from ds_longstraw.offload.auto import (
        LAYER_MAJOR_DEVICE_FRACTION,
        LAYER_MAJOR_STATE_RATIO,
        inputs_every_for,
        layer_major_fits,
        layer_major_workspace,
    )
    from ds_longstraw.offload.auto import layer_major_prefix as plan_layer_major

    assert (LAYER_MAJOR_STATE_RATIO, LAYER_MAJOR_DEVICE_FRACTION) == (1.5, 0.25)
    adapter = adapter_for(tiny_qwen3_5(layers=3, layer_types=["linear_attention", "full_attention",
                                                              "linear_attention"]))
    shape = shape_from_config(adapter.family, adapter.config, adapter.dtype.itemsize)
    config = LongstrawConfig(cp_size=2, prefix_grad="exact", capture_chunk=4)
    assert resolve_prefix(adapter, config) == "layer_major" and layer_major_fits(shape, 4)
    assert resolve_inputs_every(adapter, config) == 1
    # the device's bound: what the pass holds over 1,000 tokens a rank against a quarter of the device
    held = layer_major_workspace(shape, 1000)
    assert resolve_prefix(adapter, config, 1000, 4 * held) == "layer_major"
    assert resolve_prefix(adapter, config, 1000, 4 * held - 4) == "turns"
    assert resolve_prefix(adapter, config, 1000, None) == "layer_major"  # off CUDA: no device bound
    asked = LongstrawConfig(cp_size=2, prefix_grad="exact", capture_chunk=4, cp_prefix="layer_major")
    assert resolve_prefix(adapter, asked, 1000, 1) == "layer_major"

    qwen = shape_from_config(*load_config("qwen3.6-27b"))
    # the formula, written out: kept pages + gradient pages + the carry checkpoint per chunk start, against
    # (ceil(64 / k) kept + k - 1 recomputed) layers' inputs of 5,120 bf16 values, with (k) and without (tier) what
    # the pass holds on the device: d(output), d(input); attention q, out, d(out), lse
    kept = 2 * 16 * 2 * 4 * 256 * 2 + qwen.carry_total / 4096
    tier = {k: 5120 * 2 * (-(-64 // k) + min(k, 64) - 1) for k in (1, 2, 3, 4)}
    held = 2 * 5120 * 2 + 3 * 24 * 256 * 2 + 24 * 4
    assert [tier[k] + held <= 1.5 * kept for k in (1, 2, 3, 4)] == [False, False, False, True]
    assert [tier[k] <= 1.5 * kept for k in (1, 2, 3, 4)] == [False, False, True, True]
    assert inputs_every_for(qwen, 4096) == 4 and not layer_major_fits(qwen, 4096, every=1)
    assert layer_major_fits(qwen, 4096) and plan_layer_major(qwen, 8, "exact")
    assert not plan_layer_major(qwen, 8, "exact", every=1)
    assert plan_layer_major(qwen, 8, "exact", "layer_major", every=1)
    assert not plan_layer_major(qwen, 8, "exact", "turns")

    glm = shape_from_config(*load_config("glm-5.2"))
    tokens = -(-2 * 2**20 // 32)
    # d(output), d(input) [T, 6,144] and the absorbed attention's q, out, d(out) [T, 64 x 576] in bf16, lse float32
    assert layer_major_workspace(glm, tokens) == tokens * (2 * 6144 * 2 + 3 * 64 * 576 * 2 + 64 * 4)
    assert inputs_every_for(glm, 4096) == 13
    assert plan_layer_major(glm, 32, "exact", tokens_per_rank=tokens, device_memory=96 * 10**9)
    assert not plan_layer_major(glm, 32, "exact", tokens_per_rank=tokens, device_memory=48 * 10**9)


def test_layer_major_refused_where_it_does_not_run():
    from ds_longstraw.grpo.topology import resolve_prefix

    config = LongstrawConfig(cp_size=2, prefix_grad="exact", cp_prefix="layer_major")
    assert resolve_prefix(_FakeAdapter(["topk_lse", "lse"]), config) == "layer_major"
    with pytest.raises(ValueError, match="'longstraw.cp_prefix' = 'layer_major'.*no recurrent_scan"):
        resolve_prefix(_FakeAdapter(["affine_scan"], scan_pass=False), config)
    with pytest.raises(ValueError, match="cp_prefix"):
        LongstrawConfig(cp_prefix="sideways")


def test_build_topology_refuses_before_any_work():
    """build_topology validates first (check_topology): a refused setting raises, naming the key, before the group
    is touched (this context has no process group: a collective, or setting its layout, would show); one rank
    builds OneRank whatever the settings."""
    from ds_longstraw.grpo.topology import OneRank, build_topology, check_topology
    from ds_longstraw.parallel import CPContext

    context = CPContext.__new__(CPContext)  # a 2-rank context, without a process group
    context.size = 2
    adapter = _FakeAdapter(["affine_scan"], scan_pass=False)
    config = LongstrawConfig(cp_size=2, prefix_grad="exact", cp_prefix="layer_major")
    with pytest.raises(ValueError, match="'longstraw.cp_prefix' = 'layer_major'"):
        check_topology(adapter, config, 2)
    with pytest.raises(ValueError, match="'longstraw.cp_prefix' = 'layer_major'"):
        build_topology(adapter, config, context, prompt_tokens=100)
    assert not hasattr(context, "layout")
    check_topology(adapter, config, 1)  # one rank runs every setting
    assert isinstance(build_topology(adapter, LongstrawConfig(prefix_grad="exact", cp_prefix="layer_major")), OneRank)


def test_schedule_chunks_pad_after_the_real_ones():
    """The chunk loops of the layer-major CP schedule walk Schedule.chunks(spans): the real chunks, then (a Lockstep
    under ZeRO-3) one dummy chunk of one zero token at position 0 per chunk the common shape has more."""
    from ds_longstraw.grpo.lockstep import GroupCalls, Lockstep, Schedule

    spans = [(0, 4, 10), (4, 6, 30)]
    plain = Schedule().chunks(spans)
    assert [(c.a, c.b, c.position, c.dummy) for c in plain] == [(0, 4, 10, False), (4, 6, 30, False)]
    assert not plain.padded and list(plain.dummies()) == [] and plain.spans == spans
    padded = Lockstep(GroupCalls(2, (1,)), GroupCalls(5, (1, 1)), LongstrawConfig()).chunks(spans)
    walked = list(padded)
    assert padded.padded and [c.dummy for c in walked] == [False, False, True, True, True]
    hidden = torch.randn(1, 6, 3)
    assert torch.equal(walked[1].of(hidden), hidden[:, 4:6])
    assert walked[2].position == 0 and torch.equal(walked[2].of(hidden), torch.zeros(1, 1, 3))


def test_schedule_prefix_turn_pads_after_the_owner_chunks():
    """Exact mode's CP prefix pass in turns makes, per segment, Schedule.prefix_turn's iterations: none mirrored on
    the plain schedule (or a replay-only lockstep), else the owner's real chunks then dummies up to the segment's
    most chunks on any replica (a segment with no tokens here is still walked: real 0)."""
    from ds_longstraw.grpo.lockstep import GroupCalls, Lockstep, ReplayLockstep, Schedule, TurnIterations

    local, common = GroupCalls(2, (1,), (2, 0, 1)), GroupCalls(3, (1,), (3, 2, 1))
    assert Schedule().prefix_turn(0, 2) is None
    assert ReplayLockstep(local, common, LongstrawConfig()).prefix_turn(0, 2) is None
    lockstep = Lockstep(local, common, LongstrawConfig())
    turns = [lockstep.prefix_turn(s, real) for s, real in enumerate(local.segments)]
    assert turns == [TurnIterations(2, 1), TurnIterations(0, 2), TurnIterations(1, 0)]
    assert [len(list(t.dummies())) for t in turns] == [1, 2, 0]


def _delta_inputs(gen, tokens, hk=2, hv=4, dk=8, dv=6):
    q = torch.randn(1, tokens, hk, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(1, tokens, hk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(1, tokens, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, tokens, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, tokens, hv, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def test_delta_rule_is_affine_in_initial_state():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _delta_inputs(gen, 37)
    s0 = torch.randn(1, 4, 8, 6, generator=gen, dtype=torch.float64)
    summary = extend_summary(identity_summary(4, 8, 6, torch.float64, "cpu"), q, k, v, g, beta)
    bias, product = summary[..., :6], summary[..., 6:]
    _, end_from_zero = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    _, end_from_s0 = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(bias, end_from_zero, rtol=0, atol=1e-12)
    torch.testing.assert_close(product @ s0 + bias, end_from_s0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tokens,chunk", [(37, 10), (5, 8), (64, 64)])
def test_one_pass_outputs_corrected_by_the_initial_state(tokens, chunk):
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = _delta_inputs(gen, tokens)
    s0 = torch.randn(1, 4, 8, 6, generator=gen, dtype=torch.float64)
    expected, end = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    summary, outs = identity_summary(4, 8, 6, torch.float64, "cpu"), []
    for a in range(0, tokens, chunk):  # the summary carries over chunks; the correction waits for S_0
        out, summary = extend_with_outputs(summary, *(t[:, a:a + chunk] for t in (q, k, v, g, beta)))
        outs.append(out)
    outputs = torch.cat([corrected(out, s0, 6) for out in outs], 1)
    torch.testing.assert_close(outputs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(summary[..., 6:] @ s0 + summary[..., :6], end, rtol=0, atol=1e-12)
    # without the correction the outputs are the zero-state run's: the test can tell the two apart
    assert (torch.cat([out[..., :6] for out in outs], 1) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("cuts", [(0, 9, 9, 40, 70), (0, 1, 2, 3, 70), (0, 70, 70)],
                         ids=["with-empty", "tiny", "last-empty"])
def test_exclusive_fold_gives_each_segment_its_initial_state(cuts):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _delta_inputs(gen, cuts[-1])
    summaries, sizes = [], []
    for a, b in pairwise(cuts):
        summary = identity_summary(4, 8, 6, torch.float64, "cpu")
        if b > a:  # summaries are extended chunk by chunk in capture; two pieces here
            mid = (a + b) // 2
            for x, y in ((a, mid), (mid, b)):
                if y > x:
                    summary = extend_summary(summary, *(t[:, x:y] for t in (q, k, v, g, beta)))
        summaries.append(summary)
        sizes.append(b - a)
    for index, cut in enumerate(cuts[1:], start=1):
        _, expected = recurrent_gated_delta_rule(*(t[:, :cut] for t in (q, k, v, g, beta)), output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        state = fold_states(summaries[:index], sizes[:index], 6)
        torch.testing.assert_close(state, expected, rtol=0, atol=1e-12)


def test_conv_tail_fold_spans_short_shards():
    gen = torch.Generator().manual_seed(2)
    width, channels = 3, 5
    sizes = [2, 0, 1, 4, 1]
    full = torch.randn(1, channels, sum(sizes), generator=gen, dtype=torch.float64)
    parts, counts, start = [], [], 0
    for size in sizes:
        count = min(size, width)
        part = torch.zeros(1, channels, width, dtype=torch.float64)
        if count:
            part[:, :, width - count:] = full[:, :, start + size - count:start + size]
        parts.append(part)
        counts.append(count)
        start += size
    padded = torch.cat([torch.zeros(1, channels, width, dtype=torch.float64), full], -1)
    start = 0
    for index, size in enumerate(sizes):
        start += size
        assert torch.equal(fold_tails(parts[:index + 1], counts[:index + 1], width), padded[:, :, start:start + width])


def test_grads_given_merged_lse_sum_to_dense_grads():
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, tq, dim, scale = 4, 2, 5, 8, 0.4
    sizes = [6, 0, 9, 1]
    q = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_heads, sum(sizes), dim, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_heads, sum(sizes), dim, generator=gen, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(heads, tq, generator=gen, dtype=torch.float64)
    out, lse = partial_attention_reference(q, k, v, scale)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    dq, start = torch.zeros_like(q), 0
    for size in sizes:
        part = slice(start, start + size)
        delta = attention_delta(out.detach(), w_out, w_lse)  # from the MERGED (out, lse), as every shard has it
        dq_part, dk, dv = blockwise_grads_from_delta(q.detach(), k.detach()[:, part], v.detach()[:, part],
                                                     lse.detach(), w_out, delta, scale, key_block=4)
        dq += dq_part
        torch.testing.assert_close(dk, dk_ref[:, part], rtol=0, atol=1e-12)
        torch.testing.assert_close(dv, dv_ref[:, part], rtol=0, atol=1e-12)
        start += size
    torch.testing.assert_close(dq, dq_ref, rtol=0, atol=1e-12)


def test_capture_cargo_prefers_pages_with_grouped_query_attention():
    bounds = shard_bounds(1000, 4)
    gqa = capture_move_bytes(bounds, heads=24, kv_heads=4, head_dim=256, elem_bytes=2, lse_bytes=4)
    assert gqa["kv"] < gqa["q"]
    # 2 ranks, equal shards: pages 2 K D per token once; queries (2 H D + H) per token once
    two = capture_move_bytes(shard_bounds(10, 2), heads=2, kv_heads=2, head_dim=4, elem_bytes=8, lse_bytes=8)
    assert two == {"kv": 5 * 2 * 2 * 4 * 8, "q": 5 * (2 * 2 * 4 * 8 + 2 * 8)}
    # shards 1, 1, 1, 0: rank 0's token goes to ranks 1 and 2, rank 1's to rank 2; the empty rank gets nothing
    assert capture_move_bytes(shard_bounds(3, 4), 4, 2, 8, 2, 4)["kv"] == (2 + 1) * 2 * 2 * 8 * 2


def test_cp_size_and_group_are_checked_at_the_door():
    from ds_longstraw.parallel import CPContext, as_cp_context

    with pytest.raises(ValueError, match="cp_size' = 2 needs cp_group"):
        as_cp_context(None, 2)
    assert as_cp_context(None, 1) is None
    context = CPContext.__new__(CPContext)  # a 2-rank context, without a process group
    context.size = 2
    with pytest.raises(ValueError, match="cp_size' = 3 but cp_group has 2 ranks"):
        as_cp_context(context, 3)
    assert as_cp_context(context, 2) is context
    with pytest.raises(ValueError, match="capture_move"):
        CPContext(object(), capture_move="both")


def test_auto_scan_holds_outputs_where_they_fit():
    """"cp_scan": "auto" holds the GDN outputs off CUDA, and on CUDA where they take at most SCAN_HOLD_FRACTION of
    the device (the same rule as the planner's scan_holds); explicit settings are obeyed."""
    from ds_longstraw.grpo.cp.kinds.scan.capture import holds_scan_outputs
    from ds_longstraw.offload.auto import SCAN_HOLD_FRACTION

    cpu, cuda, gib = torch.device("cpu"), torch.device("cuda"), 1 << 30
    auto = LongstrawConfig(cp_size=2)
    assert auto.cp_scan == "auto" and holds_scan_outputs(auto, 10 ** 15, cpu)
    assert holds_scan_outputs(auto, int(SCAN_HOLD_FRACTION * 96 * gib), cuda, device_total=96 * gib)
    assert not holds_scan_outputs(auto, int(SCAN_HOLD_FRACTION * 96 * gib) + 1, cuda, device_total=96 * gib)
    assert not holds_scan_outputs(LongstrawConfig(cp_size=2, cp_scan="two_pass"), 0, cpu)
    assert holds_scan_outputs(LongstrawConfig(cp_size=2, cp_scan="one_pass"), 10 ** 15, cuda, device_total=1)


@pytest.mark.parametrize("dim", [0, 1])
def test_token_bytes_round_trip_bit_for_bit(dim):
    """CPContext's exchanges carry several tensors as one row of bytes per token (TokenBytes): every dtype the
    replay sends (float64/32, bfloat16, int32, bool), a [T] vector, a tensor with no elements per token, and any run
    of the rows (a rank's tokens) come back bit for bit with their dtypes; a layout off by one byte would not."""
    from ds_longstraw.parallel.groups import TokenBytes

    g = torch.Generator().manual_seed(0)
    tokens = 5
    # per tensor: its shape with the tokens at `dim` (T), its dtype
    cases = {0: [((5, 3, 2), torch.float64), ((5, 4), torch.bfloat16), ((5, 0), torch.float32),
                 ((5, 2, 3), torch.int32), ((5, 7), torch.bool), ((5,), torch.float32)],
             1: [((3, 5, 2), torch.float64), ((2, 5), torch.bfloat16), ((0, 5), torch.float32),
                 ((4, 5, 3), torch.int32), ((2, 5, 1), torch.bool)]}[dim]
    tensors = []
    for shape, dtype in cases:
        value = torch.randn(shape, generator=g) * 100
        tensors.append(value > 0 if dtype == torch.bool else value.to(dtype))
    packed = TokenBytes(tensors, dim)
    assert packed.rows.dtype == torch.uint8 and packed.rows.shape[0] == tokens
    assert packed.rows.shape[1] == sum(t.numel() * t.element_size() for t in tensors) // tokens
    for rows, lo, hi in [(packed.rows, 0, tokens), (packed.rows[1:4], 1, 4), (packed.rows[:0], 0, 0)]:
        back = packed.unpack(rows)
        for got, want in zip(back, tensors, strict=True):
            assert got.dtype == want.dtype
            assert torch.equal(got, want.narrow(dim, lo, hi - lo))


def test_a_pages_gradient_rows_are_its_selected_rows():
    """Under context parallelism a run of pages [lo, hi) gets the gradients of the rows some query selected there
    (streamed_sparse_grads -> pool.add_grad_rows): _rows_in gives exactly those, distinct, ascending, from lo;
    slots elsewhere or not valid add none."""
    positions = torch.tensor([[3, 12, 7, 20], [12, 9, 3, 0], [15, 2, 11, 12]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, True], [True, True, True, True]])
    assert _rows_in(positions, valid, 8, 16).tolist() == [1, 3, 4, 7]  # 9, 11, 12, 15 (12 thrice)
    assert _rows_in(positions, valid, 0, 8).tolist() == [0, 2, 3, 7]  # 0, 2, 3 (one valid of two), 7
    assert _rows_in(positions, valid, 16, 24).tolist() == []  # 20 is not valid
