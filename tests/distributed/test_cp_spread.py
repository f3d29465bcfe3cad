"""The CP replay spread ("cp_replay": "spread"): rank r replays and scores only the members m with m mod N = r,
its attention reaching every rank's pages by queries out and partials back (grpo/cp/spread.py), on 2, 3 and 4
gloo ranks, against single-process float64 references; and gathered ("gathered", or "auto" at these sizes): the
same members over every rank's pages gathered once (grpo/cp/gathered.py), nothing exchanged per layer.

  qwen3_5   every rank == transformers cache continuation (detached) / full-sequence autograd (exact), as
            test_cp_transaction.py, for G = 1 (fewer members than ranks: the others replay dummies), 2, 3
            and 5 (more members than ranks, uneven shares), the host and NVMe tiers, KL to a separate reference
  glm_moe_dsa  every rank == single-process grpo_backward (itself equal to transformers' float64 model within
            1e-15, test_glm.py): the global top-k's candidates and the selected rows' partials travel to each
            query's owner
Also: each rank replayed exactly its share (GroupResult.extras["cp"]["replayed_members"]) and every rank's
gradients are bitwise identical (one all-reduce). (Bytes moved and CPU seconds, spread vs replicated: BENCHMARKS.md.)
Tolerance: relative L2 <= 1e-8 (as the other CP tests: the spread only re-associates
float64 sums; a member replayed twice or not at all, or a d(query) share returned to the wrong rank, is off by far
more than that).
"""

import os

import pytest
import torch
from cp_scripts.harness import make_group, run_cp
from glm_models import glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOObjective, grpo_backward

TOL = 1e-8
WORLDS = [2, 3, 4]
GLM = "glm_moe_dsa"

CASES = [
    dict(name="G3-detached", prompt_len=23, response_lens=[5, 3, 4], mode="detached", chunk=4, page=3, block=3),
    dict(name="G2-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3, seed=1),
    dict(name="G5-exact", prompt_len=21, response_lens=[2, 5, 1, 3, 4], mode="exact", chunk=5, page=4, block=2,
         seed=2),
    dict(name="G1-exact", prompt_len=19, response_lens=[6], mode="exact", chunk=4, page=3, block=4, seed=3),
    dict(name="host-kl-exact", prompt_len=19, response_lens=[4, 6, 2], mode="exact", chunk=5, page=4, block=4,
         tier="cpu", objective={"kl_coef": 0.3}, ref_seed=7, seed=4, worlds=(2, 3)),
    dict(name="nvme-detached", prompt_len=20, response_lens=[4, 2, 3], mode="detached", chunk=5, page=2, block=3,
         tier="nvme", seed=5, worlds=(3, 4)),
    dict(name="glm-G3-exact", family=GLM, prompt_len=45, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4,
         block=3, seed=6),
    dict(name="glm-G5-detached", family=GLM, prompt_len=44, response_lens=[1, 4, 2, 3, 5], mode="detached",
         chunk=9, page=4, block=2, seed=7, worlds=(2, 4)),
    # fewer keys than index_topk (8): each block's selection width (min(topk, position + 1)) differs between the
    # rank replaying the member and those padding with a one-token dummy (G = 1, blocks of 2)
    dict(name="glm-G1-short-exact", family=GLM, prompt_len=5, response_lens=[4], mode="exact", chunk=2, page=2,
         block=2, seed=8, worlds=(2, 3)),
    # the same case replicated (the switch keeps today's schedule)
    dict(name="G3-detached-replicated", prompt_len=23, response_lens=[5, 3, 4], mode="detached", chunk=4, page=3,
         block=3, cp_replay="replicated"),
    # "gathered": the same members, every rank's pages gathered once and replayed locally (grpo/cp/gathered.py);
    # exact mode's page gradients summed back to the rows' ranks. Host and NVMe tiers, KL, G < N, both families.
    dict(name="gathered-G2-exact", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         seed=1, cp_replay="gathered"),
    dict(name="gathered-host-kl-exact", prompt_len=19, response_lens=[4, 6, 2], mode="exact", chunk=5, page=4,
         block=4, tier="cpu", objective={"kl_coef": 0.3}, ref_seed=7, seed=4, worlds=(2, 3), cp_replay="gathered"),
    dict(name="gathered-nvme-detached", prompt_len=20, response_lens=[4, 2, 3], mode="detached", chunk=5, page=2,
         block=3, tier="nvme", seed=5, worlds=(3, 4), cp_replay="gathered"),
    dict(name="gathered-glm-G3-exact", family=GLM, prompt_len=45, response_lens=[5, 3, 4], mode="exact", chunk=5,
         page=4, block=3, seed=6, cp_replay="gathered"),
    dict(name="gathered-glm-G1-short-exact", family=GLM, prompt_len=5, response_lens=[4], mode="exact", chunk=2,
         page=2, block=2, seed=8, worlds=(2, 3), cp_replay="gathered"),
    # "auto" at these sizes gathers (offload/auto.replay_schedule: far below GATHER_HOST_BYTES)
    dict(name="auto-glm-G5-detached", family=GLM, prompt_len=44, response_lens=[1, 4, 2, 3, 5], mode="detached",
         chunk=9, page=4, block=2, seed=7, worlds=(2, 4), cp_replay="auto"),
]
for _case in CASES:
    _case.setdefault("cp_replay", "spread")
RESOLVED = {"auto": "gathered"}  # what each case's cp_replay runs as, where "auto" decides
BY_NAME = {case["name"]: case for case in CASES}
OUT_DIRS = {}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"cp{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"spread{world}")
    OUT_DIRS[world] = str(out)
    return world, run_cp(world, CASES, str(out))


def _config(case):
    return {"prefix_grad": case["mode"], "capture_chunk": case["chunk"], "page_tokens": case["page"],
            "replay_block": case["block"]}


@pytest.fixture(scope="module")
def references():
    """name -> (grads, loss, logps) of the single-process float64 reference."""
    out = {}
    for case in CASES:
        group = make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))
        objective = GRPOObjective(**case.get("objective", {}))
        if case.get("family") == GLM:
            model = tiny_glm_moe_dsa()
            with glm_reference():
                grads, result = grads_of(model, lambda model=model, group=group, objective=objective, case=case:
                                         grpo_backward(model, group, objective, longstraw=_config(case)))
            out[case["name"]] = (grads, result.loss, result.logprobs)
            continue
        model = tiny_qwen3_5()
        ref_model = tiny_qwen3_5(seed=case["ref_seed"]) if "ref_seed" in case else None
        fn = cache_continuation_logprobs if case["mode"] == "detached" else full_sequence_logprobs

        with float64_model():
            grads, (loss, logps, _) = reference_step(model, group, objective.group_loss, fn, ref_model)
        out[case["name"]] = (grads, loss, logps)
    return out


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_gradients_loss_logprobs_match_reference(world_results, references, name):
    world, results = world_results
    if name not in results:
        pytest.skip(f"{name} does not run on {world} ranks")
    ref_grads, ref_loss, ref_logps = references[name]
    ranks = results[name]
    for rank, result in enumerate(ranks):
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank} of {world}: relative L2 {error:.3e}"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        assert len(result["logprobs"]) == len(ref_logps)
        for mine, ref in zip(result["logprobs"], ref_logps, strict=True):
            torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    for result in ranks[1:]:
        assert all(torch.equal(result["grads"][n], ranks[0]["grads"][n]) for n in ranks[0]["grads"])


def test_each_rank_replays_its_share(world_results):
    world, results = world_results
    for name, ranks in results.items():
        members = len(BY_NAME[name]["response_lens"])
        shares = [r["cp"]["replayed_members"] for r in ranks]
        asked = BY_NAME[name]["cp_replay"]
        assert all(r["cp"]["replay"] == RESOLVED.get(asked, asked) for r in ranks), name
        if asked != "replicated":
            assert shares == [list(range(rank, members, world)) for rank in range(world)], name
        else:
            assert all(share == list(range(members)) for share in shares), name


def test_gathered_replay_exchanges_nothing_per_layer(world_results):
    """A gathered replay's only collectives are the one gather of the pages (and exact mode's one return of their
    gradients): no query, partial or candidate travels per layer and block, as the spread replay's do."""
    world, results = world_results
    for name, ranks in results.items():
        asked = BY_NAME[name]["cp_replay"]
        ops = {op for r in ranks for op in r["cp"]["received_bytes_by_op"].get("replay", {})}
        if RESOLVED.get(asked, asked) == "gathered":
            exact = BY_NAME[name]["mode"] == "exact"
            assert ops <= {"gather_pages", "return_page_grads"}, (name, ops)
            assert "gather_pages" in ops and ("return_page_grads" in ops) == exact, (name, ops)
        elif asked == "spread":
            assert any(op.startswith("spread") for op in ops), (name, ops)


def test_no_page_files_left(world_results):
    world, _ = world_results
    nvme = os.path.join(OUT_DIRS[world], "nvme")
    assert not os.path.isdir(nvme) or os.listdir(nvme) == []
