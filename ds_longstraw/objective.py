"""The GRPO objective, written so that one group's loss is a sum of per-member shares.

That decomposition is what lets the transaction replay and back-propagate one response at a time: the
gradient of the group loss is the sum of the gradients of the shares.
"""

from dataclasses import dataclass

import torch

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


@dataclass
class GRPOObjective:
    """Clipped-ratio GRPO policy loss with an optional k3 KL penalty to a reference policy.

    What it is:
      - advantages A_i = (r_i - mean(r)) / (std_unbiased(r) + 1e-6) over the group (no division when
        scale_rewards is False; G = 1 gives A = 0 when scaled, as std is undefined); given advantages are used as is;
      - ratio_t = exp(logp_t - old_t); pg_t = -min(ratio_t * A_i, clamp(ratio_t, 1 - clip_low, 1 + clip_high) * A_i);
      - kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (the k3 estimator), added as kl_coef * kl_t;
      - "token-mean": sum of all token losses of the group / total response tokens of the group;
        "seq-mean-token-mean": mean over members of each member's token mean.
    What it is not: no entropy bonus, no dual-clip, no length penalty; when old log-probs are not given the old
    policy is the current one (ratio 1 in value, gradient flows through logp only).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"
    scale_rewards: bool = True

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        for name in ("clip_low", "clip_high", "kl_coef"):
            value = getattr(self, name)
            if not (value >= 0 and value == value and value != float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def advantages(self, group) -> torch.Tensor:
        if group.advantages is not None:
            return group.advantages.clone()
        rewards = group.rewards
        centered = rewards - rewards.mean()
        if not self.scale_rewards:
            return centered
        if rewards.numel() < 2:
            return torch.zeros_like(rewards)
        return centered / (rewards.std(unbiased=True) + 1e-6)

    def member_weight(self, group, member: int) -> float:
        """Factor that turns member `member`'s summed token losses into its share of the group loss."""
        if self.loss_agg == "token-mean":
            return 1.0 / group.response_tokens
        return 1.0 / (group.size * group.response_ids[member].numel())

    def token_losses(self, logp, advantage, old_logp=None, ref_logp=None):
        """Per-token loss of one member (logp differentiable; old/ref are constants)."""
        old = logp.detach() if old_logp is None else old_logp.to(logp)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        loss = -torch.minimum(ratio * advantage, clipped * advantage)
        if self.kl_coef > 0:
            if ref_logp is None:
                raise ValueError("kl_coef > 0 needs reference log-probs")
            delta = ref_logp.to(logp) - logp
            loss = loss + self.kl_coef * (torch.exp(delta) - delta - 1.0)
        return loss

    def member_loss(self, group, member, logp, advantages, ref_logp=None):
        old = None if group.old_logprobs is None else group.old_logprobs[member]
        tokens = self.token_losses(logp, float(advantages[member]), old, ref_logp)
        return tokens.sum() * self.member_weight(group, member)

    def group_loss(self, group, logps, ref_logps=None):
        """The whole group's loss from all members' log-probs (used by baselines and tests)."""
        advantages = self.advantages(group)
        total = 0.0
        for i, logp in enumerate(logps):
            total = total + self.member_loss(group, i, logp, advantages, None if ref_logps is None else ref_logps[i])
        return total
