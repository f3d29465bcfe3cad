"""The GRPO objective, written so that a step's loss is a sum of per-member shares.

That decomposition is what lets the transaction replay and back-propagate one response at a time: the gradient of
the step's loss is the sum of the gradients of the shares. Each share is (a member's summed token losses) x (a
weight that only counts: tokens and members of the loss's scope), so every option below keeps it.

docs/objectives.md maps each setting onto verl's and TRL's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_longstraw.group import GRPOGroup

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_SCOPES = ("group", "rank", "step")
POLICY_LOSSES = ("clip", "cispo", "sapo", "vespo")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
EMPTY_MEMBERS = ("count", "skip")
ENTROPY_AGGS = ("loss", "scope")
GROUP_OF_ONE = ("zero", "reward")

# VESPO (TRL's get_gamma_weights): the sequence's log-ratio is clamped to [log 1e-8, 20], each token's to +-20 first
VESPO_LOG_MIN, VESPO_LOG_MAX = math.log(1e-8), 20.0

# verl's low_var_kl (its kl_penalty "low_var_kl", which its "k3" names too) clamps ref - logp to +-20 before the
# estimator and the estimate to +-10.
LOW_VAR_KL_DELTA, LOW_VAR_KL_BOUND = 20.0, 10.0


@dataclass(frozen=True)
class LossScope:
    """What a step's loss is normalised over: the trained tokens and the members counted by the members' mean,
    summed over the groups (and ranks) of the scope, and a weight on every share (the engine: the number of
    data-parallel replicas, whose gradients DeepSpeed averages where the loss wants their sum).

    Per member, for a trainer that normalises its own way (integrations/trl/scopes.py): entropy_weight, the factor
    on the member's summed entropies of entropy_agg "scope" (TRL: 1 / (accumulation x the micro-batch's tokens));
    policy_tokens, a bool mask over the member's response tokens outside which the policy term is 0 (TRL's
    top_entropy_quantile; the KL term and the normalisation's counts keep every trained token)."""

    tokens: int
    members: int
    weight: float = 1.0
    entropy_weight: float = 0.0
    policy_tokens: torch.Tensor | None = field(default=None, compare=False)

    def __add__(self, other: LossScope) -> LossScope:
        return LossScope(self.tokens + other.tokens, self.members + other.members, self.weight, self.entropy_weight)


@dataclass
class GRPOObjective:
    """The GRPO policy loss, its penalties and its normalisation; every formula below is per trained token t of
    member i (tokens the group's response_masks mark True; masked-out tokens add nothing and their old, reference
    and sampling log-probs are never read).

    Log-probs: logp_t = log softmax(z / temperature)[token] of the logits z at the token's position; the
      transaction scores the policy, the reference and (num_iterations > 1 in a trainer) the old log-probs alike,
      so temperature is the one the responses were sampled at (TRL's `temperature`). Not a top-p / top-k
      truncation: the log-probs are of the whole tempered softmax, as TRL's and vLLM's.
    Advantages (unless the group gives them): A_i = (r_i - mean r) / (std_unbiased r + advantage_eps), without the
      division when scale_rewards is False. A group of one has no std: group_of_one "zero" gives A = 0, "reward"
      gives r / (1 + advantage_eps) (verl: mean 0, std 1), or r unscaled.
    Ratio: log w_t = logp_t - old_t (old: the group's old_logprobs, else the current policy, detached: ratio 1,
      gradient through logp). ratio_level "sequence" (GSPO) replaces every token's log w by the member's mean
      over its trained tokens (the gradient flows through all of them).
    Policy term:
      "clip"  pg_t = -min(w_t A_i, clamp(w_t, 1 - clip_low, 1 + clip_high) A_i); with clip_ratio_c (dual clip,
              A_i < 0 only) pg_t = min(pg_t, -A_i clip_ratio_c)
      "cispo" pg_t = -sg(min(w_t, cispo_ratio_max)) A_i logp_t (sg: no gradient through the weight)
      "sapo"  pg_t = -sigmoid(tau (w_t - 1)) 4 / tau A_i, tau = sapo_temperature_pos where A_i > 0, else _neg (a soft
              gate in place of the clip; TRL's "sapo")
      "vespo" pg_t = -sg(phi_i) A_i logp_t, phi_i = exp(lambda + k log W_i - lambda W_i) (1 at W = 1; 0 where it
              overflows), log W_i = clamp(sum_t clamp(logp_t - old_t, +-20) + log rho_i, log 1e-8, 20) over the
              member's trained tokens (always token-level log-ratios), (k, lambda) = (vespo_k_pos, vespo_lambda_pos)
              where A_i >= 0, else the _neg pair; rho_i, with rollout_correction, the sum over its tokens of
              clamp(log rho_t, log 1e-8, 20) (one rho for the "sequence_" modes), folded into W instead of the
              product below (TRL's "vespo")
      two_sided_clip (clip only, TRL's delta): w_t in the unclipped term is capped at it first:
              pg_t = -min(min(w_t, two_sided_clip) A_i, clamp(w_t, ...) A_i)
    Off-policy mask (off_policy_mask, DeepSeek-V3.2's sequence mask, TRL's off_policy_mask_threshold): a member
      with A_i < 0 whose mean over trained tokens of (s_t - sg(logp_t)) exceeds it has pg_t = 0 (s: the sampling
      log-probs where the group gives them, else old; NaN counts as 0).
    Rollout correction (rollout_correction, from the group's sampling_logprobs s: what the rollout engine
      sampled with): rho_t = exp(old_t - s_t) per token, or rho = exp(sum_t (old_t - s_t)) per member for the
      "sequence_" modes; "_truncate" caps rho at rollout_correction_max (and floors it at rollout_correction_min),
      "_mask" sets rho = 0 outside [rollout_correction_min, rollout_correction_max]; pg_t *= rho (no gradient;
      "vespo" takes rho into its weight instead).
    KL penalty (kl_coef > 0), d_t = ref_t - logp_t: "k1" -d_t, "k2" d_t^2 / 2, "k3" exp(d_t) - d_t - 1,
      "low_var_kl" verl's k3: of d clamped to [-20, 20], then clamped to [-10, 10]; kl_ratio_weighted multiplies
      it by w_t (TRL's use_bias_correction_kl); added as kl_coef kl_t.
    Entropy bonus (entropy_coef > 0): - entropy_coef H_t, H_t the policy's entropy at the token's position,
      computed over the vocabulary in chunks (no [tokens, vocab] tensor in forward or backward). entropy_agg
      "loss": the bonus shares the loss's normalisation (in l_t below); "scope": member i's share gains
      - entropy_coef e_i sum_t H_t over its trained tokens (those of its LossScope's policy_tokens where given),
      e_i its LossScope's entropy_weight (TRL's bonus: a per-micro-batch token mean whatever the loss type).
    report_entropy: the transaction also returns every member's H_t (GroupResult.entropies, detached) for a metric
      (TRL logs the mean entropy); it changes no loss.
    Token loss l_t = pg_t + kl_coef kl_t - entropy_coef H_t; the loss is sum_i sum_t l_t c_i with
      "token-mean"               c_i = 1 / N
      "seq-mean-token-mean"      c_i = 1 / (M n_i)
      "seq-mean-token-sum-norm"  c_i = 1 / (M norm_length)   (Dr. GRPO: a constant in place of n_i)
    where n_i is member i's trained tokens, and N, M the trained tokens and counted members of the loss_scope:
      "group"  each group alone (the engine then weighs its groups equally),
      "rank"   every group this rank trains in the step,
      "step"   every group of the step on every data-parallel rank (one all-reduce of two counts before replay);
    the default: verl's token-mean and TRL's default loss ("dapo") divide by the step's trained tokens over all
    groups and ranks, and TRL's "grpo" and "dr_grpo" by its sequences, which is what "step" does.
    empty_members "count" counts a member with no trained token in M (it adds 0, as in TRL and verl); "skip"
    leaves it out of M. A scope with no trained token has loss 0 and zero gradients.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    policy_loss: str = "clip"
    cispo_ratio_max: float = 5.0
    ratio_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_weighted: bool = False
    entropy_coef: float = 0.0
    entropy_agg: str = "loss"
    loss_agg: str = "token-mean"
    norm_length: int | None = None
    loss_scope: str = "step"
    empty_members: str = "count"
    scale_rewards: bool = True
    advantage_eps: float = 1e-6
    group_of_one: str = "zero"
    rollout_correction: str | None = None
    rollout_correction_min: float | None = None
    rollout_correction_max: float | None = 3.0
    temperature: float = 1.0
    report_entropy: bool = False
    two_sided_clip: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask: float | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("loss_agg", LOSS_AGGS), ("loss_scope", LOSS_SCOPES), ("policy_loss", POLICY_LOSSES),
                              ("ratio_level", RATIO_LEVELS), ("kl_estimator", KL_ESTIMATORS),
                              ("empty_members", EMPTY_MEMBERS), ("group_of_one", GROUP_OF_ONE),
                              ("entropy_agg", ENTROPY_AGGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.rollout_correction is not None and self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be None or one of {ROLLOUT_CORRECTIONS}, "
                             f"got {self.rollout_correction!r}")
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "advantage_eps"):
            _check_number(name, getattr(self, name))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _check_number(name, getattr(self, name))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _check_number(name, getattr(self, name))
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0 (the soft gate divides by it), got 0")
        if self.off_policy_mask is not None and (isinstance(self.off_policy_mask, bool) or not isinstance(
                self.off_policy_mask, (int, float)) or not math.isfinite(self.off_policy_mask)):
            raise ValueError(f"off_policy_mask must be None or a finite number, got {self.off_policy_mask!r}")
        if self.two_sided_clip is not None:
            _check_number("two_sided_clip", self.two_sided_clip)
            if self.policy_loss != "clip":
                raise ValueError(f"two_sided_clip caps the clip loss's ratio; policy_loss is {self.policy_loss!r}")
        for name in ("clip_ratio_c", "rollout_correction_min", "rollout_correction_max"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name))
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (it bounds the loss above the clipped ratio), "
                             f"got {self.clip_ratio_c!r}")
        _check_number("cispo_ratio_max", self.cispo_ratio_max)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                0 < self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number > 0 (the logits are divided by it), got "
                             f"{self.temperature!r}")
        if self.cispo_ratio_max <= 0:
            raise ValueError(f"cispo_ratio_max must be > 0, got {self.cispo_ratio_max!r}")
        if self.clip_ratio_c is not None and self.policy_loss != "clip":
            raise ValueError("clip_ratio_c applies to policy_loss 'clip' only")
        if self.loss_agg == "seq-mean-token-sum-norm":
            if not isinstance(self.norm_length, int) or isinstance(self.norm_length, bool) or self.norm_length < 1:
                raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs norm_length, a positive integer (the "
                                 f"constant each member's token sum is divided by), got {self.norm_length!r}")
        elif self.norm_length is not None:
            raise ValueError(f"norm_length is the constant of loss_agg 'seq-mean-token-sum-norm'; "
                             f"loss_agg is {self.loss_agg!r}")
        low, high = self.rollout_correction_min, self.rollout_correction_max
        if self.rollout_correction is not None and low is None and high is None:
            raise ValueError("rollout_correction needs rollout_correction_max or rollout_correction_min")
        if low is not None and high is not None and low > high:
            raise ValueError(f"rollout_correction_min {low!r} > rollout_correction_max {high!r}")

    # -- what the transaction must provide ------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def computes_entropy(self) -> bool:
        """Whether replay computes the policy's entropies: for the loss, or for report_entropy's metric."""
        return self.needs_entropy or self.report_entropy

    def check_group(self, group: GRPOGroup) -> None:
        """Fail before any work when the group lacks what the options read."""
        if self.rollout_correction is not None and group.sampling_logprobs is None:
            raise ValueError(f"rollout_correction {self.rollout_correction!r} needs the group's sampling_logprobs")

    # -- advantages ---------------------------------------------------------------------------------------------
    def advantages(self, group: GRPOGroup) -> torch.Tensor:
        if group.advantages is not None:
            return group.advantages.clone()
        rewards = group.rewards
        if rewards.numel() < 2:
            if self.group_of_one == "zero":
                return torch.zeros_like(rewards)
            return rewards / (1.0 + self.advantage_eps) if self.scale_rewards else rewards.clone()
        centered = rewards - rewards.mean()
        if not self.scale_rewards:
            return centered
        return centered / (rewards.std(unbiased=True) + self.advantage_eps)

    # -- normalisation ----------------------------------------------------------------------------------------
    def counted_members(self, group: GRPOGroup) -> int:
        if self.empty_members == "count":
            return group.size
        return sum(1 for i in range(group.size) if group.trained_tokens(i) > 0)

    def scope_of(self, groups: Iterable[GRPOGroup], weight: float = 1.0) -> LossScope:
        """The LossScope of these groups (summed counts; `weight` on every share)."""
        groups = list(groups)
        return LossScope(tokens=sum(g.trained_tokens() for g in groups),
                         members=sum(self.counted_members(g) for g in groups), weight=weight)

    def member_weight(self, group: GRPOGroup, member: int, scope: LossScope | None = None) -> float:
        """c_i: what turns member `member`'s summed token losses into its share of the loss (0 for a member with no
        trained token: no 0/0). scope None: the group alone."""
        scope = self.scope_of([group]) if scope is None else scope
        tokens = group.trained_tokens(member)
        if tokens == 0:
            return 0.0
        if self.loss_agg == "token-mean":
            return scope.weight / scope.tokens
        if self.loss_agg == "seq-mean-token-mean":
            return scope.weight / (scope.members * tokens)
        return scope.weight / (scope.members * self.norm_length)

    # -- token losses -----------------------------------------------------------------------------------------
    def token_losses(self, logp: torch.Tensor, advantage: float, old_logp: torch.Tensor | None = None,
                     ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                     sampling_logp: torch.Tensor | None = None,
                     policy_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """l_t of one member's trained tokens (logp and entropy differentiable; old, ref and sampling constants);
        policy_tokens: where the policy term counts (LossScope's), default everywhere."""
        old = logp.detach() if old_logp is None else old_logp.to(logp)
        log_w = logp - old
        if self.ratio_level == "sequence":
            log_w = (log_w.mean() if log_w.numel() else log_w.sum()).expand_as(logp)
        ratio = torch.exp(log_w)
        rho = None
        if self.rollout_correction is not None:
            if sampling_logp is None:
                raise ValueError(f"rollout_correction {self.rollout_correction!r} needs sampling log-probs")
            rho = self._rollout_weight(old.detach(), sampling_logp.to(logp))
        if self.policy_loss == "cispo":
            loss = -torch.clamp(ratio, max=self.cispo_ratio_max).detach() * advantage * logp
        elif self.policy_loss == "sapo":
            tau = self.sapo_temperature_pos if advantage > 0 else self.sapo_temperature_neg
            loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantage
        elif self.policy_loss == "vespo":
            loss = -self._vespo_weight(logp.detach() - old, rho, advantage) * advantage * logp
        else:
            clipped = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
            unclipped = ratio if self.two_sided_clip is None else torch.clamp(ratio, max=self.two_sided_clip)
            loss = -torch.minimum(unclipped * advantage, clipped * advantage)
            if self.clip_ratio_c is not None and advantage < 0:
                loss = torch.clamp(loss, max=-advantage * self.clip_ratio_c)
        if self.off_policy_mask is not None and advantage < 0:
            source = old if sampling_logp is None else sampling_logp.to(logp)
            drift = torch.nan_to_num(source - logp.detach(), nan=0.0)
            if drift.numel() and float(drift.mean()) > self.off_policy_mask:
                loss = loss * 0.0  # dropped: off-policy and negative (TRL keeps A >= 0 or drift <= threshold)
        if policy_tokens is not None:
            loss = loss * policy_tokens.to(loss)  # TRL multiplies its entropy mask in here (before rho and KL)
        if rho is not None and self.policy_loss != "vespo":
            loss = loss * rho
        if self.kl_coef > 0:
            if ref_logp is None:
                raise ValueError("kl_coef > 0 needs reference log-probs")
            kl = self._kl(ref_logp.to(logp) - logp)
            loss = loss + self.kl_coef * (kl * ratio if self.kl_ratio_weighted else kl)
        if self.entropy_coef > 0 and self.entropy_agg == "loss":
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs the policy's entropies")
            loss = loss - self.entropy_coef * entropy.to(logp)
        return loss

    def _kl(self, delta: torch.Tensor) -> torch.Tensor:
        if self.kl_estimator == "k1":
            return -delta
        if self.kl_estimator == "k2":
            return 0.5 * delta * delta
        if self.kl_estimator == "low_var_kl":
            delta = torch.clamp(delta, -LOW_VAR_KL_DELTA, LOW_VAR_KL_DELTA)
            return torch.clamp(torch.exp(delta) - delta - 1.0, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
        return torch.exp(delta) - delta - 1.0

    def _vespo_weight(self, log_ratio: torch.Tensor, rho: torch.Tensor | None, advantage: float) -> torch.Tensor:
        """phi_i of "vespo" (class docstring), a constant."""
        log_w = torch.clamp(log_ratio, -20.0, 20.0).sum()
        if rho is not None:
            log_rho = torch.clamp(torch.log(rho), VESPO_LOG_MIN, VESPO_LOG_MAX)
            log_w = log_w + (log_rho[:1].sum() if self.rollout_correction.startswith("sequence") else log_rho.sum())
        log_w = torch.clamp(log_w, VESPO_LOG_MIN, VESPO_LOG_MAX)
        k, lam = ((self.vespo_k_pos, self.vespo_lambda_pos) if advantage >= 0
                  else (self.vespo_k_neg, self.vespo_lambda_neg))
        lam = max(lam, 1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).detach()

    def _rollout_weight(self, old: torch.Tensor, sampling: torch.Tensor) -> torch.Tensor:
        """rho: per token, or one per member broadcast over its tokens; a constant."""
        diff = old - sampling
        if self.rollout_correction.startswith("sequence"):
            diff = diff.sum().expand_as(old)
        rho = torch.exp(diff)
        low = -math.inf if self.rollout_correction_min is None else self.rollout_correction_min
        high = math.inf if self.rollout_correction_max is None else self.rollout_correction_max
        if self.rollout_correction.endswith("truncate"):
            return torch.clamp(rho, min=low, max=high)
        return torch.where((rho < low) | (rho > high), torch.zeros_like(rho), rho)

    # -- a member's share, a group's loss -------------------------------------------------------------------------
    def member_loss(self, group: GRPOGroup, member: int, logp: torch.Tensor, advantages: torch.Tensor,
                    ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                    scope: LossScope | None = None) -> torch.Tensor:
        """Member `member`'s share of the loss from its log-probs of every response token (logp; ref_logp and
        entropy likewise). Masked-out tokens are dropped before the token losses, so nothing at those positions (a
        NaN old log-prob, say) reaches the value or the gradient; their logp entries get a zero gradient."""
        old = None if group.old_logprobs is None else group.old_logprobs[member]
        sampling = None if group.sampling_logprobs is None else group.sampling_logprobs[member]
        policy_tokens = None if scope is None else scope.policy_tokens
        if group.response_masks is not None:
            mask = group.response_masks[member]
            logp = logp[mask.to(logp.device)]
            old, ref_logp, entropy, sampling, policy_tokens = (
                None if x is None else x[mask.to(x.device)] for x in (old, ref_logp, entropy, sampling, policy_tokens))
        tokens = self.token_losses(logp, float(advantages[member]), old, ref_logp, entropy, sampling, policy_tokens)
        share = tokens.sum() * self.member_weight(group, member, scope)
        if self.entropy_agg == "scope" and self.entropy_coef > 0 and scope is not None and scope.entropy_weight:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs the policy's entropies")
            entropy = entropy.to(logp)
            if policy_tokens is not None:
                entropy = entropy * policy_tokens.to(entropy)
            share = share - self.entropy_coef * scope.entropy_weight * entropy.sum()
        return share

    def group_loss(self, group: GRPOGroup, logps: Sequence[torch.Tensor],
                   ref_logps: Sequence[torch.Tensor] | None = None,
                   entropies: Sequence[torch.Tensor] | None = None, scope: LossScope | None = None) -> torch.Tensor:
        """The group's loss (its shares in `scope`, default the group alone) from all members' log-probs (used by
        baselines and tests)."""
        advantages = self.advantages(group)
        total = 0.0
        for i, logp in enumerate(logps):
            total = total + self.member_loss(group, i, logp, advantages, None if ref_logps is None else ref_logps[i],
                                             None if entropies is None else entropies[i], scope)
        return total


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class ScaledObjective:
    """An objective whose member loss shares are multiplied by `weight`; everything else is delegated. (A spread
    CP replay counts its members cp_size times, as the replicated replay does.)"""

    def __init__(self, objective: GRPOObjective | ScopedObjective, weight: float) -> None:
        self.objective, self.weight = objective, weight

    def __getattr__(self, name: str) -> Any:
        return getattr(self.objective, name)

    def member_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.objective.member_loss(*args, **kwargs) * self.weight


class ScopedObjective:
    """An objective whose shares are normalised over `scope` (the transaction binds it once per group): one
    LossScope for every member, or one per member (a trainer that splits its batch into micro-batches normalises
    each member over the micro-batch it was drawn into: integrations/trl/scopes.py)."""

    def __init__(self, objective: GRPOObjective, scope: LossScope | Sequence[LossScope]) -> None:
        self.objective, self.scope = objective, scope

    def __getattr__(self, name: str) -> Any:
        return getattr(self.objective, name)

    def scope_of_member(self, member: int) -> LossScope:
        return self.scope if isinstance(self.scope, LossScope) else self.scope[member]

    def member_loss(self, group: GRPOGroup, member: int, logp: torch.Tensor, advantages: torch.Tensor,
                    ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> torch.Tensor:
        return self.objective.member_loss(group, member, logp, advantages, ref_logp, entropy,
                                          self.scope_of_member(member))


def check_member_scopes(scopes: Sequence[LossScope], group: GRPOGroup) -> None:
    """A per-member scope list must give every member of the group its LossScope."""
    if len(scopes) != group.size or not all(isinstance(scope, LossScope) for scope in scopes):
        raise ValueError(f"loss_scope: one LossScope per member is needed ({group.size} members), got "
                         f"{len(scopes)} entries")
