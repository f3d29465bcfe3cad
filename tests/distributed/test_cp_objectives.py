"""The objective's options under context parallelism (CP 2, gloo ranks), both gradient modes and both replay
placements, against the peers' losses applied to single-process float64 full-sequence autograd (or the cache
continuation for detached mode): tests/objective_cases.py's cases, its group (tool masks, an all-masked member, old
and sampler log-probs). Tolerance as test_cp_transaction.py: relative L2 1e-8 on every rank (CP only reorders
float64 sums)."""

import pytest
import torch
from cp_scripts.harness import run_cp
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from objective_cases import CASES as OBJECTIVES
from objective_cases import Batch, objective_group

from ds_longstraw import GRPOObjective

TOL = 1e-8
CASES = [
    dict(name="entropy-exact", objective_case="trl-bnpo-entropy", mode="exact", cp_replay="replicated"),
    dict(name="entropy-detached-spread", objective_case="trl-bnpo-entropy", mode="detached", cp_replay="spread"),
    dict(name="dual-clip-kl-entropy-exact-spread", objective_case="verl-dual-clip-bites-low-var-kl-entropy",
         mode="exact", cp_replay="spread", ref_seed=7),
    dict(name="sequence-ratio-kl-exact", objective_case="trl-dapo-sequence-kl", mode="exact", ref_seed=7),
    dict(name="dr-grpo-rollout-detached", objective_case="trl-dr_grpo-rollout-correction", mode="detached"),
    dict(name="cispo-exact", objective_case="trl-cispo-token-truncate", mode="exact"),
]
for case in CASES:
    case.update(prompt_len=21, response_lens=[], chunk=6, page=4, block=4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cp(2, CASES, str(tmp_path_factory.mktemp("cp_objectives")))


def _reference(case):
    model = tiny_qwen3_5()
    arguments, peer = OBJECTIVES[case["objective_case"]]
    objective = GRPOObjective(**arguments)
    group = objective_group(model)
    logprob_fn = cache_continuation_logprobs if case["mode"] == "detached" else full_sequence_logprobs
    with float64_model():
        refs = None
        if objective.kl_coef:
            with torch.no_grad():
                refs = logprob_fn(tiny_qwen3_5(seed=case["ref_seed"]), group.prompt_ids, group.response_ids)

        def step():
            entropies = []
            logps = logprob_fn(model, group.prompt_ids, group.response_ids, entropies)
            loss = peer(Batch(group, objective, logps, refs, entropies))
            loss.backward()
            return float(loss.detach())

        return grads_of(model, step)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_objective_under_context_parallelism(results, case):
    ref_grads, ref_loss = _reference(case)
    for rank, result in enumerate(results[case["name"]]):
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank}: relative L2 {error:.3e}"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
