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
      - "token-mean": sum of all trained token losses of the group / the group's trained tokens;
        "seq-mean-token-mean": mean over members of each member's token mean over its trained tokens.
    Trained tokens are those the group's response_masks mark True (every token when it has none); masked-out
    tokens add no loss term, and their old and reference log-probs are never read. Under "seq-mean-token-mean" a
    member with no trained token has no token mean and is left out of the mean over members (it is not counted
    as a 0): counting it would shrink every other member's weight by how many members happen to be all tool
    output, a scale that says nothing about the policy. A group with no trained token at all has loss 0 and zero
    gradients (each share is 0 * its log-probs, still connected to the graph, so every backward runs alike).
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
        """Factor that turns member `member`'s summed trained-token losses into its share of the group loss
        (0 for a member with no trained token: no 0/0)."""
        tokens = group.trained_tokens(member)
        if tokens == 0:
            return 0.0
        if self.loss_agg == "token-mean":
            return 1.0 / group.trained_tokens()
        members = sum(1 for i in range(group.size) if group.trained_tokens(i) > 0)
        return 1.0 / (members * tokens)

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
        """Member `member`'s share of the group loss from its log-probs of every response token (logp; ref_logp
        likewise). Masked-out tokens are dropped before the token losses, so nothing at those positions (a NaN
        old log-prob, say) reaches the value or the gradient; their logp entries get a zero gradient."""
        old = None if group.old_logprobs is None else group.old_logprobs[member]
        if group.response_masks is not None:
            mask = group.response_masks[member]
            logp = logp[mask.to(logp.device)]
            old = None if old is None else old[mask.to(old.device)]
            ref_logp = None if ref_logp is None else ref_logp[mask.to(ref_logp.device)]
        tokens = self.token_losses(logp, float(advantages[member]), old, ref_logp)
        return tokens.sum() * self.member_weight(group, member)

    def group_loss(self, group, logps, ref_logps=None):
        """The whole group's loss from all members' log-probs (used by baselines and tests)."""
        advantages = self.advantages(group)
        total = 0.0
        for i, logp in enumerate(logps):
            total = total + self.member_loss(group, i, logp, advantages, None if ref_logps is None else ref_logps[i])
        return total


class ScaledObjective:
    """An objective whose member loss shares are multiplied by `weight`; everything else is delegated. (The engine
    weighs several groups on one rank; a spread CP replay under the engine counts its members cp_size times, as the
    replicated replay does.)"""

    def __init__(self, objective, weight):
        self.objective, self.weight = objective, weight

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def member_loss(self, *args, **kwargs):
        return self.objective.member_loss(*args, **kwargs) * self.weight
