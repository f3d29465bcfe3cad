"""Masked groups (response masks of agent trajectories) with the prompt sharded over 2 and 3 gloo ranks, against
single-process float64 references of the masked loss (tests/masked_loss.py: the mask multiplies the token losses).

Equivalence chains (float64 model, float64_model()):
  CP grpo_backward(detached, masks), every rank == masked loss of transformers cache continuation log-probs
  CP grpo_backward(exact, masks), every rank    == masked loss of full-sequence autograd log-probs
  every rank's gradients are bitwise identical; loss and every response token's log-prob equal the reference's
  nothing trained: loss 0 and every gradient exactly 0 on every rank
  members with tool spans in steps (member_span_capture, the replicated replay): the same chains
Tolerance: relative L2 <= 1e-8 over all parameter gradients, as test_cp_transaction.py (CP changes only the
association order of float64 sums, ~1e-10; dropped masks move the gradient by ~0.5, test_agent_masks.py).
CP 2 and CP 3 run in one launch of 3 forked ranks (tests/cp_scripts/masks.py).
"""

import functools

import pytest
import torch
from cp_scripts.masks import CP_SIZES, MODEL, case_group, run_masks
from grads import relative_l2
from masked_loss import masked_grpo_loss
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

TOL = 1e-8

CASES = [
    # prompt[:-1] = 22 tokens: shards 11/11 and 8/7/7; chunks of 4 divide neither
    dict(name="spans-detached", prompt_len=23, members=[(7, [(0, 2)]), (6, [(2, 4)]), (5, [(3, 5)])],
         mode="detached", chunk=4, page=3, block=3),
    dict(name="all-false-member-seq-mean-exact", prompt_len=20, members=[(6, [(2, 3)]), (3, [(0, 3)]), (5, [(4, 5)])],
         mode="exact", chunk=4, page=3, block=2, objective={"loss_agg": "seq-mean-token-mean"}, seed=1),
    # KL to a separate reference model (captured and scored over the CP group), pages in NVMe files
    dict(name="kl-nvme-exact", prompt_len=19, members=[(4, [(1, 3)]), (6, [(0, 6)]), (5, [(0, 1)])], mode="exact",
         chunk=5, page=4, block=4, objective={"kl_coef": 0.3}, ref_seed=7, tier="nvme", seed=3),
    # members whose tool spans (3+ tokens here) run in steps (grpo/member_steps.py), every rank replaying every
    # member; then the spread replay (each rank its own members, under a lockstep over the CP group: a slot runs
    # in steps of one block on every rank where any rank's member of it does; steps=None: it varies by rank)
    dict(name="tool-steps-exact", prompt_len=21, members=[(14, [(0, 4), (6, 11)]), (5, [(1, 2)]), (9, [(2, 9)])],
         mode="exact", chunk=4, page=3, block=2, seed=5, steps=2,
         longstraw={"cp_replay": "replicated", "member_span_capture": 3}),
    dict(name="tool-steps-detached", prompt_len=18, members=[(12, [(3, 12)]), (6, [(0, 5)])], mode="detached",
         chunk=5, page=2, block=3, tier="cpu", seed=6, steps=2,
         longstraw={"cp_replay": "replicated", "member_span_capture": 3}),
    dict(name="tool-steps-spread-exact", prompt_len=21, members=[(14, [(0, 4), (6, 11)]), (5, [(1, 2)]),
                                                                (9, [(2, 9)]), (4, [])],
         mode="exact", chunk=4, page=3, block=2, seed=7, steps=None,
         longstraw={"cp_replay": "spread", "member_span_capture": 3}),
    dict(name="tool-steps-spread-detached", prompt_len=18, members=[(12, [(3, 12)]), (6, [(0, 5)]), (3, [])],
         mode="detached", chunk=5, page=2, block=3, tier="cpu", seed=8, steps=None,
         longstraw={"cp_replay": "spread", "member_span_capture": 3}),
    dict(name="nothing-trained-exact", prompt_len=17, members=[(4, [(0, 4)]), (3, [(0, 3)])], mode="exact", chunk=5,
         page=2, block=3, tier="cpu", seed=4),
]
BY_NAME = {case["name"]: case for case in CASES}


OUT_DIR = {}


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    OUT_DIR["path"] = tmp_path_factory.mktemp("cp_masks")
    return run_masks(CASES, str(OUT_DIR["path"]))


@pytest.fixture(scope="module")
def references():
    """name -> (grads, loss, logps) of the single-process float64 masked reference."""
    out = {}
    model = tiny_qwen3_5(**MODEL)
    for case in CASES:
        group = case_group(case)
        fn = cache_continuation_logprobs if case["mode"] == "detached" else full_sequence_logprobs
        ref_model = tiny_qwen3_5(seed=case["ref_seed"], **MODEL) if "ref_seed" in case else None

        loss_fn = functools.partial(masked_grpo_loss, **case.get("objective", {}))
        with float64_model():
            grads, (loss, logps, _) = reference_step(model, group, loss_fn, fn, ref_model)
        out[case["name"]] = (grads, loss, logps)
    return out


@pytest.mark.parametrize("cp_size", CP_SIZES, ids=lambda n: f"cp{n}")
@pytest.mark.parametrize("name", [c["name"] for c in CASES if not c["name"].startswith("nothing")])
def test_masked_cp_matches_reference(cp_results, references, name, cp_size):
    ref_grads, ref_loss, ref_logps = references[name]
    ranks = cp_results[(name, cp_size)]
    for rank, result in enumerate(ranks):
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank} of {cp_size}: relative L2 {error:.3e}"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        assert [lp.numel() for lp in result["logprobs"]] == [length for length, _ in BY_NAME[name]["members"]]
        if BY_NAME[name].get("steps", 0) is not None:
            assert result["members_in_steps"] == BY_NAME[name].get("steps", 0)
        for mine, ref, scored in zip(result["logprobs"], ref_logps, _scored(name), strict=True):
            torch.testing.assert_close(mine[scored], ref.double()[scored], rtol=0, atol=1e-11)
    if BY_NAME[name].get("steps", 0) is None:  # the spread replay: some rank's slot ran in steps
        assert any(result["members_in_steps"] for result in ranks)
    for rank, result in enumerate(ranks[1:], start=1):
        assert result["grads"].keys() == ranks[0]["grads"].keys()
        assert all(torch.equal(result["grads"][n], ranks[0]["grads"][n]) for n in result["grads"]), \
            f"rank {rank} gradients differ from rank 0's"


def _scored(name):
    """Each member's tokens whose log-probs are computed (a span in steps has none: member_steps.py)."""
    from ds_longstraw.grpo.member_steps import member_steps

    case, out = BY_NAME[name], []
    threshold = case.get("longstraw", {}).get("member_span_capture")
    group = case_group(case)
    for member in range(group.size):
        scored = torch.ones(group.response_ids[member].numel(), dtype=torch.bool)
        for step in member_steps(group.mask(member), threshold, case["block"]) or []:
            scored[step.start:step.end] &= step.scored
        out.append(scored)
    return out


@pytest.mark.parametrize("cp_size", CP_SIZES, ids=lambda n: f"cp{n}")
def test_nothing_trained_is_zero_on_every_rank(cp_results, cp_size):
    for result in cp_results[("nothing-trained-exact", cp_size)]:
        assert result["loss"] == 0.0
        assert result["grads"], "no backward ran"
        assert all(torch.count_nonzero(g) == 0 for g in result["grads"].values())


def test_nvme_page_files_removed(cp_results):
    assert (("kl-nvme-exact", 2) in cp_results) and list((OUT_DIR["path"] / "nvme").iterdir()) == []
