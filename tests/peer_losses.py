"""The peers' GRPO losses on padded [B, T] batches: TRL 1.16's own loss code, and verl's documented definitions.

TRL: `GRPOTrainer._compute_loss` itself runs, on a stand-in for the trainer that holds the settings it reads and
returns the given log-probs and entropies from its model call; one process (TRL's gathers and reductions are the
identity there). The rollout-correction ratio is computed in TRL's `_generate_and_score_completions`, inline in a
method that generates; `trl_rollout_ratio` writes out the same steps.

verl (0.9, verl/trainer/ppo/core_algos.py): compute_policy_loss_vanilla (dual clip), agg_loss (token-mean over the
global batch's tokens, seq-mean-token-mean, seq-mean-token-sum-norm), kl_penalty and the entropy term, as its
documentation defines them; verl is not installed (it pulls a cluster runtime).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import GRPOTrainer


class _OneProcess:
    """TRL's accelerator calls in one process: gathers and reductions return their input."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


class TRLLoss:
    """TRL 1.16's GRPO loss with these settings (GRPOConfig names)."""

    def __init__(self, loss_type="dapo", epsilon=0.2, epsilon_high=None, beta=0.0, importance_sampling_level="token",
                 use_bias_correction_kl=False, entropy_coef=0.0, max_completion_length=None,
                 gradient_accumulation_steps=1, vllm_importance_sampling_correction=False, delta=None,
                 off_policy_mask_threshold=None, **loss_args):
        """loss_args: GRPOConfig's sapo_temperature_* and vespo_* (TRL's defaults where not given)."""
        self.loss_type, self.beta, self.importance_sampling_level = loss_type, beta, importance_sampling_level
        self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        self.entropy_coef, self.use_adaptive_entropy = entropy_coef, False
        self._entropy_bonus_enabled = entropy_coef != 0
        self.max_completion_length = max_completion_length
        self.current_gradient_accumulation_steps = gradient_accumulation_steps
        self.use_vllm = self.vllm_importance_sampling_correction = vllm_importance_sampling_correction
        self.aux_loss_enabled, self.top_entropy_quantile = False, 1.0
        self.off_policy_mask_threshold = off_policy_mask_threshold
        defaults = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                        vespo_k_neg=3.0, vespo_lambda_neg=2.0)
        self.args = SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                                    steps_per_generation=gradient_accumulation_steps, **{**defaults, **loss_args})
        self.accelerator, self.model = _OneProcess(), SimpleNamespace(training=True)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return model

    def __call__(self, logps, mask, advantages, old=None, ref=None, entropies=None, importance_ratio=None,
                 num_items_in_batch=None, sampling=None):
        """The loss of one micro-batch: logps, entropies [B, T] (differentiable), mask [B, T] (0/1), advantages [B],
        old/ref [B, T] or None, importance_ratio [B, T] or [B, 1] (vLLM's), num_items_in_batch: the generation
        batch's trained tokens (default: this micro-batch's), sampling [B, T]: the sampler's log-probs (vLLM's; the
        off-policy mask reads them)."""
        batch, length = logps.shape
        entropies = torch.zeros_like(logps) if entropies is None else entropies
        inputs = {"prompt_ids": torch.zeros(batch, 1, dtype=torch.long), "prompt_mask": torch.ones(batch, 1),
                  "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask,
                  "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
                  "importance_sampling_ratio": importance_ratio,
                  "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch}
        if sampling is not None:
            inputs["sampling_per_token_logps"] = sampling
        return GRPOTrainer._compute_loss(self, (logps, entropies, None), inputs)


def trl_rollout_ratio(old, sampling, mask, mode, clip_min=None, clip_max=3.0):
    """TRL 1.16's vLLM importance-sampling ratio (grpo_trainer.py, `_generate_and_score_completions`)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_advantages(rewards, scale=True):
    """TRL's group-scaled advantages: (r - mean) / (std + 1e-4), std unbiased."""
    centered = rewards - rewards.mean()
    return centered / (rewards.std() + 1e-4) if scale else centered


# -- verl ------------------------------------------------------------------------------------------------------------
def verl_agg(loss_mat, mask, mode, global_tokens=None, global_sequences=None, dp_size=1, loss_scale_factor=None):
    """verl's agg_loss on one data-parallel rank's micro-batch, normalised over the global batch (its
    `batch_num_tokens` / `global_batch_size`), times dp_size (its gradients are averaged over ranks)."""
    global_tokens = mask.sum() if global_tokens is None else global_tokens
    global_sequences = mask.shape[0] if global_sequences is None else global_sequences
    if mode == "token-mean":
        return (loss_mat * mask).sum() / global_tokens * dp_size
    seq_sums = (loss_mat * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(dim=-1).clamp(min=1)).sum() / global_sequences * dp_size
    if mode == "seq-mean-token-sum-norm":
        factor = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (seq_sums / factor).sum() / global_sequences * dp_size
    raise ValueError(mode)


def verl_kl(logp, ref, kind):
    """verl's kl_penalty."""
    if kind in ("kl", "k1"):
        return logp - ref
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref).square()
    kl = torch.clamp(ref - logp, min=-20, max=20)  # "low_var_kl" (verl's "k3" too)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_loss(logp, mask, advantages, old, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0, mode="token-mean",
              ref=None, kl_coef=0.0, kl_penalty="low_var_kl", entropies=None, entropy_coeff=0.0,
              loss_mode="vanilla", **agg):
    """verl's actor loss: policy loss (vanilla with dual clip, or gspo) - entropy_coeff * entropy + kl_coef * kl,
    each aggregated by agg_loss."""
    adv = advantages.unsqueeze(-1).expand_as(logp)
    if loss_mode == "gspo":  # compute_policy_loss_gspo
        seq_log_ratio = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
        ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
        losses = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    else:
        ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
        clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
        losses = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, clipped), clipped)
    loss = verl_agg(losses, mask, mode, **agg)
    if entropy_coeff:
        loss = loss - entropy_coeff * verl_agg(entropies, mask, mode, **agg)
    if kl_coef:
        loss = loss + kl_coef * verl_agg(verl_kl(logp, ref, kl_penalty), mask, mode, **agg)
    return loss
