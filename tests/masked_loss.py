"""The masked GRPO loss written out plainly, for the tests of response masks (tests/equivalence/test_agent_masks.py,
test_cp_masks.py, test_launcher_masks.py): independent of ds_longstraw.objective, which selects the trained
tokens; here the mask multiplies the token losses."""

import torch

from ds_longstraw import GRPOGroup


def masks_from_spans(members):
    """members: [(response length, [(lo, hi), ...] context-only spans)] -> boolean masks (False on the spans)."""
    masks = []
    for length, spans in members:
        mask = torch.ones(length, dtype=torch.bool)
        for lo, hi in spans:
            mask[lo:hi] = False
        masks.append(mask)
    return masks


def masked_group(prompt_len, members, seed=0, **extra):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 97, (length,), generator=gen) for length, _ in members]
    rewards = torch.rand(len(responses), generator=gen).tolist()
    return GRPOGroup(prompt, responses, rewards=rewards, response_masks=masks_from_spans(members), **extra)


def masked_grpo_loss(group, logps, ref_logps, clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg="token-mean",
                     scale_rewards=True, empty_members="count"):
    """The masked GRPO loss, written out plainly: token losses multiplied by the mask, token-mean over the group's
    trained tokens or the mean over members of their trained-token means (a member with no trained token counts as
    a 0 in that mean, or, with empty_members "skip", is left out of it)."""
    if group.advantages is not None:
        advantages = group.advantages
    else:
        rewards = group.rewards
        advantages = rewards - rewards.mean()
        if scale_rewards:
            advantages = advantages / (rewards.std(unbiased=True) + 1e-6)
    sums, counts = [], []
    for i, logp in enumerate(logps):
        keep = group.response_masks[i]
        old = logp.detach()
        if group.old_logprobs is not None:  # masked-out old log-probs may be NaN: never let them into exp()
            old = torch.where(keep, group.old_logprobs[i], logp.detach())
        ratio = torch.exp(logp - old)
        token = -torch.minimum(ratio * advantages[i], torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages[i])
        if kl_coef:
            delta = ref_logps[i] - logp
            token = token + kl_coef * (torch.exp(delta) - delta - 1)
        sums.append((token * keep).sum())
        counts.append(int(keep.sum()))
    if loss_agg == "token-mean":
        return sum(sums) / sum(counts) if sum(counts) else sum(sums) * 0.0
    trained = [(s, n) for s, n in zip(sums, counts, strict=True) if n]
    members = len(sums) if empty_members == "count" else len(trained)
    return sum(s / n for s, n in trained) / members if trained else sum(sums) * 0.0
