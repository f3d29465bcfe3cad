"""Groups that share a document, captured once (grpo/shared.py, grpo/document.py): the tree transaction.

Equivalence chains (float64 models, float64 end to end), summed over the step's groups:
  grpo_backward_shared(detached) == the masked GRPO loss of transformers cache continuation log-probs, per group
                                 == grpo_backward of each group alone
  grpo_backward_shared(exact)    == the masked GRPO loss of full-sequence autograd log-probs, per group
                                 == grpo_backward of each group alone
for qwen3_5 (the document's recurrent state and its attention pages both reach every question) and glm_moe_dsa
(a sparse selection over the document's rows and each question's own), with questions of different lengths (one
that adds no captured token: its prompt is the document and one token), members with tool spans captured in
steps, G = 1, KL to a reference (scored under the document's reference capture), the host and NVMe tiers, and the
document said on the groups or found from the prompts.
Tolerance: relative L2 <= 1e-8 over all parameter gradients, as test_member_steps.py (the same float64 functions
differentiated in pieces: ~1e-12 measured; a document whose d(state) missed one group's share moves the gradient
by 1e-2 or more, which test_a_missing_share_is_seen checks can be told apart).
"""

import pytest
import torch
from glm_models import glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from masked_loss import masked_grpo_loss, masks_from_spans
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward, grpo_backward_shared
from ds_longstraw.grpo import document as document_module
from ds_longstraw.grpo.document import common_prefix, document_tokens

TOL = 1e-8


def _groups(document, questions, members, seed=0, said=False):
    """One group per question: prompt = document + question; members: per group [(length, tool spans)]."""
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(0, 97, (document,), generator=gen)
    groups = []
    for length, group_members in zip(questions, members, strict=True):
        question = torch.randint(0, 97, (length,), generator=gen)
        responses = [torch.randint(0, 97, (n,), generator=gen) for n, _ in group_members]
        rewards = torch.rand(len(responses), generator=gen).tolist()
        extra = {"advantages": [0.6]} if len(responses) == 1 else {"rewards": rewards}
        groups.append(GRPOGroup(torch.cat([doc, question]), responses, response_masks=masks_from_spans(group_members),
                                shared_prefix=document if said else None, **extra))
    return groups


def _config(mode, tier=None, span=None, shared_min=8):
    config = {"prefix_grad": mode, "capture_chunk": 5, "page_tokens": 3, "replay_block": 3,
              "member_span_capture": span, "shared_prefix_min": shared_min}
    if tier is not None:
        config["offload"] = {"tier": tier}
    return config


def _reference(model, groups, mode, ref_model=None, **kwargs):
    """Summed gradients and each group's loss by plain autograd, one group at a time."""
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    total, losses = {}, []
    for group in groups:
        grads, (loss, _, _) = reference_step(model, group, lambda g, lp, ref: masked_grpo_loss(g, lp, ref, **kwargs),
                                             logprob_fn, ref_model)
        for name, grad in grads.items():
            total[name] = total.get(name, 0) + grad
        losses.append(loss)
    return total, losses


def _separately(model, groups, objective, config, ref_model=None):
    def run():
        return [grpo_backward(model, group, objective, longstraw=config, ref_model=ref_model) for group in groups]

    return grads_of(model, run)


@pytest.fixture
def documents(monkeypatch):
    """The document lengths the shared step captured."""
    seen = []
    original = document_module.SharedDocument.__init__

    def counted(self, tokens, *args, **kwargs):
        seen.append(tokens)
        original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(document_module.SharedDocument, "__init__", counted)
    return seen


CASES = {
    # name: (document, question lengths, members per group, objective kwargs, tier, member_span_capture, said)
    "three-questions": (23, [1, 4, 9], [[(5, []), (3, [])], [(4, []), (6, [(1, 3)])], [(2, []), (5, [])]], {},
                        None, None, False),
    "said-G1-host": (17, [6, 2], [[(7, [])], [(4, []), (3, [])]], {}, "cpu", None, True),
    "tool-spans-in-steps": (19, [3, 7], [[(12, [(2, 8)]), (4, [])], [(9, [(0, 5)]), (3, [(1, 2)])]], {}, None, 4,
                            False),
    "kl-reference": (21, [2, 5, 3], [[(4, []), (3, [])], [(5, []), (2, [])], [(3, []), (4, [])]],
                     {"kl_coef": 0.3}, None, None, False),
    "seq-mean-nvme": (16, [4, 8], [[(5, [(0, 2)]), (6, [])], [(3, []), (4, [])]], {"loss_agg": "seq-mean-token-mean"},
                      "nvme", None, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_a_shared_document_equals_the_groups_alone_and_the_reference(documents, case, mode, tmp_path):
    model, ref_model = tiny_qwen3_5(), tiny_qwen3_5(seed=7)
    doc, questions, members, kwargs, tier, span, said = CASES[case]
    groups = _groups(doc, questions, members, seed=len(case), said=said)
    reference = ref_model if kwargs.get("kl_coef") else None
    config = _config(mode, tier, span)
    if tier == "nvme":
        config["offload"] = {"tier": "nvme", "nvme_path": str(tmp_path)}
    objective = GRPOObjective(**kwargs)
    with float64_model():
        ref_grads, ref_losses = _reference(model, groups, mode, reference, **kwargs)
        alone, alone_results = _separately(model, groups, objective, config, reference)
        assert documents == []
        grads, results = grads_of(model, lambda: grpo_backward_shared(model, groups, objective, longstraw=config,
                                                                      ref_model=reference))
    assert documents == [doc]  # captured once, at the document's length
    assert relative_l2(grads, ref_grads) <= TOL
    assert relative_l2(grads, alone) <= TOL
    for result, alone_result, ref_loss in zip(results, alone_results, ref_losses, strict=True):
        assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        assert result.loss == pytest.approx(alone_result.loss, rel=1e-12, abs=1e-12)
        for mine, theirs in zip(result.logprobs, alone_result.logprobs, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
        assert result.extras["document"]["tokens"] == doc
    if tier == "nvme":
        assert list(tmp_path.iterdir()) == []  # every page file of the document and the questions is gone


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_glm_shared_document_equals_the_reference(documents, mode):
    """glm_moe_dsa: a document long enough that the selection is sparse (index_topk 8) over its rows and each
    question's, a shared indexer layer reusing the selection, the MoE."""
    model = tiny_glm_moe_dsa()
    groups = _groups(30, [3, 6], [[(6, []), (4, [])], [(5, []), (7, [])]], seed=5)
    with glm_reference():
        ref_grads, ref_losses = _reference(model, groups, mode)
        grads, results = grads_of(model, lambda: grpo_backward_shared(model, groups, GRPOObjective(),
                                                                      longstraw=_config(mode)))
    assert documents == [30]
    assert relative_l2(grads, ref_grads) <= TOL
    for result, ref_loss in zip(results, ref_losses, strict=True):
        assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("case", ["three-questions", "tool-spans-in-steps", "kl-reference", "seq-mean-nvme"])
def test_the_flat_form_equals_the_groups_alone(case, mode):
    """grpo/flat_document.py (what engine.grpo_step runs where ranks pad their calls or shard the prompt): the
    groups as one group over the document, each member opening with its question masked out, its group's advantage
    and LossScope, and old log-probs padded over the question; then split back. Its gradient is the groups' own
    transactions' sum and each group's loss and log-probs are its own transaction's. In detached mode each member
    holds its question (GRPOGroup.held_prefixes: a question's state is a constant of its group's prompt, a
    member's own context is not); the last assertion shows that without the hold the two differ."""
    from ds_longstraw.grpo.flat_document import flatten, split

    model, ref_model = tiny_qwen3_5(), tiny_qwen3_5(seed=7)
    doc, questions, members, kwargs, _, span, _ = CASES[case]
    tier = None  # the flat group is one ordinary group: tiers are proven on it elsewhere (NVMe here took 150 s)
    groups = _groups(doc, questions, members, seed=len(case))
    gen = torch.Generator().manual_seed(11)
    for group in groups:  # the sampler's log-probs (two iterations' clipping reads them)
        group.old_logprobs = [-torch.rand(r.numel(), generator=gen, dtype=torch.float64) for r in group.response_ids]
    reference = ref_model if kwargs.get("kl_coef") else None
    config = _config(mode, tier, span)
    objective = GRPOObjective(**kwargs)
    scopes = [objective.scope_of([group], weight=0.5) for group in groups]
    flat = flatten(groups, doc, objective, scopes, mode)
    assert flat.group.prompt_ids.numel() == doc and flat.group.size == sum(g.size for g in groups)
    assert (flat.group.held_prefixes is not None) == (mode == "detached")
    with float64_model():
        alone, alone_results = grads_of(model, lambda: [
            grpo_backward(model, group, objective, longstraw=config, ref_model=reference, loss_scope=scope)
            for group, scope in zip(groups, scopes, strict=True)])
        grads, merged = grads_of(model, lambda: grpo_backward(model, flat.group, objective, longstraw=config,
                                                              ref_model=reference, loss_scope=flat.scopes))
    assert relative_l2(grads, alone) <= TOL
    results = split(flat, merged, groups, objective)
    assert merged.loss == pytest.approx(sum(r.loss for r in results), rel=1e-12, abs=1e-12)
    for result, alone_result in zip(results, alone_results, strict=True):
        assert result.loss == pytest.approx(alone_result.loss, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(result.advantages, alone_result.advantages.to(result.advantages.dtype))
        for mine, theirs in zip(result.logprobs, alone_result.logprobs, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
        if reference is not None:
            for mine, theirs in zip(result.ref_logprobs, alone_result.ref_logprobs, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
        assert result.extras["document"]["tokens"] == doc
    if case == "three-questions" and mode == "detached":
        not_held = flatten(groups, doc, objective, scopes)  # the questions replayed with autograd
        with float64_model():
            flat_not_held, _ = grads_of(model, lambda: grpo_backward(model, not_held.group, objective,
                                                                     longstraw=config, loss_scope=not_held.scopes))
        assert relative_l2(flat_not_held, alone) > 1e-4


def test_a_missing_share_is_seen(monkeypatch):
    """The tolerance can tell: dropping the last group's d(state at the document's end) moves the gradient far
    beyond it (the sum of every group's share is what makes exact mode exact)."""
    model = tiny_qwen3_5()
    groups = _groups(23, [4, 9], [[(4, []), (6, [])], [(2, []), (5, [])]], seed=3)
    original = document_module.SharedDocument.add_carry_grads
    calls = []

    def dropping(self, d_carry):
        calls.append(1)
        if len(calls) < len(groups):
            original(self, d_carry)

    with float64_model():
        ref_grads, _ = _reference(model, groups, "exact")
        monkeypatch.setattr(document_module.SharedDocument, "add_carry_grads", dropping)
        grads, _ = grads_of(model, lambda: grpo_backward_shared(model, groups, GRPOObjective(),
                                                                longstraw=_config("exact")))
    assert relative_l2(grads, ref_grads) > 1e-4


def test_where_the_document_ends():
    """Found: the longest common prefix where it reaches shared_prefix_min, at most the shortest prompt - 1; said:
    on every group alike, their prompts agreeing there; one group, or a short prefix: no document."""
    groups = _groups(12, [3, 1, 5], [[(2, [])]] * 3)
    assert common_prefix([g.prompt_ids for g in groups]) >= 12
    assert document_tokens(groups, 8) == 12  # the one-token question's prompt: 13 tokens, 12 captured
    assert document_tokens(groups, 64) is None and document_tokens(groups, None) is None
    assert document_tokens(groups[:1], 8) is None
    said = _groups(12, [3, 5], [[(2, [])]] * 2, said=True)
    assert document_tokens(said, None) == 12
    said[1].shared_prefix = 10
    with pytest.raises(ValueError, match="shared_prefix"):
        document_tokens(said, None)
    other = _groups(12, [3], [[(2, [])]], seed=9, said=True)
    with pytest.raises(ValueError, match=r"groups\[1\].prompt_ids differ"):
        document_tokens([said[0], other[0]], None)
    with pytest.raises(ValueError, match="shared_prefix must be a token count"):
        GRPOGroup(torch.arange(5), [torch.arange(2)], rewards=[1.0], shared_prefix=5)


def test_what_does_not_run_yet_is_refused_by_name():
    groups = _groups(12, [3, 5], [[(2, [])]] * 2)
    with pytest.raises(ValueError, match="cp_size"):
        grpo_backward_shared(tiny_qwen3_5(), groups, longstraw={"cp_size": 2, "shared_prefix_min": 8})


def test_glm_flat_form_holds_the_questions():
    """glm_moe_dsa in detached mode, the flat form (grpo/flat_document.py): each member holds its question, whose
    latent and indexer-key rows the response's sparse selection reads as constants; the gradient equals the groups
    run alone (relative 1e-8, float64)."""
    from ds_longstraw.grpo.flat_document import flatten

    model = tiny_glm_moe_dsa()
    groups = _groups(30, [3, 6], [[(6, []), (4, [])], [(5, []), (7, [])]], seed=5)
    objective = GRPOObjective()
    scopes = [objective.scope_of([group], weight=0.5) for group in groups]
    flat = flatten(groups, 30, objective, scopes, "detached")
    config = _config("detached")
    with glm_reference():
        alone, _ = grads_of(model, lambda: [grpo_backward(model, group, objective, longstraw=config, loss_scope=scope)
                                            for group, scope in zip(groups, scopes, strict=True)])
        grads, _ = grads_of(model, lambda: grpo_backward(model, flat.group, objective, longstraw=config,
                                                         loss_scope=flat.scopes))
    assert relative_l2(grads, alone) <= TOL
