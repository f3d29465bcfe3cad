"""GRPOGroup validation and the GRPO objective's formula, checked against hand-written per-token arithmetic."""

import math

import pytest
import torch

from ds_longstraw import GRPOGroup, GRPOObjective

P = torch.tensor([3, 4, 5])
R = [torch.tensor([1, 2]), torch.tensor([7])]


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_ids=P, response_ids=[torch.tensor([1]), torch.tensor([], dtype=torch.long)], rewards=[1, 2]),
     "response_ids\\[1\\] is empty"),
    (dict(prompt_ids=torch.tensor([3]), response_ids=R, rewards=[1, 2]), "at least 2 tokens"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1, 2, 3]), "rewards has 3 entries"),
    (dict(prompt_ids=P, response_ids=R, advantages=[1.0]), "advantages has 1 entries"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1.0, float("nan")]), "rewards must be finite"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1.0, float("inf")]), "rewards must be finite"),
    (dict(prompt_ids=P, response_ids=R), "neither was given"),
    (dict(prompt_ids=P.float(), response_ids=R, rewards=[1, 2]), "prompt_ids must hold integer"),
    (dict(prompt_ids=P, response_ids=[torch.tensor([1.5]), R[1]], rewards=[1, 2]),
     "response_ids\\[0\\] must hold integer"),
    (dict(prompt_ids=P, response_ids=[], rewards=[]), "at least one response"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1, 2], old_logprobs=[torch.zeros(2)]), "old_logprobs has 1 entries"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1, 2], old_logprobs=[torch.zeros(2), torch.zeros(2)]),
     "old_logprobs\\[1\\] has 2 entries"),
    (dict(prompt_ids=P, response_ids=R, rewards=[1, 2], advantages=[1, 2]), "not both"),
    (dict(prompt_ids=torch.tensor([3, -1]), response_ids=R, rewards=[1, 2]), "negative token id"),
])
def test_bad_groups_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOGroup(**kwargs)


def test_vocab_check_names_the_tensor():
    group = GRPOGroup(P, [torch.tensor([1, 200])], advantages=[1.0])
    with pytest.raises(ValueError, match="response_ids\\[0\\] holds token id 200"):
        group.check_vocab(97)


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_agg="sum"), "loss_agg"), (dict(clip_low=-0.1), "clip_low"), (dict(kl_coef=float("nan")), "kl_coef"),
])
def test_bad_objective_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOObjective(**kwargs)


def test_advantages():
    group = GRPOGroup(P, R + [torch.tensor([9])], rewards=[1.0, 0.0, 2.0])
    rewards = [1.0, 0.0, 2.0]
    mean = sum(rewards) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    assert GRPOObjective().advantages(group).tolist() == pytest.approx(expected, rel=1e-12)
    assert GRPOObjective(scale_rewards=False).advantages(group).tolist() == pytest.approx([r - mean for r in rewards])
    given = GRPOGroup(P, R, advantages=[0.5, -2.0])
    assert GRPOObjective().advantages(given).tolist() == [0.5, -2.0]


def _hand_loss(logps, olds, refs, advs, clip_low, clip_high, kl, agg):
    """Per-token arithmetic on Python floats, written independently of the tensor code."""
    member_sums, counts = [], []
    for lp, old, ref, adv in zip(logps, olds, refs, advs, strict=True):
        total = 0.0
        for t in range(len(lp)):
            ratio = math.exp(lp[t] - old[t])
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            token = -min(ratio * adv, clipped * adv)
            d = ref[t] - lp[t]
            token += kl * (math.exp(d) - d - 1)
            total += token
        member_sums.append(total)
        counts.append(len(lp))
    if agg == "token-mean":
        return sum(member_sums) / sum(counts)
    return sum(s / c for s, c in zip(member_sums, counts, strict=True)) / len(counts)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_matches_hand_arithmetic(agg):
    gen = torch.Generator().manual_seed(0)
    responses = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    logps = [-torch.rand(r.numel(), generator=gen, dtype=torch.float64) * 3 for r in responses]
    olds = [lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in logps]
    refs = [lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in logps]
    group = GRPOGroup(P, responses, rewards=[0.3, 1.0, -0.2], old_logprobs=olds)
    objective = GRPOObjective(clip_low=0.1, clip_high=0.3, kl_coef=0.05, loss_agg=agg)
    advs = objective.advantages(group).tolist()
    expected = _hand_loss([x.tolist() for x in logps], [x.tolist() for x in olds], [x.tolist() for x in refs],
                          advs, 0.1, 0.3, 0.05, agg)
    assert float(objective.group_loss(group, logps, refs)) == pytest.approx(expected, rel=1e-12)


def test_without_old_logprobs_ratio_is_one_but_gradient_flows():
    group = GRPOGroup(P, R, advantages=[1.0, -1.0])
    logps = [torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True),
             torch.tensor([-0.5], dtype=torch.float64, requires_grad=True)]
    loss = GRPOObjective().group_loss(group, logps)
    # ratio = 1: loss = -(1 * A) averaged over 3 tokens; d loss / d logp_t = -A / 3.
    assert float(loss) == pytest.approx(-(1.0 + 1.0 - 1.0) / 3)
    loss.backward()
    assert logps[0].grad.tolist() == pytest.approx([-1 / 3, -1 / 3])
    assert logps[1].grad.tolist() == pytest.approx([1 / 3])


def test_kl_needs_reference_logprobs():
    group = GRPOGroup(P, R, advantages=[1.0, -1.0])
    with pytest.raises(ValueError, match="reference log-probs"):
        GRPOObjective(kl_coef=0.1).group_loss(group, [torch.zeros(2), torch.zeros(1)])
