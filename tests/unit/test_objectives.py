"""GRPOObjective against the peers' own losses on the same float64 inputs: TRL 1.16's GRPOTrainer._compute_loss and
verl's documented definitions (tests/peer_losses.py). Loss values and gradients w.r.t. the log-probs (and the
entropies) agree to relative 1e-8: the same sums in another order differ by float64 rounding (~1e-15 relative),
so 1e-8 leaves room for that and nothing else (a wrong weight or sign errs by O(1))."""

import pytest
import torch
from peer_losses import TRLLoss, trl_advantages, trl_rollout_ratio, verl_loss

from ds_longstraw import GRPOGroup, GRPOObjective
from ds_longstraw.objective import ScopedObjective

F64 = torch.float64
REL = 1e-8


def _groups(sizes=(3, 4), seed=0, masked=True, empty=False, vocab=50):
    """Groups of members of different lengths, some tokens masked out (tool output), old, sampling log-probs."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, size in enumerate(sizes):
        lengths = [int(torch.randint(2, 9, (1,), generator=gen)) for _ in range(size)]
        responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        masks = [torch.rand(n, generator=gen) > 0.3 for n in lengths] if masked else None
        if masks is not None:
            masks[0][0] = True  # every group trains some token
            if empty and g == 0:
                masks[-1][:] = False  # a member that is all tool output
        old = [-torch.rand(n, generator=gen, dtype=F64) * 3 for n in lengths]
        sampling = [o + 0.3 * torch.randn(n, generator=gen, dtype=F64) for o, n in zip(old, lengths, strict=True)]
        groups.append(GRPOGroup(torch.tensor([1, 2, 3]), responses, rewards=torch.rand(size, generator=gen),
                                old_logprobs=old, response_masks=masks, sampling_logprobs=sampling))
    return groups


def _leaves(groups, seed=1):
    """Per member: current log-probs (leaves), reference log-probs, entropies (leaves)."""
    gen = torch.Generator().manual_seed(seed)
    members = [r.numel() for g in groups for r in g.response_ids]
    logps = [(o + 0.2 * torch.randn(o.numel(), generator=gen, dtype=F64)).requires_grad_()
             for g in groups for o in g.old_logprobs]
    refs = [lp.detach() + 0.3 * torch.randn(lp.numel(), generator=gen, dtype=F64) for lp in logps]
    entropies = [torch.rand(n, generator=gen, dtype=F64).mul(4).requires_grad_() for n in members]
    return logps, refs, entropies


def _padded(rows, length, fill=0.0):
    return torch.stack([torch.cat([r, r.new_full((length - r.numel(),), fill)]) for r in rows])


def _batch(groups, logps, refs, entropies, length=None):
    """The members as one TRL micro-batch: [B, T] tensors padded to `length` (default: the longest)."""
    length = length or max(r.numel() for g in groups for r in g.response_ids)
    masks = [g.mask(i).to(F64) for g in groups for i in range(g.size)]
    return dict(logps=_padded(logps, length), mask=_padded(masks, length), old=_padded(
        [o for g in groups for o in g.old_logprobs], length), ref=_padded(refs, length),
        entropies=_padded(entropies, length),
        sampling=_padded([s for g in groups for s in g.sampling_logprobs], length))


def _ours(objective, groups, logps, refs, entropies, scope="step"):
    """Our loss over these groups: every member's share, in the objective's scope (step: all groups; group: each
    alone, weighed 1/n as the engine weighs a rank's groups)."""
    total, index = 0.0, 0
    step = objective.scope_of(groups)
    for group in groups:
        if scope == "step":
            bound = ScopedObjective(objective, step)
        else:
            bound = ScopedObjective(objective, objective.scope_of([group], weight=1.0 / len(groups)))
        advantages = objective.advantages(group)
        for member in range(group.size):
            total = total + bound.member_loss(group, member, logps[index], advantages, refs[index],
                                              entropies[index])
            index += 1
    return total


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _assert_same(ours, theirs, leaves):
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=REL, abs=1e-12)
    for mine, peer in zip(_grads(ours, leaves), _grads(theirs, leaves), strict=True):
        peer = torch.zeros_like(mine) if peer is None else peer
        mine = torch.zeros_like(peer) if mine is None else mine
        torch.testing.assert_close(mine, peer, rtol=REL, atol=1e-12)


def _trl_advantages(groups):
    return torch.cat([trl_advantages(g.rewards) for g in groups])


# TRL loss_type -> our settings (TRL's advantages: std + 1e-4)
TRL_TYPES = {
    "dapo": dict(loss_agg="token-mean"),
    "bnpo": dict(loss_agg="token-mean"),
    "grpo": dict(loss_agg="seq-mean-token-mean"),
    "dr_grpo": dict(loss_agg="seq-mean-token-sum-norm", norm_length=12),
    # LUSPO: each sequence's token sum (a sequence-level loss times its length), averaged over the sequences
    "luspo": dict(loss_agg="seq-mean-token-sum-norm", norm_length=1),
    "cispo": dict(loss_agg="token-mean", policy_loss="cispo", cispo_ratio_max=1.28),
}


@pytest.mark.parametrize("loss_type", list(TRL_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_loss_types(loss_type, beta, level):
    """Several groups of one step in one TRL micro-batch (TRL's num_items_in_batch: all their trained tokens), old
    log-probs (num_iterations 2), tool masks and an all-masked member: ours in "step" scope equals TRL's loss."""
    groups = _groups(sizes=(3, 4, 2), empty=True)
    logps, refs, entropies = _leaves(groups)
    objective = GRPOObjective(clip_low=0.2, clip_high=0.28, kl_coef=beta, ratio_level=level, advantage_eps=1e-4,
                              **TRL_TYPES[loss_type])
    trl = TRLLoss(loss_type, epsilon=0.2, epsilon_high=1.28 if loss_type == "cispo" else 0.28, beta=beta,
                  importance_sampling_level=level, max_completion_length=12)
    b = _batch(groups, logps, refs, entropies, length=12)
    advantages = _trl_advantages(groups)
    assert torch.allclose(torch.cat([objective.advantages(g) for g in groups]), advantages, rtol=1e-12)
    theirs = trl(b["logps"], b["mask"], advantages, old=b["old"], ref=b["ref"] if beta else None)
    _assert_same(_ours(objective, groups, logps, refs, entropies), theirs, logps)


def test_trl_bnpo_over_accumulation_is_group_scope():
    """TRL "bnpo" with one group per micro-batch and gradient accumulation over the groups: each micro-batch's token
    mean, averaged over the micro-batches, which is our "group" scope as the engine weighs a rank's groups."""
    groups = _groups(sizes=(3, 4))
    logps, refs, entropies = _leaves(groups)
    objective = GRPOObjective(loss_agg="token-mean", loss_scope="group", advantage_eps=1e-4)
    trl = TRLLoss("bnpo", gradient_accumulation_steps=len(groups))
    theirs, start = 0.0, 0
    for group in groups:
        rows = slice(start, start + group.size)
        b = _batch([group], logps[rows], refs[rows], entropies[rows])
        theirs = theirs + trl(b["logps"], b["mask"], trl_advantages(group.rewards), old=b["old"])
        start += group.size
    _assert_same(_ours(objective, groups, logps, refs, entropies, scope="group"), theirs, logps)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_trl_entropy_bonus(loss_type):
    """TRL's entropy bonus: the micro-batch's mean entropy over trained tokens; ours adds -coef H_t per token under
    the token mean, the same loss when the policy term is a token mean over the same tokens."""
    groups = _groups(sizes=(3, 2))
    logps, refs, entropies = _leaves(groups)
    objective = GRPOObjective(entropy_coef=0.01, advantage_eps=1e-4)
    b = _batch(groups, logps, refs, entropies)
    theirs = TRLLoss(loss_type, entropy_coef=0.01)(b["logps"], b["mask"], _trl_advantages(groups), old=b["old"],
                                                  entropies=b["entropies"])
    _assert_same(_ours(objective, groups, logps, refs, entropies), theirs, logps + entropies)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_rollout_correction(mode):
    """TRL's vLLM importance-sampling correction from the sampler's log-probs (cap 3, TRL's default), with and
    without a floor."""
    groups = _groups(sizes=(3, 3), seed=5)
    logps, refs, entropies = _leaves(groups)
    b = _batch(groups, logps, refs, entropies)
    for low in (None, 0.5):
        objective = GRPOObjective(advantage_eps=1e-4, rollout_correction=mode, rollout_correction_min=low,
                                  rollout_correction_max=3.0)
        ratio = trl_rollout_ratio(b["old"], b["sampling"], b["mask"], mode, clip_min=low, clip_max=3.0)
        assert (ratio != 1).any()
        theirs = TRLLoss("dapo", vllm_importance_sampling_correction=True)(
            b["logps"], b["mask"], _trl_advantages(groups), old=b["old"], importance_ratio=ratio)
        _assert_same(_ours(objective, groups, logps, refs, entropies), theirs, logps)


def test_trl_bias_corrected_kl():
    """TRL's use_bias_correction_kl: the k3 term times the importance ratio."""
    groups = _groups(sizes=(4,))
    logps, refs, entropies = _leaves(groups)
    objective = GRPOObjective(kl_coef=0.1, kl_ratio_weighted=True, advantage_eps=1e-4)
    b = _batch(groups, logps, refs, entropies)
    theirs = TRLLoss("dapo", beta=0.1, use_bias_correction_kl=True)(b["logps"], b["mask"], _trl_advantages(groups),
                                                                   old=b["old"], ref=b["ref"])
    _assert_same(_ours(objective, groups, logps, refs, entropies), theirs, logps)


VERL_MODES = {"token-mean": {}, "seq-mean-token-mean": {}, "seq-mean-token-sum-norm": dict(norm_length=10)}


@pytest.mark.parametrize("mode", list(VERL_MODES))
@pytest.mark.parametrize("kl", ["k1", "k2", "low_var_kl"])
def test_verl_over_two_data_parallel_ranks(mode, kl):
    """verl's actor loss with dual clip (clip_ratio_c 3), a KL penalty and an entropy term, the step's groups split
    over 2 data-parallel ranks whose gradients are averaged (verl's and DeepSpeed's reduction), each rank normalising
    over the global batch: the same gradient as ours in "step" scope over all groups. Large ratios and negative
    advantages so that the dual clip bites."""
    groups = _groups(sizes=(3, 4, 2, 3), seed=3, empty=True)
    logps, refs, entropies = _leaves(groups)
    with torch.no_grad():
        for lp in logps:
            lp.add_(torch.linspace(-1.5, 1.5, lp.numel(), dtype=F64))
    objective = GRPOObjective(clip_ratio_c=3.0, kl_coef=0.05, kl_estimator=kl, entropy_coef=0.02, loss_agg=mode,
                              **VERL_MODES[mode])
    b = _batch(groups, logps, refs, entropies, length=10)
    advantages = torch.cat([objective.advantages(g) for g in groups])
    halves = [slice(0, 7), slice(7, 12)]  # groups 0-1 on rank 0, 2-3 on rank 1
    agg = dict(global_tokens=b["mask"].sum(), global_sequences=b["mask"].shape[0], dp_size=2,
               loss_scale_factor=10)
    rank_losses = [verl_loss(b["logps"][h], b["mask"][h], advantages[h], b["old"][h], mode=mode, ref=b["ref"][h],
                             kl_coef=0.05, kl_penalty=kl, entropies=b["entropies"][h], entropy_coeff=0.02, **agg)
                   for h in halves]
    theirs = sum(rank_losses) / 2  # the averaged gradient is that of the mean of the ranks' losses
    ours = _ours(objective, groups, logps, refs, entropies)
    clipped = [(lp.detach() - o).exp().gt(3).any() for lp, o in zip(logps, (o for g in groups for o in g.old_logprobs),
                                                                      strict=True)]
    assert any(clipped)
    _assert_same(ours, theirs, logps + entropies)


def test_verl_gspo_equals_sequence_level_ratio():
    """verl's GSPO (per-token straight-through of the sequence ratio, seq-mean-token-mean) and TRL's sequence-level
    importance sampling give one gradient: ours with ratio_level "sequence"."""
    groups = _groups(sizes=(3, 4), seed=7)
    logps, refs, entropies = _leaves(groups)
    objective = GRPOObjective(ratio_level="sequence", loss_agg="seq-mean-token-mean", clip_high=0.28)
    b = _batch(groups, logps, refs, entropies)
    advantages = torch.cat([objective.advantages(g) for g in groups])
    theirs = verl_loss(b["logps"], b["mask"], advantages, b["old"], clip_high=0.28, mode="seq-mean-token-mean",
                       loss_mode="gspo")
    _assert_same(_ours(objective, groups, logps, refs, entropies), theirs, logps)


def test_group_of_one_and_epsilon_conventions():
    """verl gives a lone member A = r / (1 + 1e-6) (mean 0, std 1); "zero" (the default) gives 0; the epsilon is
    the one given."""
    one = GRPOGroup(torch.tensor([1, 2]), [torch.tensor([3])], rewards=[0.7])
    assert float(GRPOObjective().advantages(one)[0]) == 0.0
    assert float(GRPOObjective(group_of_one="reward").advantages(one)[0]) == pytest.approx(0.7 / (1 + 1e-6), rel=1e-14)
    assert float(GRPOObjective(group_of_one="reward", scale_rewards=False).advantages(one)[0]) == 0.7
    two = GRPOGroup(torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([4])], rewards=[0.0, 1.0])
    std = torch.tensor([0.0, 1.0], dtype=F64).std()
    assert float(GRPOObjective(advantage_eps=1e-4).advantages(two)[1]) == pytest.approx(0.5 / (float(std) + 1e-4),
                                                                                       rel=1e-14)


def test_empty_members_count_or_skip():
    """seq-mean: an all-masked member counts as a 0 in the mean (TRL, verl: "count") or is left out ("skip")."""
    groups = _groups(sizes=(4,), empty=True)
    logps, refs, entropies = _leaves(groups)
    counted = GRPOObjective(loss_agg="seq-mean-token-mean").group_loss(groups[0], logps)
    skipped = GRPOObjective(loss_agg="seq-mean-token-mean", empty_members="skip").group_loss(groups[0], logps)
    nonempty = sum(1 for i in range(4) if groups[0].trained_tokens(i) > 0)
    assert nonempty < 4
    assert float(skipped) == pytest.approx(float(counted) * 4 / nonempty, rel=1e-12)


@pytest.mark.parametrize("settings,key", [
    (dict(loss_agg="token-sum"), "loss_agg"), (dict(loss_scope="world"), "loss_scope"),
    (dict(policy_loss="ppo"), "policy_loss"), (dict(ratio_level="seq"), "ratio_level"),
    (dict(kl_estimator="k4"), "kl_estimator"), (dict(empty_members="drop"), "empty_members"),
    (dict(group_of_one="one"), "group_of_one"), (dict(rollout_correction="token"), "rollout_correction"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c"), (dict(clip_ratio_c=float("nan")), "clip_ratio_c"),
    (dict(entropy_coef=-1.0), "entropy_coef"), (dict(advantage_eps=True), "advantage_eps"),
    (dict(loss_agg="seq-mean-token-sum-norm"), "norm_length"), (dict(norm_length=8), "norm_length"),
    (dict(cispo_ratio_max=0.0), "cispo_ratio_max"), (dict(policy_loss="cispo", clip_ratio_c=3.0), "clip_ratio_c"),
    (dict(rollout_correction="token_mask", rollout_correction_max=None), "rollout_correction"),
    (dict(rollout_correction_min=4.0, rollout_correction_max=3.0), "rollout_correction_min"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(two_sided_clip=-1.0), "two_sided_clip"), (dict(policy_loss="sapo", two_sided_clip=2.0), "two_sided_clip"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"), (dict(vespo_lambda_pos=-1.0), "vespo_lambda_pos"),
    (dict(off_policy_mask=float("nan")), "off_policy_mask"),
])
def test_bad_values_are_refused_naming_the_key(settings, key):
    with pytest.raises(ValueError, match=key):
        GRPOObjective(**settings)


def test_rollout_correction_needs_sampling_logprobs():
    group = GRPOGroup(torch.tensor([1, 2]), [torch.tensor([3, 4])], rewards=[1.0])
    with pytest.raises(ValueError, match="sampling_logprobs"):
        GRPOObjective(rollout_correction="token_mask").check_group(group)
