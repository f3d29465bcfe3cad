"""Every objective option through the transaction, in both gradient modes, against the peers' own losses applied to
independent float64 log-probs and entropies of the transformers model.

Reference: every member's log-probs and entropies by full-sequence autograd of the model (exact mode) or its cache
continuation from the prompt (detached mode), entropies by torch.distributions; the reference policy's log-probs
without a graph; then TRL 1.16's GRPOTrainer._compute_loss or verl's definitions (tests/peer_losses.py) on the
padded batch, back-propagated once. Tolerance as test_transaction.py: relative L2 1e-8 over all parameter
gradients (same functions in another order leave ~1e-11; a wrong term errs by 1e-3 or more).

GLM (glm_moe_dsa, tests/glm_models.py): three of the cases (entropy bonus; a dual clip that bites + low_var_kl to a
separate reference model + entropy; rollout correction with the Dr. GRPO sum-norm) on the tiny GLM model under
glm_reference() (transformers' model in float64 with the canonical indexer top-k), the reference being the same
full-sequence / cache-continuation log-probs and entropies of transformers' model, as test_glm.py's; the same
tolerance (test_glm.py's for GLM in float64: both sides compute the same float64 functions in another order).
"""

import pytest
import torch
from glm_models import glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from objective_cases import CASES, Batch, objective_group
from peer_losses import verl_loss

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward

TOL = 1e-8


@pytest.fixture(scope="module")
def models():
    return tiny_qwen3_5(), tiny_qwen3_5(seed=7)


@pytest.fixture(scope="module")
def glm_models():
    return tiny_glm_moe_dsa(), tiny_glm_moe_dsa(seed=7)


def _assert_case(model, ref_model, case, mode, context):
    """grpo_backward with CASES[case]'s settings on objective_group's group == the peer's loss on the reference
    log-probs (and entropies) of the model under `context` (float64_model or glm_reference); returns the gradients."""
    arguments, peer = CASES[case]
    objective = GRPOObjective(**arguments)
    group = objective_group(model, context=context)
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    config = {"prefix_grad": mode, "capture_chunk": 6, "page_tokens": 4, "replay_block": 4}
    temperature = objective.temperature  # the references score logits / temperature, as TRL does
    with context():
        with torch.no_grad():
            refs = [lp.detach() for lp in logprob_fn(ref_model, group.prompt_ids, group.response_ids,
                                                     temperature=temperature)]

        def reference():
            entropies = []
            logps = logprob_fn(model, group.prompt_ids, group.response_ids, entropies, temperature=temperature)
            loss = peer(Batch(group, objective, logps, refs if objective.kl_coef else None, entropies))
            loss.backward()
            return float(loss.detach())

        ref_grads, ref_loss = grads_of(model, reference)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config,
                                                              ref_model=ref_model))
    error = relative_l2(grads, ref_grads)
    assert error <= TOL, error
    assert result.loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    return grads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_objective_through_the_transaction(models, case, mode):
    _assert_case(*models, case, mode, float64_model)


GLM_CASES = ["trl-bnpo-entropy", "verl-dual-clip-bites-low-var-kl-entropy", "trl-dr_grpo-rollout-correction"]


@pytest.mark.parametrize("case", GLM_CASES)
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_objective_through_the_transaction_glm(glm_models, case, mode):
    """The same on GLM (sparse attention over a 21-token prompt with index_topk 8, routed experts)."""
    grads = _assert_case(*glm_models, case, mode, glm_reference)
    assert not any(".indexer." in name for name in grads), "the indexer gets no gradient, as the model defines"


def test_group_of_one_as_verl(models):
    """verl's lone member: A = r / (1 + 1e-6), a gradient where the default gives none."""
    model, _ = models
    gen = torch.Generator().manual_seed(4)
    group = GRPOGroup(torch.randint(0, 97, (15,), generator=gen), [torch.randint(0, 97, (5,), generator=gen)],
                      rewards=[0.8])
    objective = GRPOObjective(group_of_one="reward")
    config = {"prefix_grad": "exact", "capture_chunk": 6, "page_tokens": 4, "replay_block": 4}
    with float64_model():
        def reference():
            logps = full_sequence_logprobs(model, group.prompt_ids, group.response_ids)
            batch = torch.stack(logps)
            loss = verl_loss(batch, torch.ones_like(batch), torch.tensor([0.8 / (1 + 1e-6)], dtype=torch.float64),
                             batch.detach())
            loss.backward()

        ref_grads, _ = grads_of(model, reference)
        grads, _ = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config))
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 0
    assert relative_l2(grads, ref_grads) <= TOL
