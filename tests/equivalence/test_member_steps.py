"""Members whose long untrained spans are captured, not replayed whole (grpo/member_steps.py, member_span_capture).

Equivalence chains (float64 models, float64 end to end), "masked loss" being tests/masked_loss.py's plain form:
  grpo_backward(detached, spans captured) == masked loss of transformers cache continuation log-probs
                                          == grpo_backward(detached, every member replayed whole)
  grpo_backward(exact, spans captured)    == masked loss of full-sequence autograd log-probs
                                          == grpo_backward(exact, every member replayed whole)
for qwen3_5 (Gated DeltaNet + attention: carries and pages both cross the steps) and glm_moe_dsa (MLA with DSA: a
selection over the member's earlier rows, a shared indexer layer, the MoE), members with tool spans at the start,
in the middle, at the end, back to back (one trained token between), one shorter than the threshold (replayed
with its region), a member that is all tool output, G = 1, KL to a reference, the host tier.
Tolerance: relative L2 <= 1e-8 over all parameter gradients, as test_agent_masks.py (the same float64 functions
differentiated in pieces: ~1e-12 measured; a step's rows or carry left without their later gradient moves the
gradient by 1e-2 or more). Each case also proves that the stepped path ran (a member that should take it did).
"""

import pytest
import torch
from glm_models import glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from masked_loss import masked_group, masked_grpo_loss
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.grpo import member_steps as member_steps_module
from ds_longstraw.grpo import replay as replay_module
from ds_longstraw.grpo.member_steps import Step, member_steps
from ds_longstraw.offload.staged_past import PagesPair

TOL = 1e-8
THRESHOLD = 4  # member_span_capture in these cases: tool spans of 4+ tokens are captured

CASES = {
    # name: (prompt length, members [(length, untrained spans)], replay_block, objective kwargs, tier, stepped)
    # stepped: how many members take the stepped path
    "spans-start-middle-end": (13, [(20, [(0, 5), (8, 13), (15, 20)]), (9, [(2, 7)]), (6, [(1, 3)])], 3, {}, None,
                               2),
    "back-to-back-and-short": (11, [(21, [(1, 6), (7, 12), (13, 15)]), (8, [])], 2, {}, None, 1),
    "all-tool-member": (12, [(9, [(0, 9)]), (6, [(2, 3)]), (7, [(0, 4)])], 4, {}, None, 2),
    "G1": (12, [(11, [(2, 8)])], 4, {}, None, 1),  # advantages given: one member has no group statistics
    "kl-host-tier": (14, [(15, [(3, 10)]), (7, [(0, 2)]), (11, [(5, 11)])], 3, {"kl_coef": 0.3}, "cpu", 2),
    "seq-mean": (10, [(12, [(0, 4), (6, 12)]), (5, [(4, 5)])], 5, {"loss_agg": "seq-mean-token-mean"}, None, 1),
}


def _config(mode, block, tier, capture):
    config = {"prefix_grad": mode, "capture_chunk": 5, "page_tokens": 3, "replay_block": block,
              "member_span_capture": capture}
    if tier is not None:
        config["offload"] = {"tier": tier}
    return config


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_5(), tiny_qwen3_5(seed=7)


@pytest.fixture
def stepped(monkeypatch):
    """How many members the stepped path ran."""
    calls = []
    original = replay_module.replay_in_steps

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(replay_module, "replay_in_steps", counted)
    return calls


@pytest.fixture
def row_sinks(monkeypatch):
    """How many key blocks' d(rows) an attention kernel added to earlier steps' rows through their sink
    (member_steps.RowLeaves): qwen3_5's attention takes it; GLM's absorbed MLA does not, and its rows' gradients
    reach the leaves through autograd."""
    calls = []

    class CountedPair(PagesPair):
        def __new__(cls, pair, grad_sink):
            def counted(*args):
                calls.append(1)
                return grad_sink(*args)

            return super().__new__(cls, pair, counted)

    monkeypatch.setattr(member_steps_module, "PagesPair", CountedPair)
    return calls


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_captured_spans_equal_the_reference_and_the_whole_replay(qwen, stepped, row_sinks, case, mode):
    model, ref_model = qwen
    prompt_len, members, block, kwargs, tier, expected = CASES[case]
    group = masked_group(prompt_len, members, seed=len(case))
    if group.size == 1:
        group = GRPOGroup(group.prompt_ids, group.response_ids, advantages=[0.7], response_masks=group.response_masks)
    reference = ref_model if kwargs.get("kl_coef") else None
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs

    def loss_fn(group, logps, ref):
        return masked_grpo_loss(group, logps, ref, **kwargs)

    with float64_model():
        ref_grads, (ref_loss, ref_logps, _) = reference_step(model, group, loss_fn, logprob_fn, reference)
        whole, whole_result = grads_of(model, lambda: grpo_backward(
            model, group, GRPOObjective(**kwargs), longstraw=_config(mode, block, tier, None), ref_model=reference))
        assert stepped == []
        grads, result = grads_of(model, lambda: grpo_backward(
            model, group, GRPOObjective(**kwargs), longstraw=_config(mode, block, tier, THRESHOLD),
            ref_model=reference))
    assert len(stepped) == expected and row_sinks
    assert relative_l2(grads, ref_grads) <= TOL
    assert relative_l2(grads, whole) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    assert result.loss == pytest.approx(whole_result.loss, rel=1e-12, abs=1e-12)
    # every scored token's log-prob is the reference's; a captured span's are not computed (0)
    for mine, ref, step_list in zip(result.logprobs, ref_logps, _steps(group), strict=True):
        scored = torch.ones(mine.numel(), dtype=torch.bool)
        for step in step_list or []:
            if not step.scored:
                scored[step.start:step.end] = False
        torch.testing.assert_close(mine[scored], ref.double()[scored], rtol=0, atol=1e-11)
        assert (mine[~scored] == 0).all()


def _steps(group):
    """Each member's steps (None: replayed whole); which tokens are scored does not depend on the block."""
    return [member_steps(group.mask(m), THRESHOLD, group.response_ids[m].numel()) for m in range(group.size)]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_glm_captured_spans_equal_the_reference(stepped, row_sinks, mode):
    """glm_moe_dsa: a prompt long enough that the selection is sparse (index_topk 8), a member whose later tokens
    select among its captured rows."""
    model = tiny_glm_moe_dsa()
    members = [(24, [(2, 14), (17, 21)]), (10, [(0, 3)])]
    group = masked_group(30, members, seed=9)
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs

    def loss_fn(group, logps, ref):
        return masked_grpo_loss(group, logps, ref)

    with glm_reference():
        ref_grads, (ref_loss, _, _) = reference_step(model, group, loss_fn, logprob_fn)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, GRPOObjective(),
                                                              longstraw=_config(mode, 5, None, THRESHOLD)))
    assert len(stepped) == 1 and not row_sinks  # the rows' gradients reached the leaves through autograd
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_captured_steps_run_the_last_layer_for_its_rows_alone(qwen, mode):
    """A captured span's steps score nothing, so their last layer computes only its rows and carry: the last
    layer's MLP sees each scored token of a stepped member twice (pass 1 and pass 2), each token of a member
    replayed whole once, and no prompt token (the capture runs its last layer for its rows alone too)."""
    model, _ = qwen
    prompt_len, members, block, _, _, _ = CASES["spans-start-middle-end"]
    group = masked_group(prompt_len, members, seed=5)
    tokens = []
    hook = model.model.layers[-1].mlp.register_forward_hook(lambda _, args, __: tokens.append(args[0].shape[1]))
    try:
        grpo_backward(model, group, GRPOObjective(), longstraw=_config(mode, block, None, THRESHOLD))
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    expected = 0
    for steps, response in zip(_steps(group), group.response_ids, strict=True):
        scored = [step for step in steps or [] if step.scored]
        expected += response.numel() if steps is None else 2 * sum(step.end - step.start for step in scored)
    assert any(steps and not all(step.scored for step in steps) for steps in _steps(group))
    assert sum(tokens) == expected


def test_steps_follow_the_spans():
    """Captured runs of at least the threshold cut into blocks; the regions between them one scored step each; a
    shorter untrained run stays inside its region; no captured run: None (replayed whole)."""
    mask = torch.tensor([False] * 5 + [True] * 2 + [False] * 2 + [True] + [False] * 7)
    assert member_steps(mask, 4, 3) == [Step(0, 3, False), Step(3, 5, False), Step(5, 10, True),
                                        Step(10, 13, False), Step(13, 16, False), Step(16, 17, False)]
    assert member_steps(mask, 8, 3) is None
    assert member_steps(mask, None, 3) is None
    assert member_steps(torch.ones(6, dtype=torch.bool), 1, 3) is None
    assert member_steps(torch.zeros(5, dtype=torch.bool), 5, 2) == [Step(0, 2, False), Step(2, 4, False),
                                                                    Step(4, 5, False)]


def test_no_rows_outlive_their_member():
    """Each earlier block's rows and gradients go with its reverse step by reference counting alone: nothing of
    member_steps.RowLeaves waits for the garbage collector (a sink that held its RowLeaves made a cycle that kept
    every block's rows of a member alive into the next members' replay)."""
    import gc

    model = tiny_qwen3_5()
    group = masked_group(12, [(16, [(2, 12)]), (14, [(1, 10)])], seed=4)
    gc.collect()
    gc.disable()
    try:
        grpo_backward(model, group, GRPOObjective(), longstraw=_config("detached", 3, None, THRESHOLD))
        alive = [o for o in gc.get_objects() if isinstance(o, member_steps_module.RowLeaves)]
    finally:
        gc.enable()
    assert alive == []


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_buffers_equal_the_plain_form(qwen, monkeypatch, mode):
    """The member's kept rows, carries and row gradients in one buffer per stream (grpo/member_buffers.py) give
    the gradient of the plain form, each kept as it came (buffered=False), and every kept row block and start
    carry a stepped member computes is a view of its stream's one buffer (what keeps the host heap whole)."""
    from ds_longstraw.grpo import member_buffers

    model, _ = qwen
    prompt_len, members, block, _, _, _ = CASES["spans-start-middle-end"]
    group = masked_group(prompt_len, members, seed=3)
    kept = []

    class Recording(member_buffers.MemberBuffers):
        def keep_row(self, layer, position, parts):
            views = super().keep_row(layer, position, parts)
            kept.extend(("row", layer, i, v.untyped_storage().data_ptr()) for i, v in enumerate(views))
            return views

        def keep_carry(self, index, carry):
            views = super().keep_carry(index, carry)
            kept.extend(("carry", layer, i, v.untyped_storage().data_ptr())
                        for layer, parts in views.items() for i, v in enumerate(parts))
            return views

    monkeypatch.setattr(member_steps_module, "MemberBuffers", Recording)
    original = replay_module.replay_in_steps
    with float64_model():
        buffered, result = grads_of(model, lambda: grpo_backward(
            model, group, GRPOObjective(), longstraw=_config(mode, block, None, THRESHOLD)))
        monkeypatch.setattr(replay_module, "replay_in_steps",
                            lambda *args, **kwargs: original(*args, **kwargs, buffered=False))
        plain, plain_result = grads_of(model, lambda: grpo_backward(
            model, group, GRPOObjective(), longstraw=_config(mode, block, None, THRESHOLD)))
    # the same values, summed in the same order: only the storage differs
    assert relative_l2(buffered, plain) <= 1e-12
    assert result.loss == plain_result.loss
    rows = {entry[:3] for entry in kept if entry[0] == "row"}
    carries = {entry[:3] for entry in kept if entry[0] == "carry"}
    assert rows and carries
    # two stepped members: per stream, one buffer each (the same stream's views of one member share a storage)
    storages = {}
    for kind, layer, part, pointer in kept:
        storages.setdefault((kind, layer, part), set()).add(pointer)
    assert all(len(pointers) <= 2 for pointers in storages.values())
    assert sum(1 for entry in kept if entry[0] == "row") > 2 * len(rows)
