"""grpo_backward with the prompt sharded over 2, 3 and 4 gloo ranks, against single-process float64 references.

Equivalence chains (float64 model, float64_model() making transformers compute in float64 end to end):
  CP grpo_backward(detached), every rank == transformers cache continuation (no-grad prefill of prompt[:-1], each
                                           member continues with autograd) == single-process grpo_backward(detached)
  CP grpo_backward(exact), every rank    == full-sequence autograd of prompt + response for every member
  every rank's gradients are bitwise identical; loss and log-probs equal the references'
  retained K/V page bytes of rank r == single-process bytes x (its tokens / prompt tokens); the GDN state (a
  constant per sequence) is kept whole on every rank
  bytes received per attention layer in replay == (N-1)(H D + H) x 8 forward + 2 (N-1)/N H D x 8 backward per
  replayed token (float64)
Tolerance: relative L2 <= 1e-8 over all parameter gradients (as test_transaction.py). CP changes only the
association order of float64 sums (LSE merges over shards, the [B | P] state fold): measured ~1e-10 here, while a
wrong path (a lost dq share, a missing state gradient across a rank boundary, a shifted conv tail) shows at 1e-3.

The ranks are forked processes (tests/cp_scripts/harness.py); each world size runs every case in one process
group, and the results are files read back here.
"""

import os

import pytest
import torch
from cp_scripts.harness import make_group, run_cp
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOObjective, grpo_backward
from ds_longstraw.models.model_shape import shape_from_config
from ds_longstraw.offload.auto import gdn_scan_outputs, layer_inputs_bytes
from ds_longstraw.parallel import shard_pieces, visible_prefix
from ds_longstraw.parallel.groups import local_spans

TOL = 1e-8
WORLDS = [2, 3, 4]

# Attention layers before GDN layers: prompt attention outputs then feed later prompt state, so the exact prefix
# pass must send gradients through the remote pages (with attention only as the last layer it never would).
MODEL = dict(layers=5, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                                    "linear_attention"])

CASES = [
    # prompt[:-1] = 22 tokens; qwen3_5 takes the zigzag layout ("auto") in both modes: 2N segments of 6/6/5/5 (CP 2),
    # 4/4/4/4/3/3 (CP 3), 3/3/3/3/3/3/2/2 (CP 4), rank r holding segments r and 2N-1-r; chunks of 4 and pages of 3
    # divide neither (the replicated replay: test_traffic_accounting checks its formula; test_cp_spread.py
    # the spread)
    dict(name="uneven-detached", prompt_len=23, response_lens=[5, 3], mode="detached", chunk=4, page=3, block=3,
         cp_replay="replicated"),
    # the same group on contiguous shards 11/11, 8/7/7, 6/6/5/5 (the layout before zigzag, kept for comparison)
    dict(name="contiguous-detached", prompt_len=23, response_lens=[5, 3], mode="detached", chunk=4, page=3,
         block=3, cp_replay="replicated", layout="contiguous"),
    # zigzag with segments shorter than the conv tail (3 tokens) and than a page: 9 tokens over 8 segments at CP 4
    dict(name="zigzag-short-detached", prompt_len=10, response_lens=[3, 1, 2], mode="detached", chunk=2, page=2,
         block=2, layout="zigzag", seed=11),
    dict(name="uneven-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3),
    # 5 tokens: shards 3/2, 2/2/1, 2/1/1/1: smaller than a chunk and than the conv tail (3 tokens)
    dict(name="short-shards-exact", prompt_len=6, response_lens=[4, 1, 2], mode="exact", chunk=8, page=2, block=2,
         seed=1),
    # 2 tokens: shards 1/1, 1/1/0, 1/1/0/0: empty shards
    dict(name="empty-shards-exact", prompt_len=3, response_lens=[3, 2], mode="exact", chunk=2, page=1, block=2,
         seed=2),
    # KL to a separate reference model: the reference is captured and scored over the CP group too
    dict(name="kl-reference-exact", prompt_len=19, response_lens=[4, 6], mode="exact", chunk=5, page=4, block=4,
         objective={"kl_coef": 0.3}, ref_seed=7, seed=3, worlds=(3,)),
    # capture with queries travelling to the page owners instead of pages travelling (forced)
    dict(name="queries-travel-exact", prompt_len=21, response_lens=[3, 4], mode="exact", chunk=5, page=4, block=2,
         capture_move="q", seed=4, worlds=(3, 4), layout="contiguous"),
    # exact mode on contiguous shards (one turn per rank; the layout before zigzag), and zigzag on the host tier
    # with segments shorter than a chunk (several turns with empty or one-chunk pieces)
    dict(name="contiguous-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         layout="contiguous"),
    dict(name="zigzag-short-exact", prompt_len=10, response_lens=[3, 1, 2], mode="exact", chunk=2, page=2, block=2,
         tier="cpu", layout="zigzag", seed=12),
    # the GDN capture's second pass instead of held outputs ("cp_scan": "two_pass"), on both layouts
    dict(name="two-pass-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         scan="two_pass", seed=13),
    dict(name="two-pass-contiguous-detached", prompt_len=23, response_lens=[4, 2], mode="detached", chunk=5,
         page=3, block=3, scan="two_pass", layout="contiguous", seed=14, worlds=(3,)),
    dict(name="G1-seq-mean-detached", prompt_len=17, response_lens=[6], mode="detached", chunk=3, page=2, block=4,
         objective={"loss_agg": "seq-mean-token-mean"}, seed=5, worlds=(2,), repeat=2),  # .grad accumulates
    # Ulysses all-to-all capture: 4 query heads over 2 ranks (2 each), over 4 ranks (1 each, kv heads replicated)
    dict(name="ulysses-exact", prompt_len=22, response_lens=[4, 3], mode="exact", chunk=4, page=3, block=3,
         cp_attention="ulysses", worlds=(2, 4), seed=6),
    # bfloat16: held to the error of the single-process transaction in bfloat16 (see test_low_precision)
    dict(name="bfloat16-exact", prompt_len=26, response_lens=[5, 4, 3], mode="exact", chunk=7, page=4, block=4,
         dtype="bfloat16", worlds=(2,), low_precision=True, seed=7),
    # each rank's pages (and exact mode's gradient pages) on the host tier, or in NVMe files through async I/O
    dict(name="host-tier-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         tier="cpu", worlds=(2, 3), seed=8),
    dict(name="nvme-tier-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         tier="nvme", worlds=(2, 4), seed=9),
    dict(name="nvme-tier-detached", prompt_len=20, response_lens=[4, 2], mode="detached", chunk=5, page=2, block=3,
         tier="nvme", worlds=(3,), seed=10),
    # exact mode with the capture's merged attention kept (prefix_keep_attention): the same group as "uneven-exact",
    # so the prefix pass's exchanges can be compared; with Ulysses capture; kept on NVMe with KL to a reference
    dict(name="kept-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3, keep=True),
    dict(name="kept-ulysses-exact", prompt_len=22, response_lens=[4, 3], mode="exact", chunk=4, page=3, block=3,
         cp_attention="ulysses", keep=True, worlds=(2, 4), seed=6),
    dict(name="kept-nvme-kl-exact", prompt_len=19, response_lens=[4, 6], mode="exact", chunk=5, page=4, block=4,
         keep=True, tier="cpu", kept_tier="nvme", objective={"kl_coef": 0.3}, ref_seed=7, seed=3, worlds=(2, 3)),
    # exact mode's prefix pass in turns (the schedule before layer-major, kept for comparison): the groups of
    # "uneven-exact" and "kept-exact", and zigzag's short pieces on the host tier
    dict(name="turns-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         prefix="turns"),
    dict(name="turns-kept-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         keep=True, prefix="turns"),
    dict(name="turns-short-exact", prompt_len=10, response_lens=[3, 1, 2], mode="exact", chunk=2, page=2, block=2,
         tier="cpu", layout="zigzag", seed=12, prefix="turns"),
    # the layer-major pass with capture keeping every 2nd / 3rd layer's input, the rest recomputed per group of
    # layers (5 layers: groups [0, 1], [2, 3], [4] and [0, 1, 2], [3, 4]); with the attention kept, on NVMe
    dict(name="inputs-every-2-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         inputs_every=2, seed=15),
    dict(name="inputs-every-3-kept-nvme-exact", prompt_len=21, response_lens=[4, 2], mode="exact", chunk=5, page=3,
         block=3, inputs_every=3, keep=True, tier="nvme", seed=16, worlds=(2, 3)),
    # ... and refused at the door where the heads do not split (4 heads, 3 ranks)
    dict(name="ulysses-refused", prompt_len=22, response_lens=[4, 3], mode="exact", chunk=4, page=3, block=3,
         cp_attention="ulysses", worlds=(3,), expect_error=True, seed=6),
]
for _case in CASES:
    _case["model"] = MODEL
# A model whose last layer is an attention layer: the capture runs it for its K/V alone, moving nothing (with the
# attention kept, whole: the prefix pass reads its output); its rows' gradients still reach the projections.
LAST_ATTENTION = dict(layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                             "full_attention"])
CASES += [
    dict(name="last-attention-detached", prompt_len=23, response_lens=[5, 3], mode="detached", chunk=4, page=3,
         block=3, seed=17, worlds=(2, 3), model=LAST_ATTENTION),
    dict(name="last-attention-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         seed=18, worlds=(2, 3), model=LAST_ATTENTION),
    dict(name="last-attention-kept-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3,
         block=3, keep=True, seed=19, worlds=(2,), model=LAST_ATTENTION),
    dict(name="last-attention-turns-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3,
         block=3, seed=20, worlds=(2, 3), model=LAST_ATTENTION, prefix="turns"),
]
for _case in CASES:
    if _case["mode"] == "exact":  # the layer-major pass, asked for ("auto" takes it only where its layer inputs fit,
        _case.setdefault("prefix", "layer_major")  # offload/auto.layer_major_fits); the turns cases ask for "turns"
BY_NAME = {case["name"]: case for case in CASES}


@pytest.fixture(scope="module")
def single_process_retained():
    """retained_bytes of the single-process transaction for the "uneven-detached" case."""
    case = BY_NAME["uneven-detached"]
    model = tiny_qwen3_5(**MODEL)
    group = make_group(case["prompt_len"], case["response_lens"])
    config = {"prefix_grad": "detached", "capture_chunk": case["chunk"], "page_tokens": case["page"],
              "replay_block": case["block"]}
    with float64_model():
        return grpo_backward(model, group, GRPOObjective(), longstraw=config).retained_bytes


OUT_DIRS = {}  # world size -> the directory its ranks wrote to (NVMe page files went under <dir>/nvme)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"cp{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    OUT_DIRS[world] = str(tmp_path_factory.mktemp(f"cp{world}"))
    return world, run_cp(world, CASES, OUT_DIRS[world])


def test_tiered_pages_leave_no_files(world_results):
    """The NVMe cases ran (their gradients are checked above) and every rank removed its page files."""
    world, results = world_results
    nvme_cases = [c["name"] for c in CASES if "nvme" in (c.get("tier"), c.get("kept_tier"))
                  and world in c.get("worlds", (world,))]
    assert nvme_cases, "no NVMe case runs on this world size"
    for name in nvme_cases:
        assert len(results[name]) == world
    nvme = os.path.join(OUT_DIRS[world], "nvme")
    assert os.path.isdir(nvme) and os.listdir(nvme) == []


@pytest.fixture(scope="module")
def references():
    """name -> (grads, loss, logps, ref_logps) of the single-process float64 reference."""
    out = {}
    models = {}  # one model per config, as the ranks build it
    for case in CASES:
        if case.get("expect_error") or case.get("low_precision"):
            continue
        key = repr(case["model"])
        model = models[key] = models.get(key) or tiny_qwen3_5(**case["model"])
        group = make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))
        objective = GRPOObjective(**case.get("objective", {}))
        fn = cache_continuation_logprobs if case["mode"] == "detached" else full_sequence_logprobs
        ref_model = tiny_qwen3_5(seed=case["ref_seed"], **case["model"]) if "ref_seed" in case else None

        with float64_model():
            grads, (loss, logps, ref) = reference_step(model, group, objective.group_loss, fn, ref_model)
        out[case["name"]] = (grads, loss, logps, ref)
    return out


@pytest.mark.parametrize("name", [c["name"] for c in CASES if not (c.get("expect_error") or c.get("low_precision"))])
def test_gradients_loss_logprobs_match_reference(world_results, references, name):
    world, results = world_results
    if name not in results:
        pytest.skip(f"{name} does not run on {world} ranks")
    ref_grads, ref_loss, ref_logps, ref_ref_logps = references[name]
    ref_grads = {n: g * BY_NAME[name].get("repeat", 1) for n, g in ref_grads.items()}
    ranks = results[name]
    for rank, result in enumerate(ranks):
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank} of {world}: relative L2 {error:.3e}"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        for mine, ref in zip(result["logprobs"], ref_logps, strict=True):
            torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
        if ref_ref_logps is not None:
            for mine, ref in zip(result["ref_logprobs"], ref_ref_logps, strict=True):
                torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    for rank, result in enumerate(ranks[1:], start=1):
        assert result["grads"].keys() == ranks[0]["grads"].keys()
        assert all(torch.equal(result["grads"][n], ranks[0]["grads"][n]) for n in result["grads"]), \
            f"rank {rank} gradients differ from rank 0's"
        assert result["loss"] == ranks[0]["loss"]


def test_retained_bytes_split_over_ranks(world_results, single_process_retained):
    """Each rank keeps the pages of its own tokens only (1/N of the prompt, +-1 token, on either layout) plus the
    whole GDN state."""
    world, results = world_results
    single = single_process_retained
    length = BY_NAME["uneven-detached"]["prompt_len"] - 1
    for name, layout in (("uneven-detached", "zigzag"), ("contiguous-detached", "contiguous")):
        ranks = results[name]
        for own, result in zip(shard_pieces(length, world, layout), ranks, strict=True):
            tokens = sum(hi - lo for lo, hi in own)
            assert result["retained"]["attention_kv_pages"] * length == single["attention_kv_pages"] * tokens
            assert result["retained"]["gdn_state"] == single["gdn_state"]
            assert result["cp"]["layout"] == layout
            assert result["cp"]["shard"] == (own[0] if layout == "contiguous" else own)
        assert sum(r["retained"]["attention_kv_pages"] for r in ranks) == single["attention_kv_pages"]
        assert max(r["retained"]["attention_kv_pages"] for r in ranks) <= single["attention_kv_pages"] * (
            -(-length // world)) / length


def _layer_kinds(config):
    """(attention layers, Gated DeltaNet layers) of the test model."""
    return ([i for i, t in enumerate(config.layer_types) if t == "full_attention"],
            [i for i, t in enumerate(config.layer_types) if t == "linear_attention"])


def test_traffic_accounting(world_results):
    """What the counters report is what the design moves (float64: 8-byte elements)."""
    world, results = world_results
    config = tiny_qwen3_5(**MODEL).config
    heads, dim, kv_heads = config.num_attention_heads, config.head_dim, config.num_key_value_heads
    attention_layers, gdn_layers = _layer_kinds(config)
    case = BY_NAME["uneven-detached"]
    block, tokens = case["block"], case["response_lens"]
    length = case["prompt_len"] - 1
    for name, layout, move in (("uneven-detached", "zigzag", "ring"), ("contiguous-detached", "contiguous", "kv")):
        pieces = shard_pieces(length, world, layout)
        for rank, result in enumerate(results[name]):
            report = result["cp"]
            assert report["replayed_tokens"] == sum(tokens)
            expected = 0
            for n in tokens:  # one forward all-gather and one backward all-reduce per replay block
                for a in range(0, n, block):
                    q = min(n, a + block) - a
                    expected += (world - 1) * heads * q * (dim + 1) * 8 + 2 * (world - 1) * heads * q * dim * 8 // world
            for layer in attention_layers:
                assert report["received_bytes_by_layer"]["replay"][layer] == expected
            # GDN layers move only constant-size tails and [B | P] summaries in capture (one of each per piece of
            # every rank), whatever the prompt length
            capture = report["received_bytes_by_layer"]["capture"]
            per_gdn = len(pieces[0]) * (world - 1) * 8 * (
                config.linear_num_value_heads * config.linear_key_head_dim
                * (config.linear_value_head_dim + config.linear_key_head_dim)
                + (2 * config.linear_num_key_heads * config.linear_key_head_dim
                   + config.linear_num_value_heads * config.linear_value_head_dim)
                * (config.linear_conv_kernel_dim - 1))
            assert all(capture[layer] == per_gdn for layer in gdn_layers)
            # grouped-query attention: pages are the cheaper cargo in capture (zigzag: in a ring, all ranks at once)
            assert report["capture_moves"] == {"capture": {layer: move for layer in attention_layers}}
            # each rank receives, from every other rank, the longest prefix of its keys that any piece here sees
            seen = sum(max(visible_prefix(pieces[j], lo) for lo, hi in pieces[rank] if hi > lo)
                       for j in range(world) if j != rank and any(hi > lo for lo, hi in pieces[rank]))
            received = report["received_bytes_by_op"]["capture"].get("capture_kv", 0)
            assert received == seen * 2 * kv_heads * dim * 8 * len(attention_layers)
    if "queries-travel-exact" in results:
        for result in results["queries-travel-exact"]:
            assert set(result["cp"]["capture_moves"]["capture"].values()) == {"q"}


def test_the_capture_runs_the_last_layer_for_its_rows_alone(world_results):
    """A last attention layer's output over the prompt feeds nothing: the capture puts its K/V on the pages and
    moves nothing for it (no pages or queries travel), and the layer-major prefix pass back-propagates its K/V's
    gradients alone (no ring), where the attention layer below it exchanges as before; so does the prefix pass in
    turns (no request for it reaches a page owner); with the attention kept the layer runs whole, since the prefix
    pass reads the kept output. The gradients of all four equal the reference
    (test_gradients_loss_logprobs_match_reference)."""
    world, results = world_results
    last = len(LAST_ATTENTION["layer_types"]) - 1
    if world not in (2, 3):
        pytest.skip("the last-attention cases run on 2 and 3 ranks")
    for name in ("last-attention-detached", "last-attention-exact", "last-attention-turns-exact"):
        for result in results[name]:
            capture = result["cp"]["received_bytes_by_layer"]["capture"]
            assert 1 in capture and last not in capture, (name, capture)
            assert last not in result["cp"]["capture_moves"]["capture"]
            if name.endswith("exact"):  # the prefix pass's top layer: its K/V's gradients alone, no exchange
                prefix = result["cp"]["received_bytes_by_layer"]["prefix"]
                assert 1 in prefix and last not in prefix, (name, prefix)
    for result in results.get("last-attention-kept-exact", ()):
        assert result["cp"]["received_bytes_by_layer"]["capture"][last] > 0


def test_planner_counts_the_scan_outputs_a_capture_holds(world_results):
    """What a rank's GDN capture holds until the exchange (the delta rule's outputs over its shard) == the planner's
    gdn_scan_outputs for its tokens, byte for byte, on a rank whose pieces do not start the prompt; the rank whose
    piece does holds dk less per value head and token of that piece."""
    world, results = world_results
    config = tiny_qwen3_5(**MODEL).config
    shape = shape_from_config("tiny", config.to_dict(), 8)
    length = BY_NAME["uneven-detached"]["prompt_len"] - 1
    for name, layout in (("uneven-detached", "zigzag"), ("contiguous-detached", "contiguous")):
        for own, result in zip(shard_pieces(length, world, layout), results[name], strict=True):
            tokens = sum(hi - lo for lo, hi in own)
            first = sum(hi - lo for lo, hi in own if lo == 0)  # tokens of a piece at the prompt start
            held = result["cp"]["held_bytes"]["gdn_scan_outputs"]
            expected = gdn_scan_outputs(shape, tokens) - first * config.linear_num_value_heads \
                * config.linear_key_head_dim * 8
            assert held == expected, (name, own)
            assert held <= gdn_scan_outputs(shape, -(-length // world))
    for result in results["two-pass-exact"]:  # "two_pass" holds nothing across the exchange
        assert result["cp"]["held_bytes"]["gdn_scan_outputs"] == 0


def test_ulysses_capture_moves_and_refusal(world_results):
    world, results = world_results
    if world == 3:
        for result in results["ulysses-refused"]:
            assert "num_attention_heads (4) divisible by cp_size (3)" in result["error"]
        return
    for result in results["ulysses-exact"]:
        assert set(result["cp"]["capture_moves"]["capture"].values()) == {"ulysses"}
        by_op = result["cp"]["received_bytes_by_op"]["capture"]
        assert by_op["ulysses_qkv"] > 0 and by_op["ulysses_out"] > 0 and "capture_kv" not in by_op


def test_low_precision_within_twice_single_process_error(world_results):
    """bfloat16 CP gradients err against float64 (the same bfloat16 weights, cast up) by at most 2x what the
    single-process bfloat16 transaction errs by: sharding adds LSE merges and a state fold, not precision loss."""
    world, results = world_results
    case = BY_NAME["bfloat16-exact"]
    if case["name"] not in results:
        pytest.skip(f"runs on {case['worlds']} ranks")
    group = make_group(case["prompt_len"], case["response_lens"], seed=case["seed"])
    objective = GRPOObjective()
    low = tiny_qwen3_5(dtype=torch.bfloat16, **MODEL)
    reference = tiny_qwen3_5(dtype=torch.bfloat16, **MODEL).double()
    config = {"prefix_grad": "exact", "capture_chunk": case["chunk"], "page_tokens": case["page"],
              "replay_block": case["block"]}
    with float64_model():
        ref_grads, _ = grads_of(reference, lambda: objective.group_loss(
            group, full_sequence_logprobs(reference, group.prompt_ids, group.response_ids)).backward())
        single, _ = grads_of(low, lambda: grpo_backward(low, group, objective, longstraw=config))
    single_error = relative_l2({n: g.double() for n, g in single.items()}, ref_grads)
    for result in results[case["name"]]:
        error = relative_l2({n: g.double() for n, g in result["grads"].items()}, ref_grads)
        assert error <= 2 * single_error, (error, single_error)


def test_two_cp_groups_inside_four_processes(tmp_path, references):
    """CP groups {0, 2} and {1, 3} (data-parallel replicas of a CP-2 layout) run the same group concurrently: group
    ranks differ from global ranks, so every collective must use the CP group it is given and its group ranks."""
    cases = [BY_NAME["uneven-exact"]]
    results = run_cp(4, cases, str(tmp_path), cp_ranks=[[0, 2], [1, 3]])
    ref_grads = references["uneven-exact"][0]
    ranks = results["uneven-exact"]
    for rank, result in enumerate(ranks):
        assert relative_l2(result["grads"], ref_grads) <= TOL
        assert result["cp"]["size"] == 2 and result["cp"]["rank"] == rank // 2
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(ranks[a]["grads"][n], ranks[b]["grads"][n]) for n in ranks[a]["grads"])


def test_kept_attention_skips_the_prefix_forward_exchanges(world_results):
    """prefix_keep_attention under CP: each rank keeps its own tokens' merged attention (H D + H float64 values per
    token and attention layer), and the prefix pass then sends no forward request: no (out, lse) partial comes back
    to any rank, the page owners receive the queries once (backward) instead of twice, and the dq shares are the
    same bytes. Gradients equal the recomputing pass's to 1e-12 (the reference test holds both to full-sequence
    autograd at 1e-8; here only the association of the LSE merges differs)."""
    world, results = world_results
    config = tiny_qwen3_5(**MODEL).config
    heads, dim = config.num_attention_heads, config.head_dim
    attention_layers = config.layer_types.count("full_attention")
    pieces = shard_pieces(BY_NAME["kept-exact"]["prompt_len"] - 1, world, "zigzag")
    for own, kept, plain in zip(pieces, results["turns-kept-exact"], results["turns-exact"], strict=True):
        tokens = sum(hi - lo for lo, hi in own)
        assert kept["retained"]["kept_attention_pages"] == tokens * attention_layers * (heads * dim + heads) * 8
        assert plain["retained"]["kept_attention_pages"] == 0
        assert relative_l2(kept["grads"], plain["grads"]) <= 1e-12
        with_kept = kept["cp"]["received_bytes_by_op"].get("prefix", {})
        recomputed = plain["cp"]["received_bytes_by_op"].get("prefix", {})
        assert "prefix_out" not in with_kept and "prefix_lse" not in with_kept
        assert with_kept.get("prefix_q", 0) * 2 == recomputed.get("prefix_q", 0)
        assert with_kept.get("prefix_dq", 0) == recomputed.get("prefix_dq", 0)
    # zigzag: every rank's later piece reads the other ranks' earlier pages: its forward requests were the ones
    # skipped
    assert all(r["cp"]["received_bytes_by_op"]["prefix"]["prefix_out"] > 0 for r in results["turns-exact"])


def test_layer_major_prefix_pass_traffic_and_inputs(world_results):
    """The layer-major prefix pass ("auto" for qwen3_5) and what it moves, against its formulas (float64):
    - each rank keeps every layer's input over its shard: tokens x hidden x layers x 8 bytes ("layer_inputs");
    - attention, per layer: a rank receives (3 H D + H) values for each token of another rank's chunk that sees
      its keys (q, out, dout and lse) and H D for each token of its own chunks per rank whose keys they see (the
      dq shares); recomputing the forward (attention not kept) adds the capture's page ring, which the kept
      attention skips;
    - GDN, per layer: one [L | A] state adjoint summary and one d(start tail) per piece of every other rank;
    - the turns pass gives the same gradients (1e-12: only the association of sums differs)."""
    world, results = world_results
    config = tiny_qwen3_5(**MODEL).config
    heads, dim, hidden = config.num_attention_heads, config.head_dim, config.hidden_size
    attention_layers, gdn_layers = _layer_kinds(config)
    case = BY_NAME["uneven-exact"]
    length, chunk = case["prompt_len"] - 1, case["chunk"]
    pieces = shard_pieces(length, world, "zigzag")
    shape = shape_from_config("tiny", config.to_dict(), 8)
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * dk + hv * dv
    per_gdn = (world - 1) * len(pieces[0]) * 8 * (hv * dk * (dv + dk) + conv_dim * (config.linear_conv_kernel_dim - 1))

    def seen_tokens(querier, owner):  # tokens of querier's chunks that see keys of owner
        return sum(b - a for a, b, position in local_spans(pieces[querier], chunk)
                   if visible_prefix(pieces[owner], position))

    for rank, (plain, kept, turns) in enumerate(zip(results["uneven-exact"], results["kept-exact"],
                                                    results["turns-exact"], strict=True)):
        assert plain["cp"]["prefix"] == "layer_major" and turns["cp"]["prefix"] == "turns"
        tokens = sum(hi - lo for lo, hi in pieces[rank])
        assert plain["retained"]["layer_inputs"] == tokens * hidden * len(config.layer_types) * 8 \
            == layer_inputs_bytes(shape, tokens)  # what the planner counts
        for name, every in (("inputs-every-2-exact", 2), ("inputs-every-3-kept-nvme-exact", 3)):
            if name in results:  # capture keeps layers 0, k, 2k, ...: ceil(5 / k) of them
                own = shard_pieces(BY_NAME[name]["prompt_len"] - 1, world, "zigzag")[rank]
                kept_tokens = sum(hi - lo for lo, hi in own)
                assert results[name][rank]["retained"]["layer_inputs"] == kept_tokens * hidden * 8 * -(-5 // every) \
                    == layer_inputs_bytes(shape, kept_tokens, every)
        assert "layer_inputs" not in turns["retained"]
        assert relative_l2(plain["grads"], turns["grads"]) <= 1e-12
        assert relative_l2(kept["grads"], plain["grads"]) <= 1e-12
        others = [j for j in range(world) if j != rank]
        requests = sum(seen_tokens(j, rank) for j in others) * (3 * heads * dim + heads) * 8
        answers = sum(seen_tokens(rank, j) for j in others) * heads * dim * 8
        for result in (plain, kept):
            by_layer = result["cp"]["received_bytes_by_layer"]["prefix"]
            by_op = result["cp"]["received_bytes_by_op"]["prefix"]
            assert all(by_layer[layer] == per_gdn for layer in gdn_layers)
            assert by_op["prefix_layer_dq"] == answers * len(attention_layers)
            assert by_op["prefix_layer_q"] + by_op["prefix_layer_out"] + by_op["prefix_layer_dout"] \
                + by_op["prefix_layer_lse"] == requests * len(attention_layers)
        recomputed = plain["cp"]["received_bytes_by_op"]["prefix"].get("capture_kv", 0)
        assert recomputed == plain["cp"]["received_bytes_by_op"]["capture"]["capture_kv"]
        assert "capture_kv" not in kept["cp"]["received_bytes_by_op"]["prefix"]
