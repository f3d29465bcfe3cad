"""Agent trajectories: response masks (GRPOGroup.response_masks) train only the policy's own tokens.

Equivalence chains (float64 model, float64_model() making transformers compute in float64 end to end), where
"masked loss" is written out plainly in tests/masked_loss.py (masked_grpo_loss: the mask multiplies the token losses, an
independent route from the objective's selection of trained tokens):
  grpo_backward(detached, masks) == masked loss of transformers cache continuation log-probs
  grpo_backward(exact, masks)    == masked loss of full-sequence autograd log-probs
  both baselines (masks)         == masked loss of full-sequence autograd log-probs
  result.logprobs                == the reference's log-probs of EVERY response token, trained or not
  masks all True                 == no masks
  masks all False                == loss 0, every gradient exactly 0 (no 0/0)
Tolerance: relative L2 <= 1e-8 over all parameter gradients, as test_transaction.py (same float64 functions
in a different order leave ~1e-11; dropping the masks moves the gradient by 0.5 and shifting them by one token by
0.7, measured on "spans-start-middle-end"; test_masks_move_the_reference_gradient asserts > 1e-2).
Context parallelism: tests/distributed/test_cp_masks.py; the launcher: tests/launcher/test_launcher_masks.py.
"""

import math

import pytest
import torch
from grads import grads_of, relative_l2
from masked_loss import masked_group, masked_grpo_loss
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward

TOL = 1e-8


CASES = {
    # name: (prompt length, members [(length, context-only spans)], capture_chunk, page_tokens, replay_block,
    #        objective kwargs, offload tier)
    "spans-start-middle-end": (23, [(7, [(0, 2)]), (6, [(2, 4)]), (5, [(3, 5)])], 6, 4, 3, {}, None),
    "all-false-member-token-mean": (19, [(5, [(1, 3)]), (4, [(0, 4)]), (6, [(0, 1), (4, 6)])], 5, 3, 4, {}, None),
    "all-false-member-seq-mean": (20, [(6, [(2, 3)]), (3, [(0, 3)]), (5, [(4, 5)]), (2, [])], 7, 4, 2,
                                  {"loss_agg": "seq-mean-token-mean"}, None),
    "kl-token-mean": (21, [(6, [(2, 5)]), (3, [(0, 3)]), (5, [(0, 2)])], 6, 4, 4, {"kl_coef": 0.3}, None),
    "kl-seq-mean": (18, [(4, [(0, 1)]), (7, [(1, 6)]), (5, [(0, 5)])], 4, 3, 3,
                    {"kl_coef": 0.2, "loss_agg": "seq-mean-token-mean"}, None),
    "one-trained-token-host-tier": (17, [(5, [(0, 4)]), (1, [])], 5, 2, 2, {}, "cpu"),
    "kl-nvme-tier": (22, [(6, [(3, 6)]), (4, [(1, 2)])], 6, 4, 3, {"kl_coef": 0.1}, "nvme"),
}


def _config(mode, chunk, page, block, tier, tmp_path):
    config = {"prefix_grad": mode, "capture_chunk": chunk, "page_tokens": page, "replay_block": block}
    if tier is not None:
        config["offload"] = {"tier": tier}
        if tier == "nvme":
            config["offload"]["nvme_path"] = str(tmp_path)
    return config


def _reference(model, group, objective_kwargs, logprob_fn, ref_model=None):
    def loss_fn(group, logps, ref):
        return masked_grpo_loss(group, logps, ref, **objective_kwargs)

    grads, (loss, logps, _) = reference_step(model, group, loss_fn, logprob_fn, ref_model)
    return grads, (loss, logps)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def ref_model():
    return tiny_qwen3_5(seed=7)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_masked_transaction_matches_reference(model, ref_model, tmp_path, case, mode):
    prompt_len, members, chunk, page, block, objective_kwargs, tier = CASES[case]
    group = masked_group(prompt_len, members, seed=len(case))
    reference = ref_model if objective_kwargs.get("kl_coef") else None
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    config = _config(mode, chunk, page, block, tier, tmp_path)
    with float64_model():
        ref_grads, (ref_loss, ref_logps) = _reference(model, group, objective_kwargs, reference_fn, reference)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, GRPOObjective(**objective_kwargs),
                                                              longstraw=config, ref_model=reference))
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    # every response token's log-prob comes back, the masked-out ones too
    assert [lp.numel() for lp in result.logprobs] == [length for length, _ in members]
    for mine, ref in zip(result.logprobs, ref_logps, strict=True):
        torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    if tier == "nvme":
        assert list(tmp_path.iterdir()) == [], "page files left behind"


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_old_logprobs_outside_the_mask_are_ignored(model, mode):
    """Old log-probs far from the current ones (clipping active) at trained tokens, NaN at the masked-out ones
    (a sampler writes none for a tool's output): the loss and gradients are the reference's, and finite."""
    members = [(6, [(1, 4)]), (5, [(0, 2)]), (4, [(3, 4)])]
    base = masked_group(20, members, seed=5)
    gen = torch.Generator().manual_seed(11)
    with float64_model(), torch.no_grad():
        current = cache_continuation_logprobs(model, base.prompt_ids, base.response_ids)
    old = [torch.where(m, lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5), float("nan"))
           for lp, m in zip(current, base.response_masks, strict=True)]
    group = GRPOGroup(base.prompt_ids, base.response_ids, rewards=base.rewards, old_logprobs=old,
                      response_masks=base.response_masks)
    ratios = torch.cat([torch.exp(c - o)[m] for c, o, m in zip(current, old, base.response_masks, strict=True)])
    assert ((ratios < 0.9) | (ratios > 1.1)).any(), "test setup: clipping must be active"
    kwargs = {"clip_low": 0.1, "clip_high": 0.1}
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, kwargs, reference_fn)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, GRPOObjective(**kwargs), longstraw={
            "prefix_grad": mode, "capture_chunk": 6, "page_tokens": 4, "replay_block": 3}))
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_nothing_trained_gives_zero_loss_and_zero_gradients(model, mode, agg):
    """Every member all False: 0 trained tokens, so loss 0 and gradients exactly 0 (not NaN from 0/0); the
    backward still runs through every member (the parameters have .grad), as ZeRO-3's lockstep needs."""
    group = masked_group(15, [(4, [(0, 4)]), (3, [(0, 3)])], seed=2)
    config = {"prefix_grad": mode, "capture_chunk": 5, "page_tokens": 4, "replay_block": 2}
    with float64_model():
        grads, result = grads_of(model, lambda: grpo_backward(model, group, GRPOObjective(loss_agg=agg),
                                                              longstraw=config))
    assert result.loss == 0.0
    assert grads, "no backward ran"
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert all(torch.isfinite(lp).all() for lp in result.logprobs)


def test_all_true_masks_equal_no_masks(model):
    members = [(5, []), (3, []), (6, [])]
    masked = masked_group(19, members, seed=4)
    plain = GRPOGroup(masked.prompt_ids, masked.response_ids, rewards=masked.rewards)
    config = {"prefix_grad": "exact", "capture_chunk": 6, "page_tokens": 4, "replay_block": 4}
    for agg in ("token-mean", "seq-mean-token-mean"):
        with float64_model():
            with_masks, a = grads_of(model, lambda agg=agg: grpo_backward(model, masked, GRPOObjective(loss_agg=agg),
                                                                  longstraw=config))
            without, b = grads_of(model, lambda agg=agg: grpo_backward(model, plain, GRPOObjective(loss_agg=agg),
                                                               longstraw=config))
        assert relative_l2(with_masks, without) <= 1e-12  # the same float64 operations on the same values
        assert a.loss == pytest.approx(b.loss, rel=1e-12)


def test_masks_move_the_reference_gradient(model):
    """The tests above could not tell a dropped or shifted mask from a correct one if masking barely changed the
    gradient: it changes it by far more than their tolerance."""
    prompt_len, members, *_ = CASES["spans-start-middle-end"]
    group = masked_group(prompt_len, members, seed=len("spans-start-middle-end"))
    unmasked = GRPOGroup(group.prompt_ids, group.response_ids, rewards=group.rewards,
                         response_masks=[torch.ones_like(m) for m in group.response_masks])
    shifted = GRPOGroup(group.prompt_ids, group.response_ids, rewards=group.rewards,
                        response_masks=[torch.roll(m, 1) for m in group.response_masks])
    with float64_model():
        masked_grads, _ = _reference(model, group, {}, full_sequence_logprobs)
        for other in (unmasked, shifted):
            other_grads, _ = _reference(model, other, {}, full_sequence_logprobs)
            assert relative_l2(other_grads, masked_grads) > 1e-2


@pytest.mark.parametrize("baseline", ["conventional", "per_member"])
def test_baselines_train_only_masked_in_tokens(model, ref_model, baseline):
    from ds_longstraw.tools import baselines

    prompt_len, members, *_ = CASES["kl-seq-mean"]
    group = masked_group(prompt_len, members, seed=9)
    kwargs = {"kl_coef": 0.2, "loss_agg": "seq-mean-token-mean"}
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, kwargs, full_sequence_logprobs, ref_model)
        grads, result = grads_of(model, lambda: baselines.BASELINES[baseline](model, group, GRPOObjective(**kwargs),
                                                                              ref_model=ref_model))
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)


# ---- the objective on its own: per-token arithmetic on Python floats -------------------------------------------

P = torch.tensor([3, 4, 5])


def _hand_masked_loss(logps, olds, refs, masks, advs, clip_low, clip_high, kl, agg, empty="count"):
    member_sums, counts = [], []
    for lp, old, ref, mask, adv in zip(logps, olds, refs, masks, advs, strict=True):
        total, count = 0.0, 0
        for t in range(len(lp)):
            if not mask[t]:
                continue
            ratio = math.exp(lp[t] - old[t])
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            d = ref[t] - lp[t]
            total += -min(ratio * adv, clipped * adv) + kl * (math.exp(d) - d - 1)
            count += 1
        member_sums.append(total)
        counts.append(count)
    if agg == "token-mean":
        return sum(member_sums) / sum(counts)
    means = [s / c for s, c in zip(member_sums, counts, strict=True) if c]
    return sum(means) / (len(counts) if empty == "count" else len(means))


@pytest.mark.parametrize("agg,empty", [("token-mean", "count"), ("seq-mean-token-mean", "count"),
                                       ("seq-mean-token-mean", "skip")])
def test_masked_loss_matches_hand_arithmetic(agg, empty):
    """A member with no trained token: out of token-mean's count; in seq-mean-token-mean's member count as a 0
    ("count", TRL's and verl's: the mean over 3 members) or out of it ("skip": over the 2 that train)."""
    gen = torch.Generator().manual_seed(0)
    responses = [torch.tensor([1, 2, 3, 4]), torch.tensor([4, 8]), torch.tensor([5, 6, 7])]
    masks = [torch.tensor([True, False, False, True]), torch.tensor([False, False]), torch.tensor([False, True, True])]
    logps = [-torch.rand(r.numel(), generator=gen, dtype=torch.float64) * 3 for r in responses]
    olds = [lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in logps]
    refs = [lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in logps]
    group = GRPOGroup(P, responses, rewards=[0.3, 1.0, -0.2], old_logprobs=olds, response_masks=masks)
    objective = GRPOObjective(clip_low=0.1, clip_high=0.3, kl_coef=0.05, loss_agg=agg, empty_members=empty)
    advs = objective.advantages(group).tolist()
    expected = _hand_masked_loss([x.tolist() for x in logps], [x.tolist() for x in olds], [x.tolist() for x in refs],
                                 [m.tolist() for m in masks], advs, 0.1, 0.3, 0.05, agg, empty)
    assert float(objective.group_loss(group, logps, refs)) == pytest.approx(expected, rel=1e-12)
    if agg == "seq-mean-token-mean":  # the two conventions differ by 3/2 here
        other = _hand_masked_loss([x.tolist() for x in logps], [x.tolist() for x in olds],
                                  [x.tolist() for x in refs], [m.tolist() for m in masks], advs, 0.1, 0.3, 0.05, agg,
                                  "skip" if empty == "count" else "count")
        assert float(objective.group_loss(group, logps, refs)) != pytest.approx(other, rel=1e-3)


def test_masked_out_tokens_get_zero_gradient():
    group = GRPOGroup(P, [torch.tensor([1, 2, 3])], advantages=[1.0],
                      response_masks=[torch.tensor([True, False, True])])
    logp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    GRPOObjective().group_loss(group, [logp]).backward()
    # ratio 1 (no old log-probs): d loss / d logp_t = -A / 2 at the 2 trained tokens, 0 at the tool's token
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.0, -0.5])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_objective_with_no_trained_token_is_zero_not_nan(agg):
    group = GRPOGroup(P, [torch.tensor([1, 2]), torch.tensor([3])], rewards=[1.0, 0.0],
                      response_masks=[torch.zeros(2, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)])
    logps = [torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True),
             torch.tensor([-0.5], dtype=torch.float64, requires_grad=True)]
    loss = GRPOObjective(loss_agg=agg).group_loss(group, logps)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    loss.backward()
    assert logps[0].grad.tolist() == [0.0, 0.0] and logps[1].grad.tolist() == [0.0]


# ---- validation at the door ----------------------------------------------------------------------------------------

R = [torch.tensor([1, 2]), torch.tensor([7]), torch.tensor([4, 5, 6])]
T, F = True, False


@pytest.mark.parametrize("masks,message", [
    ([torch.tensor([T, F]), torch.tensor([T]), torch.tensor([T, F])],
     "response_masks\\[2\\] has 2 entries, response_ids\\[2\\] has 3 tokens"),
    ([torch.tensor([T, F]), torch.tensor([1]), torch.tensor([T, F, T])], "response_masks\\[1\\] must be boolean"),
    ([torch.tensor([T, F]), torch.tensor([T]), torch.tensor([1.0, 0.0, 1.0])],
     "response_masks\\[2\\] must be boolean"),
    ([torch.tensor([T, F]), torch.tensor([T])], "response_masks has 2 entries but there are 3 responses"),
    ([torch.tensor([T, F]), torch.tensor([T]), torch.tensor([T, F, T]), torch.tensor([T])],
     "response_masks has 4 entries but there are 3 responses"),
    (torch.ones(3, 3, dtype=torch.bool), "one tensor"),
    ([torch.tensor([[T, F]]), torch.tensor([T]), torch.tensor([T, F, T])], "response_masks\\[0\\] must be 1-D"),
    ([[T, F], "yes", [T, F, T]], "response_masks\\[1\\] must be"),
])
def test_bad_masks_raise_naming_the_member(masks, message):
    with pytest.raises(ValueError, match=message):
        GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5], response_masks=masks)


def test_old_logprobs_must_be_finite_where_trained():
    masks = [torch.tensor([T, F]), torch.tensor([T]), torch.tensor([F, F, T])]
    nan = float("nan")
    GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5], response_masks=masks,
              old_logprobs=[[-1.0, nan], [-1.0], [nan, float("inf"), -2.0]])  # masked-out: ignored
    with pytest.raises(ValueError, match="old_logprobs\\[2\\] holds NaN or inf at a trained token"):
        GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5], response_masks=masks,
                  old_logprobs=[[-1.0, nan], [-1.0], [-1.0, -1.0, nan]])
    with pytest.raises(ValueError, match="old_logprobs\\[0\\] holds NaN"):
        GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5], old_logprobs=[[-1.0, nan], [-1.0], [-1.0, -1.0, -1.0]])


def test_lists_of_booleans_are_masks_and_count_trained_tokens():
    group = GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5], response_masks=[[T, F], [F], [T, T, F]])
    assert all(m.dtype == torch.bool for m in group.response_masks)
    assert [group.trained_tokens(i) for i in range(3)] == [1, 0, 2] and group.trained_tokens() == 3
    assert group.response_tokens == 6  # every token is replayed
    assert GRPOGroup(P, R, rewards=[1.0, 0.0, 0.5]).mask(2).tolist() == [T, T, T]


# ---- JSONL groups with masks (ds_longstraw.tools.data) ---------------------------------------------------------------

class _WordTokenizer:
    """Stands in for a transformers tokenizer: one id per whitespace-separated word (the first letter's code), so
    segment boundaries are visible in the ids."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(word[0]) % 97 for word in text.split()]}


def _source(tmp_path, records, tokenizer=None):
    import json

    from ds_longstraw.tools.data import GroupSource

    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return GroupSource(path, tokenizer=tokenizer)


def test_jsonl_token_id_masks(tmp_path):
    source = _source(tmp_path, [
        {"prompt_ids": [1, 2, 3], "response_ids": [[4, 5, 6, 7, 8], [9, 10]], "rewards": [1.0, 0.0],
         "response_masks": [[1, 1, 0, 0, 1], [0, 0]]},
        {"prompt_ids": [1, 2], "response_ids": [[4, 5], [6]], "advantages": [0.5, -0.5],
         "response_masks": [[True, False], [True]], "old_logprobs": [[-1.0, float("nan")], [-2.0]]},
        {"prompt_ids": [1, 2], "response_ids": [[4]], "advantages": [0.5]},
    ])
    first, second, third = (source.group(i) for i in range(3))
    assert [m.tolist() for m in first.response_masks] == [[T, T, F, F, T], [F, F]]
    assert [m.tolist() for m in second.response_masks] == [[T, F], [T]]
    assert second.old_logprobs[0][0] == -1.0  # NaN at the masked-out token is accepted
    assert third.response_masks is None


def test_jsonl_text_segments(tmp_path):
    record = {"prompt": "system user asks", "rewards": [1.0, 0.0, 0.5], "responses": [
        [{"text": "call tool", "train": True}, {"text": "result rows here", "train": False},
         {"text": "answer", "train": True}],
        "plain answer",  # a plain string trains every token
        [{"text": "observation first", "train": False}, {"text": "", "train": True}, {"text": "done", "train": True}],
    ]}
    group = _source(tmp_path, [record], _WordTokenizer()).group(0)
    ids = lambda text: [ord(w[0]) % 97 for w in text.split()]  # noqa: E731
    assert [r.tolist() for r in group.response_ids] == [ids("call tool result rows here answer"),
                                                        ids("plain answer"), ids("observation first done")]
    assert [m.tolist() for m in group.response_masks] == [[T, T, F, F, F, T], [T, T], [F, F, T]]
    # plain strings only: no masks at all
    plain = _source(tmp_path, [{"prompt": "a b", "responses": ["c d"], "advantages": [1.0]}], _WordTokenizer())
    assert plain.group(0).response_masks is None


@pytest.mark.parametrize("record, words", [
    ({"prompt_ids": [1, 2], "response_ids": [[3, 4], [5]], "rewards": [1.0, 0.0],
      "response_masks": [[1, 0], [1, 1]]}, ["groups.jsonl:1", "response_masks[1] has 2 entries"]),
    ({"prompt_ids": [1, 2], "response_ids": [[3, 4], [5]], "rewards": [1.0, 0.0], "response_masks": [[1, 2], [1]]},
     ["groups.jsonl:1", "response_masks[0]", "0/1", "2"]),
    ({"prompt_ids": [1, 2], "response_ids": [[3, 4], [5]], "rewards": [1.0, 0.0], "response_masks": [[1, 0]]},
     ["groups.jsonl:1", "response_masks has 1 entries but there are 2 responses"]),
    ({"prompt_ids": [1, 2], "response_ids": [[3]], "rewards": [1.0], "response_masks": [1]},
     ["groups.jsonl:1", "response_masks[0] must be a list"]),
    ({"prompt": "a b", "responses": ["c d"], "rewards": [1.0], "response_masks": [[1, 0]]},
     ["groups.jsonl:1", "'response_masks' goes with 'response_ids'"]),
    ({"prompt": "a b", "responses": [[{"text": "c", "train": 1}]], "rewards": [1.0]},
     ["groups.jsonl:1", "responses[0] segment 0", "'train' must be true or false"]),
    ({"prompt": "a b", "responses": ["c", [{"text": "c"}]], "rewards": [1.0, 0.0]},
     ["groups.jsonl:1", "responses[1] segment 0", "\"train\""]),
    ({"prompt": "a b", "responses": [[{"text": "c", "train": True, "role": "tool"}]], "rewards": [1.0]},
     ["groups.jsonl:1", "responses[0] segment 0"]),
    ({"prompt": "a b", "responses": [[{"text": 3, "train": True}]], "rewards": [1.0]},
     ["groups.jsonl:1", "'text' must be a string"]),
    ({"prompt": "a b", "responses": [{"text": "c", "train": True}], "rewards": [1.0]},
     ["groups.jsonl:1", "responses[0] must be text or a list of segments"]),
    ({"prompt": "a b", "responses": [[{"text": "", "train": True}]], "rewards": [1.0]},
     ["groups.jsonl:1", "response_ids[0] is empty"]),
])
def test_bad_mask_records_name_the_line_and_member(tmp_path, record, words):
    source = _source(tmp_path, [record], _WordTokenizer())
    with pytest.raises(ValueError) as error:
        source.group(0)
    for word in words:
        assert word in str(error.value), str(error.value)
    assert str(error.value).count("groups.jsonl:1") == 1, str(error.value)
