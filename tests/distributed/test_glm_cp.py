"""GLM-5.2 (glm_moe_dsa) with the prompt sharded over 2, 3 and 4 gloo ranks, against the single-process float64
references of tests/equivalence/test_glm.py (transformers' own model under glm_reference(): float64, canonical top-k).

Equivalence chains:
  CP grpo_backward(detached), every rank == transformers prefill-then-continue (no-grad prefill of prompt[:-1] into
                                           its cache, each member continues with autograd)
  CP grpo_backward(exact), every rank    == transformers' full-sequence autograd of prompt + response per member
  every rank's gradients are bitwise identical; loss and log-probs equal the references'; the indexer gets none
  the global top-k (each rank's candidates over its own indexer pages, merged in rank order) selects, at every
  position of every full indexer layer, in capture, replay and the prefix pass, on every rank, the same set as the
  reference's canonical top-k over the whole sequence, with a one-head indexer whose scores tie at exactly 0
  page-wise selection / partials / gradients, merged over "ranks" and pages == the plain one-piece references
Tolerance: relative L2 <= 1e-8 over all parameter gradients (the contract's). Both sides compute the same float64
functions in different orders (LSE merges over ranks and pages, absorbed vs expanded attention): measured ~8e-16
here; a wrong path (a per-shard top-k, a lost d(query) share, a row gradient on the wrong rank's pages, a stale
page) shows at 1e-4 or worse. The single-process unit checks re-associate sums of a few terms: 1e-12.

The ranks are forked processes (tests/cp_scripts/harness.py, GLM cases); each world size runs every case in one
process group.
"""

import os

import pytest
import torch
from cp_scripts.harness import make_group, run_cp
from glm_models import boundary_ties, glm_reference, reference_selections, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, full_sequence_logprobs
from reference import reference_step

from ds_longstraw import GRPOObjective
from ds_longstraw.arch import adapter_for
from ds_longstraw.config import parse_config
from ds_longstraw.grpo.cp.kinds.sparse.selection import selected_rows_attention
from ds_longstraw.grpo.topology import check_topology
from ds_longstraw.kernels import dsa, merge_partials
from ds_longstraw.kernels.attention import attention_delta
from ds_longstraw.kernels.sparse_mla import attention as sparse_mla
from ds_longstraw.parallel import shard_pieces

TOL = 1e-8
WORLDS = [2, 3, 4]
TIES = {"index_n_heads": 1}  # one indexer head: its ReLU scores are exactly 0 for many keys
FAMILY = "glm_moe_dsa"

CASES = [
    # prompt[:-1] = 46 tokens on the zigzag layout ("auto"): 2N segments of 12/12/11/11 (CP 2), 8/8/8/8/7/7,
    # 6/6/6/6/6/6/5/5; chunks of 5 and pages of 4 divide none (the replicated replay: test_traffic_accounting
    # checks its formula; tests/distributed/test_cp_spread.py the spread)
    dict(name="uneven-detached", prompt_len=47, response_lens=[5, 3, 4], mode="detached", chunk=5, page=4, block=3,
         cp_replay="replicated"),
    # exact mode's prefix pass in turns on zigzag pieces (asked for: "auto" lays a selection family's prompt out
    # contiguously where its prefix pass takes the turns, topology.resolve_layout)
    dict(name="uneven-exact", prompt_len=47, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4, block=3,
         layout="zigzag"),
    # the same group on contiguous shards 23/23, 16/15/15, 12/12/11/11 (the layout before zigzag, kept for
    # comparison; "auto" in exact mode here)
    dict(name="contiguous-detached", prompt_len=47, response_lens=[5, 3, 4], mode="detached", chunk=5, page=4,
         block=3, cp_replay="replicated", layout="contiguous"),
    dict(name="contiguous-exact", prompt_len=47, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4, block=3,
         worlds=(2, 3)),
    # 20 tokens: shards 10/10, 7/7/6, 5/5/5/5: fewer keys per rank than index_topk (8), more in all
    dict(name="shards-below-topk-exact", prompt_len=21, response_lens=[4, 3], mode="exact", chunk=3, page=2,
         block=2, seed=1),
    # 2 tokens: shards 1/1/0, 1/1/0/0: empty shards
    dict(name="empty-shards-exact", prompt_len=3, response_lens=[3, 2], mode="exact", chunk=2, page=1, block=2,
         seed=2, worlds=(3, 4)),
    # G = 1 with a one-token response; three one-token responses
    dict(name="G1-one-token-exact", prompt_len=44, response_lens=[1], mode="exact", chunk=7, page=3, block=2,
         seed=3, worlds=(2, 3)),
    dict(name="one-token-responses-detached", prompt_len=44, response_lens=[1, 1, 1], mode="detached", chunk=10,
         page=7, block=2, seed=4, worlds=(4,)),
    # KL to a separate reference model: captured and scored over the CP group first, with its own selections
    dict(name="kl-reference-exact", prompt_len=45, response_lens=[4, 6, 2], mode="exact", chunk=11, page=4,
         block=3, objective={"kl_coef": 0.3}, ref_seed=7, seed=5, worlds=(3,)),
    # each rank's pages (and exact mode's gradient pages) on the host tier, or in NVMe files through async I/O
    dict(name="host-tier-exact", prompt_len=43, response_lens=[3, 5], mode="exact", chunk=12, page=5, block=3,
         tier="cpu", seed=6, worlds=(2, 3)),
    dict(name="nvme-tier-exact", prompt_len=43, response_lens=[3, 5], mode="exact", chunk=12, page=5, block=3,
         tier="nvme", seed=6, worlds=(2, 4)),
    dict(name="nvme-tier-detached", prompt_len=42, response_lens=[5, 3], mode="detached", chunk=9, page=4, block=4,
         tier="nvme", seed=7, worlds=(3,)),
    # exact zero-score ties decide many selections: every selection is recorded and compared with the reference's
    # (replicated: every rank replays, and records the selections of, every member)
    dict(name="ties-exact", prompt_len=50, response_lens=[6, 4], mode="exact", chunk=9, page=4, block=3,
         model=TIES, seed=1, record=True, cp_replay="replicated"),
    dict(name="ties-detached", prompt_len=50, response_lens=[6, 4], mode="detached", chunk=9, page=4, block=3,
         model=TIES, seed=1, record=True, worlds=(2,), cp_replay="replicated"),
    dict(name="ties-layer-major-exact", prompt_len=50, response_lens=[6, 4], mode="exact", chunk=9, page=4,
         block=3, model=TIES, seed=1, record=True, worlds=(2, 4), cp_replay="replicated", prefix="layer_major"),
    dict(name="ties-zigzag-exact", prompt_len=50, response_lens=[6, 4], mode="exact", chunk=9, page=4, block=3,
         model=TIES, seed=1, record=True, worlds=(3,), layout="zigzag", cp_replay="replicated"),
    # exact mode's prefix pass layer-major (every rank at once; "auto" takes the turns for this model: its layer
    # inputs outweigh its pages), on both layouts, G = 1, a shared layer's selection recomputed from the full layer
    # below it, the host tier, and a KL reference
    dict(name="layer-major-exact", prompt_len=47, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4, block=3,
         prefix="layer_major"),
    dict(name="layer-major-contiguous-exact", prompt_len=46, response_lens=[4, 2], mode="exact", chunk=4, page=3,
         block=2, prefix="layer_major", layout="contiguous", seed=8, worlds=(2, 4)),
    dict(name="layer-major-G1-host-exact", prompt_len=44, response_lens=[3], mode="exact", chunk=7, page=3, block=2,
         prefix="layer_major", tier="cpu", seed=3, worlds=(2, 3)),
    dict(name="layer-major-shards-below-topk-exact", prompt_len=21, response_lens=[4, 3], mode="exact", chunk=3,
         page=2, block=2, prefix="layer_major", seed=1, worlds=(3, 4)),
    # every 2nd / 3rd layer's input kept, the rest recomputed a group at a time (layers full, shared, full, shared:
    # at k = 3 the base layer 3 reuses layer 2's selection, kept with its input; at k = 2 each group's shared layer
    # reuses its base's, remade from the base's input)
    dict(name="layer-major-inputs-every-2-exact", prompt_len=47, response_lens=[5, 3], mode="exact", chunk=5, page=4,
         block=3, prefix="layer_major", inputs_every=2, seed=9, worlds=(2, 3)),
    dict(name="layer-major-inputs-every-3-host-exact", prompt_len=40, response_lens=[4, 2, 3], mode="exact", chunk=6,
         page=4, block=2, prefix="layer_major", inputs_every=3, tier="cpu", seed=10, worlds=(2, 4)),
    dict(name="layer-major-kl-exact", prompt_len=45, response_lens=[4, 6, 2], mode="exact", chunk=11, page=4,
         block=3, objective={"kl_coef": 0.3}, ref_seed=7, seed=5, prefix="layer_major", worlds=(2,)),
    # bfloat16: held to twice transformers' own bfloat16 error (see test_low_precision_within_twice_plain_error)
    dict(name="bfloat16-exact", prompt_len=47, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4, block=3,
         dtype="bfloat16", low_precision=True, worlds=(2, 3)),
    # "auto", the default: this model's layer inputs fit the pages' tier's ratio, and nothing bounds what the pass
    # holds off CUDA, so it runs layer-major on zigzag shards (offload/auto.layer_major_fits)
    dict(name="auto-exact", prompt_len=46, response_lens=[4, 3], mode="exact", chunk=5, page=4, block=3,
         prefix="auto", seed=11, worlds=(2, 3)),
]
for _case in CASES:
    _case["family"] = FAMILY
    if _case["mode"] == "exact":  # the turns, asked for (kept for comparison), where a case names no schedule
        _case.setdefault("prefix", "turns")
BY_NAME = {case["name"]: case for case in CASES}
OUT_DIRS = {}  # world size -> the directory its ranks wrote to (NVMe page files went under <dir>/nvme)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"cp{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    OUT_DIRS[world] = str(tmp_path_factory.mktemp(f"glmcp{world}"))
    return world, run_cp(world, CASES, OUT_DIRS[world])


def _group(case):
    return make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))


@pytest.fixture(scope="module")
def references():
    """name -> (grads, loss, logps, ref_logps) of the single-process float64 reference."""
    out, models = {}, {}
    for case in CASES:
        if case.get("low_precision"):
            continue
        key = tuple(sorted(case.get("model", {}).items()))
        model = models.setdefault(key, tiny_glm_moe_dsa(**case.get("model", {})))
        group, objective = _group(case), GRPOObjective(**case.get("objective", {}))
        fn = cache_continuation_logprobs if case["mode"] == "detached" else full_sequence_logprobs
        ref_model = tiny_glm_moe_dsa(seed=case["ref_seed"]) if "ref_seed" in case else None

        with glm_reference():
            grads, (loss, logps, ref) = reference_step(model, group, objective.group_loss, fn, ref_model)
        out[case["name"]] = (grads, loss, logps, ref)
    return out


@pytest.mark.parametrize("name", [c["name"] for c in CASES if not c.get("low_precision")])
def test_gradients_loss_logprobs_match_reference(world_results, references, name):
    world, results = world_results
    if name not in results:
        pytest.skip(f"{name} does not run on {world} ranks")
    ref_grads, ref_loss, ref_logps, ref_ref_logps = references[name]
    ranks = results[name]
    for rank, result in enumerate(ranks):
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank} of {world}: relative L2 {error:.3e}"
        assert set(result["grads"]) == set(ref_grads)
        assert not any(".indexer." in n for n in result["grads"]), "the indexer gets no gradient"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        for mine, ref in zip(result["logprobs"], ref_logps, strict=True):
            torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
        if ref_ref_logps is not None:
            for mine, ref in zip(result["ref_logprobs"], ref_ref_logps, strict=True):
                torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    for rank, result in enumerate(ranks[1:], start=1):
        assert all(torch.equal(result["grads"][n], ranks[0]["grads"][n]) for n in result["grads"]), \
            f"rank {rank} gradients differ from rank 0's"
        assert result["loss"] == ranks[0]["loss"]
        assert all(torch.equal(a, b) for a, b in zip(result["logprobs"], ranks[0]["logprobs"], strict=True))


def _prefix(case):
    """The prefix schedule a case runs: None in detached mode; "auto" is layer-major for this model."""
    if case["mode"] != "exact":
        return None
    return "layer_major" if case["prefix"] == "auto" else case["prefix"]


def _layout(case):
    """The layout a case runs: as asked, else "auto"'s: contiguous for exact mode's turns, zigzag otherwise."""
    return case.get("layout", "contiguous" if _prefix(case) == "turns" else "zigzag")


@pytest.mark.parametrize("name", ["ties-exact", "ties-detached", "ties-zigzag-exact", "ties-layer-major-exact"])
def test_zero_score_ties_select_the_reference_sets_everywhere(world_results, name):
    """Every selection of a full indexer layer, on every rank (capture: its shard; replay: every member, on every
    rank alike; exact mode's prefix pass: its shard again), equals the reference's canonical top-k over the whole
    sequence, although the tie-break alone decides many of them."""
    world, results = world_results
    if name not in results:
        pytest.skip(f"{name} does not run on {world} ranks")
    case = BY_NAME[name]
    group = _group(case)
    model = tiny_glm_moe_dsa(**case["model"])
    references = []
    for response in group.response_ids:
        record = []
        with glm_reference(record), torch.no_grad():
            model(torch.cat([group.prompt_ids, response]).unsqueeze(0), use_cache=False)
        references.append(reference_selections(record))
        assert boundary_ties(record) >= 10, "test setup: the tie-break must decide many selections"
    length = case["prompt_len"] - 1
    full_layers = [i for i, kind in enumerate(model.config.indexer_types) if kind == "full"]
    for rank, (own, result) in enumerate(zip(shard_pieces(length, world, _layout(case)), results[name], strict=True)):
        covered = {"capture": set(), "prefix": set(), "replay": []}
        captured = 0  # rows of selections made through the capture's exchange (the layer-major pass's too)
        member = -1
        for phase, layer, start, positions, valid in result["selections"]:
            if phase == "replay" and start == length and layer == full_layers[0]:
                member += 1  # a member's first replay block
            reference = references[max(member, 0)]  # prompt positions: the same in every member's sequence
            for row in range(positions.shape[0]):
                mine = set(positions[row][valid[row]].tolist())
                assert mine == reference[(layer, start + row)], (rank, phase, layer, start + row)
                if phase == "replay":
                    covered["replay"].append((member, layer, start + row))
                else:
                    covered[phase].add((layer, start + row))
                    captured += phase == "capture"
        shard = {(layer, t) for layer in full_layers for lo, hi in own for t in range(lo, hi)}
        assert covered["capture"] == shard
        # the turns recompute each selection in their segments' forward; the layer-major pass by the capture's
        # exchange again (in its backward walk, and in the recompute of a group's inputs), so each capture row is
        # recorded two or more times, every time equal to the reference's
        layer_major = _prefix(case) == "layer_major"
        assert covered["prefix"] == (shard if case["mode"] == "exact" and not layer_major else set())
        repeats, rest = divmod(captured, len(shard))
        assert rest == 0 and (repeats >= 2 if layer_major else repeats == 1)
        replayed = [(m, layer, length + t) for m, response in enumerate(group.response_ids) for layer in full_layers
                    for t in range(response.numel())]
        assert sorted(covered["replay"]) == sorted(replayed)


def test_prefix_pass_runs_as_asked(world_results):
    """Exact mode's prefix pass ran layer-major where a case asked for it, and in turns otherwise ("auto" for this
    model); detached mode runs none; the layout is the one asked for, or "auto"'s (_layout)."""
    world, results = world_results
    for name, ranks in results.items():
        case = BY_NAME[name]
        expected = _prefix(case)
        assert all(result["cp"]["prefix"] == expected for result in ranks), name
        assert all(result["cp"]["layout"] == _layout(case) for result in ranks), name


def test_the_prefix_pass_runs_the_top_layer_for_its_rows_alone(world_results):
    """The prefix pass's top layer (a shared one here) feeds nothing over the prompt: only its rows' gradients (on
    its gradient pages) go back through their projections, with no queries or partials exchanged for it, where the
    layers below it exchange as before: layer-major, every rank; in turns, no owner sends a request for it (the
    gradients equal the reference: test_gradients_...)."""
    world, results = world_results
    top = tiny_glm_moe_dsa().config.num_hidden_layers - 1
    ran = {"layer_major": 0, "turns": 0}
    for name, ranks in results.items():
        case = BY_NAME[name]
        if case["mode"] != "exact" or case.get("model") or "error" in ranks[0]:
            continue
        by_rank = [result["cp"]["received_bytes_by_layer"].get("prefix", {}) for result in ranks]
        for prefix in by_rank:
            assert top not in prefix, (name, prefix)
            if _prefix(case) == "layer_major":
                assert top - 1 in prefix, (name, prefix)
        if _prefix(case) == "turns" and any(by_rank):  # some owner reached another rank's pages
            assert any(top - 1 in prefix for prefix in by_rank), (name, by_rank)
        ran[_prefix(case)] += 1
    assert all(ran.values()), ran


def test_layer_major_keeps_every_layer_input_as_the_planner_counts(world_results):
    """The layer-major pass's retained layer inputs on each rank: the kept layers' over its own tokens (hidden x 8 B
    a token each; with prefix_inputs_every 3 also the selection layer 3 reuses from layer 2, index_topk int32 a
    token), what offload/plan.layer_inputs_bytes gives for the shape; the turns keep none."""
    from ds_longstraw.models.model_shape import shape_from_config
    from ds_longstraw.offload.auto import layer_inputs_bytes

    world, results = world_results
    config = tiny_glm_moe_dsa().config
    shape = shape_from_config(FAMILY, config, 8)
    kinds = config.indexer_types  # full, shared, full, shared

    def kept_selections(every):
        """Bases (0, every, ...) that reuse a selection made by a layer whose input is not kept."""
        made, count = None, 0
        for layer, kind in enumerate(kinds):
            count += layer % every == 0 and kind == "shared" and made is not None and made % every != 0
            made = layer if kind == "full" else made
        return count

    for name in ("layer-major-exact", "layer-major-inputs-every-2-exact", "layer-major-inputs-every-3-host-exact"):
        if name not in results:
            continue
        case = BY_NAME[name]
        for own, result in zip(shard_pieces(case["prompt_len"] - 1, world, "zigzag"), results[name], strict=True):
            every = result["cp"]["inputs_every"]  # "auto"'s for layer-major-exact
            assert every == case.get("inputs_every", every)
            tokens = sum(hi - lo for lo, hi in own)
            # kept layers' inputs (float64) + kept selections (index_topk int32 positions a token)
            expected = tokens * (config.hidden_size * 8 * -(-len(kinds) // every)
                                 + kept_selections(every) * config.index_topk * 4)
            assert result["retained"]["layer_inputs"] == expected, name
            assert result["retained"]["layer_inputs"] == layer_inputs_bytes(shape, tokens, every), name
    assert kept_selections(3) == 1 and kept_selections(2) == 0  # the cases above keep one and none
    assert all(result["retained"].get("layer_inputs", 0) == 0 for result in results["uneven-exact"])


def test_low_precision_within_twice_plain_error(world_results):
    """bfloat16 CP gradients err against float64 (the same bfloat16 weights, cast up) by at most 2x what
    transformers' own bfloat16 computation errs by, as on one rank (test_glm.py). Measured: 0.05-0.10 against
    transformers' 0.30, and 0.03 for the single-process transaction: in bfloat16 the discrete top-k flips where
    scores lie closer than the rounding of the hidden states, on any split of the work."""
    world, results = world_results
    case = BY_NAME["bfloat16-exact"]
    if case["name"] not in results:
        pytest.skip(f"runs on {case['worlds']} ranks")
    group, objective = _group(case), GRPOObjective()
    low = tiny_glm_moe_dsa(dtype=torch.bfloat16)
    reference = tiny_glm_moe_dsa(dtype=torch.bfloat16).double()

    def loss_of(model):
        return lambda: objective.group_loss(
            group, full_sequence_logprobs(model, group.prompt_ids, group.response_ids)).backward()

    with glm_reference():
        ref_grads, _ = grads_of(reference, loss_of(reference))
    plain, _ = grads_of(low, loss_of(low))
    plain_error = relative_l2({n: g.double() for n, g in plain.items()}, ref_grads)
    for result in results[case["name"]]:
        assert all(torch.isfinite(g).all() for g in result["grads"].values())
        error = relative_l2({n: g.double() for n, g in result["grads"].items()}, ref_grads)
        assert error <= 2 * plain_error, (error, plain_error)


def test_retained_bytes_split_over_ranks(world_results):
    """Each rank keeps the pages of its own tokens only: latent + rope key on every layer, indexer keys on full
    layers."""
    world, results = world_results
    config = tiny_glm_moe_dsa().config
    full = config.indexer_types.count("full")
    per_token_latent = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 8
    per_token_index = full * config.index_head_dim * 8
    for name, layout in (("uneven-detached", "zigzag"), ("contiguous-detached", "contiguous")):
        pieces = shard_pieces(BY_NAME[name]["prompt_len"] - 1, world, layout)
        for own, result in zip(pieces, results[name], strict=True):
            tokens = sum(hi - lo for lo, hi in own)
            assert result["retained"]["mla_latent_pages"] == tokens * per_token_latent
            assert result["retained"]["indexer_key_pages"] == tokens * per_token_index
            assert result["cp"]["layout"] == layout
            assert result["cp"]["shard"] == (own[0] if layout == "contiguous" else own)


def _servers(pieces, rank):
    """The ranks holding a key before the start of `rank`'s last non-empty piece (every key a query of it sees)."""
    starts = [lo for lo, hi in pieces[rank] if hi > lo]
    return [i for i, own in enumerate(pieces) if starts and i != rank and any(lo < starts[-1] for lo, hi in own
                                                                                if hi > lo)]


@pytest.mark.parametrize("name", ["uneven-detached", "contiguous-detached"])
def test_traffic_accounting(world_results, name):
    """What the counters report is what the design moves (float64: 8-byte elements, int32 positions). Replay, per
    replay block of q tokens: each full layer all-gathers every rank's candidates (min(topk, largest shard) score +
    position pairs per token), every layer all-gathers the partials (o_lat [H, R] + lse [H]) and all-reduces
    d(q_lat, q_rope). Capture: a rank's "servers" are the ranks holding keys before its last piece; from each rank
    it serves it receives the selectors (full layers) and the queries with the positions it owns (every layer),
    from each of its servers the candidates (as many columns as min(topk, the server's keys its latest piece
    sees)) and the partials; rows never travel. The capture's last layer moves nothing: it runs for its rows alone
    (grpo/cp/capture.last_layer_rows_only; a shared layer here, so the full layers' counts keep every full layer)."""
    world, results = world_results
    config = tiny_glm_moe_dsa().config
    heads, rank_, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    index_heads, index_dim, topk = config.index_n_heads, config.index_head_dim, config.index_topk
    layers, full = config.num_hidden_layers, config.indexer_types.count("full")
    case = BY_NAME[name]
    length = case["prompt_len"] - 1
    pieces = shard_pieces(length, world, _layout(case))
    sizes = [sum(hi - lo for lo, hi in own) for own in pieces]
    width = min(topk, max(sizes))
    blocks = [min(n, a + case["block"]) - a for n in case["response_lens"] for a in range(0, n, case["block"])]
    q = sum(blocks)
    expected_replay = {
        "sparse_candidate_scores": full * (world - 1) * q * width * 8,
        "sparse_candidates": full * (world - 1) * q * width * 4,
        "sparse_out": layers * (world - 1) * q * heads * rank_ * 8,
        "sparse_lse": layers * (world - 1) * q * heads * 8,
        "sparse_dq": layers * sum(2 * (world - 1) * (b * heads * (rank_ + rope) * 8) // world for b in blocks),
    }
    for rank, result in enumerate(results[name]):
        report = result["cp"]
        assert report["received_bytes_by_op"]["replay"] == expected_replay
        servers = _servers(pieces, rank)
        served = sum(sizes[j] for j in range(world) if rank in _servers(pieces, j))  # tokens of the ranks it serves
        seen = max(lo for lo, hi in pieces[rank] if hi > lo)  # the start of its last piece
        columns = sum(min(topk, sum(max(0, min(hi, seen) - lo) for lo, hi in pieces[i])) for i in servers)
        attending = layers - 1  # every layer but the last attends in capture
        assert config.indexer_types[-1] == "shared"
        expected_capture = {
            "sparse_selector": full * served * (index_heads * index_dim + index_heads) * 8,
            "sparse_query": attending * served * heads * (rank_ + rope) * 8,
            "sparse_positions": attending * served * topk * 4,
            "sparse_candidate_scores": full * columns * sizes[rank] * 8,
            "sparse_candidates": full * columns * sizes[rank] * 4,
            "sparse_out": attending * len(servers) * sizes[rank] * heads * rank_ * 8,
            "sparse_lse": attending * len(servers) * sizes[rank] * heads * 8,
        }
        got = report["received_bytes_by_op"]["capture"]
        assert got == {op: n for op, n in expected_capture.items() if n}
        assert layers - 1 not in report["received_bytes_by_layer"]["capture"]


def test_tiered_pages_leave_no_files(world_results):
    """The NVMe cases ran (their gradients are checked above) and every rank removed its page files."""
    world, results = world_results
    nvme_cases = [c["name"] for c in CASES if c.get("tier") == "nvme" and world in c.get("worlds", (world,))]
    assert nvme_cases, "no NVMe case runs on this world size"
    for name in nvme_cases:
        assert len(results[name]) == world
    nvme = os.path.join(OUT_DIRS[world], "nvme")
    assert os.path.isdir(nvme) and os.listdir(nvme) == []


# -- at the door --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("longstraw,match", [
    ({"cp_attention": "ulysses"}, r"'longstraw.cp_attention' = 'ulysses': under 'longstraw.cp_size' = 2, "
                                  r"layers \[0, 1, 2, 3\] attend a global top-k selection"),
    ({"prefix_grad": "exact", "prefix_keep_attention": True}, r"'longstraw.prefix_keep_attention' = True"),
], ids=["ulysses", "keep-attention"])
def test_what_context_parallelism_does_not_run_for_glm_is_refused_at_the_door(longstraw, match):
    """Refused before any work (check_topology, which build_topology runs first), naming the setting.
    (ZeRO-3 lockstep runs: tests/launcher/test_engine_cp.py, checks glm3 and glm3exact.)"""
    adapter = adapter_for(tiny_glm_moe_dsa())
    with pytest.raises(ValueError, match=match):
        check_topology(adapter, parse_config({"cp_size": 2, **longstraw}), 2)


# -- the page-wise math against its plain references (single process) --------------------------------------------
class _RanksPages:
    """What SparsePagesAttention does across ranks, in one process: rows split into "ranks" and pages, the
    partials page by page and rank by rank merged by LSE, the gradients page by page (d rows kept per page)."""

    def __init__(self, latents, ropes, page, scale):
        self.latents, self.ropes, self.page, self.scale = latents, ropes, page, scale
        self.d_rows = {}  # (rank, page start) -> (d latent, d rope)

    def _pages(self):
        offset = 0
        for rank, (lat, rope) in enumerate(zip(self.latents, self.ropes, strict=True)):
            for lo in range(0, lat.shape[0], self.page):
                yield rank, offset, lo, lat[lo:lo + self.page], rope[lo:lo + self.page]
            offset += lat.shape[0]

    def partials(self, layer, selected):
        query, positions, valid = selected
        out = torch.zeros(query[0].shape, dtype=torch.float64)
        lse = torch.full(query[0].shape[:2], float("-inf"), dtype=torch.float64)
        for _, offset, lo, lat, rope in self._pages():
            o, l_ = sparse_mla.page_partial(*query, lat, rope, offset + lo, positions, valid, self.scale)
            out, lse = merge_partials(out, lse, o, l_)
        return out, lse

    def partial_grads(self, layer, selected, partial, d_partial):
        (query, positions, valid), (out, lse), (d_out, d_lse) = selected, partial, d_partial
        delta = attention_delta(out, d_out, d_lse)
        d_query = [torch.zeros_like(q) for q in query]
        for rank, offset, lo, lat, rope in self._pages():
            d_lat_q, d_rope_q, d_lat, d_rope = sparse_mla.page_grads(*query, lat, rope, offset + lo, positions, valid,
                                                                     lse, d_out, delta, self.scale)
            d_query[0] += d_lat_q
            d_query[1] += d_rope_q
            self.d_rows[(rank, lo)] = (d_lat, d_rope)
        return d_query


def _pieces(lengths, width, gen, zero_rows=0.0):
    pieces = []
    for n in lengths:
        piece = torch.randn(n, width, generator=gen, dtype=torch.float64)
        if zero_rows:
            piece[torch.rand(n, generator=gen) < zero_rows] = 0.0
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("heads", [1, 3], ids=["one-head-ties", "three-heads"])
def test_global_selection_and_partials_over_ranks_and_pages_equal_the_plain_references(heads):
    """Keys before the segment split over "ranks" of 9, 0 and 11 rows, read in pages of 4: each rank's candidates
    page by page, merged in rank order, then the segment's own keys (dsa_select's prior) == one stable sort of the
    whole score matrix; the selected rows' partials page by page and rank by rank (selected_rows_attention), merged
    with the segment's own (sparse_latent_attention from the offset) == plain autograd over gathered rows, values
    and gradients (queries, every rank's pages: their gradients land per page)."""
    gen = torch.Generator().manual_seed(heads)
    ranks, tokens, topk, scale, page = [9, 0, 11], 6, 5, 0.7, 4
    start = sum(ranks)
    index_keys = _pieces(ranks + [tokens], 6, gen, zero_rows=0.3)
    index_q = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
    weights = torch.randn(tokens, heads, generator=gen, dtype=torch.float64)
    best, offset = None, 0
    for keys in index_keys[:-1]:
        mine = None
        for lo in range(0, keys.shape[0], page):
            mine = dsa.extend_candidates(mine, index_q, weights, keys[lo:lo + page], lo, None, topk, 0.4)
        if mine is not None:
            best = dsa.merge_candidates(best if best is not None else dsa.no_candidates(tokens, torch.float64, "cpu"),
                                        (mine[0], mine[1] + offset), topk)
        offset += keys.shape[0]
    positions, valid = dsa.dsa_select(index_q, weights, index_keys[-1:], start, topk, 0.4, offset=start, prior=best)
    plain = dsa.dsa_select_reference(index_q, weights, index_keys, start, topk, 0.4)
    assert torch.equal(positions, plain[0]) and torch.equal(valid, plain[1])

    latents = [p.requires_grad_() for p in _pieces(ranks + [tokens], 7, gen)]
    ropes = [p.requires_grad_() for p in _pieces(ranks + [tokens], 3, gen)]
    q_lat = torch.randn(tokens, 2, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    q_rope = torch.randn(tokens, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(tokens, 2, 7, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(tokens, 2, generator=gen, dtype=torch.float64)

    # the plain reference: every selected row gathered at once, softmax, lse through logsumexp
    rows_lat = sparse_mla.gather_rows(latents, positions)
    rows_rope = sparse_mla.gather_rows(ropes, positions)
    s = sparse_mla._block_scores(q_lat, q_rope, rows_lat, rows_rope, valid, scale, torch.float64)
    ref_out = torch.einsum("thk,tkr->thr", torch.softmax(s, -1), rows_lat)
    ref_lse = torch.logsumexp(s, -1)
    inputs = [q_lat, q_rope, *latents, *ropes]
    ref_grads = torch.autograd.grad([ref_out, ref_lse], inputs, [d_out, d_lse], allow_unused=True)

    pages = _RanksPages([p.detach() for p in latents[:-1]], [p.detach() for p in ropes[:-1]], page, scale)
    local_out, local_lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents[-1:], ropes[-1:], positions,
                                                              valid, scale, offset=start, with_lse=True)
    remote_out, remote_lse = selected_rows_attention(pages, 0, (q_lat, q_rope), positions, valid)
    out, lse = merge_partials(local_out, local_lse, remote_out, remote_lse)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    grads = torch.autograd.grad([out, lse], [q_lat, q_rope, latents[-1], ropes[-1]], [d_out, d_lse])
    for mine, ref in zip(grads, [ref_grads[0], ref_grads[1], ref_grads[2 + len(ranks)], ref_grads[-1]], strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-12)
    for rank, n in enumerate(ranks):  # the earlier ranks' rows: their gradients, page by page
        for which, ref in enumerate((ref_grads[2 + rank], ref_grads[3 + len(ranks) + rank])):
            ref = torch.zeros(n, (7, 3)[which], dtype=torch.float64) if ref is None else ref
            for lo in range(0, n, page):
                torch.testing.assert_close(pages.d_rows[(rank, lo)][which], ref[lo:lo + page], rtol=0, atol=1e-12)
    assert bool((positions < start)[valid].any()) and bool((positions >= start)[valid].any()), \
        "test setup: the selection must reach both the earlier ranks' rows and the segment's own"
