"""TRL's GRPO settings onto the objective, and the settings the transaction does not run (refused by name).

What maps (TRL 1.16's GRPOConfig -> objective.GRPOObjective; the normalisation's scope is scopes.py's):
  epsilon, epsilon_high          clip_low, clip_high (epsilon_high unset: epsilon, as TRL)
  beta                           kl_coef, with TRL's estimator exp(ref - logp) - (ref - logp) - 1: "k3"
  use_bias_correction_kl         kl_ratio_weighted
  importance_sampling_level      ratio_level ("token" | "sequence": GSPO's mean log-ratio over trained tokens)
  loss_type grpo                 loss_agg seq-mean-token-mean   (each member's token mean, averaged)
            bnpo, dapo           loss_agg token-mean            (over the micro-batch / the generation batch)
            dr_grpo              loss_agg seq-mean-token-sum-norm, norm_length = max_completion_length
            luspo                loss_agg seq-mean-token-sum-norm, norm_length = 1 (each member's token sum)
            cispo                policy_loss cispo, cispo_ratio_max = epsilon_high, loss_agg token-mean
            sapo                 policy_loss sapo (sapo_temperature_pos/_neg), loss_agg seq-mean-token-mean
            vespo                policy_loss vespo (vespo_k_pos, _lambda_pos, _k_neg, _lambda_neg), token-mean
  delta                          two_sided_clip (the clip loss types; TRL ignores it for cispo, sapo, vespo)
  off_policy_mask_threshold      off_policy_mask (on the sampler's log-probs where TRL keeps them, else the old)
  vllm_importance_sampling_*     rollout_correction (mode), rollout_correction_min/_max (clip_min/_max), from the
                                 sampler's log-probs TRL keeps (use_vllm with the correction on)
  scale_rewards, multi_objective_aggregation, mask_truncated_completions, num_generations, reward_weights:
                                 TRL computes the advantages and masks; the groups carry them as given.
  num_iterations                 old log-probs: the transaction's own log-probs of the first iteration.
  temperature                    temperature: every log-prob the transaction takes (policy, reference, old) is of
                                 logits / temperature, as TRL scores them; generate_from_capture samples at it.
  steps_per_generation           the trainer runs each optimizer step's micro-batches (trainer.py); old log-probs of
                                 a later step's members: their generation step's, from a replay with a share of 0.
  entropy_coef                   entropy_coef, entropy_agg "scope": LossScope.entropy_weight = 1 / (A max(n, 1)),
                                 TRL's per-micro-batch token mean whatever the loss type (scopes.py)
  use_adaptive_entropy,          the step's entropy_coef from TRL's controller (its own attributes, so its checkpoint
  entropy_coef_min/_max/_delta,  file still works), updated from the step's entropy over every process
  entropy_target
  top_entropy_quantile           LossScope.policy_tokens: TRL's get_high_entropy_mask over an entropy pass before the
                                 transactions (entropies.py; one more detached capture and forward per step)
Everything else of the loss is refused, naming the setting and its value, before the model is touched (a negative
entropy_coef, cast_lm_head_to_fp32, use_liger_kernel, other loss types).
"""

from __future__ import annotations

from typing import Any

from ds_longstraw.objective import GRPOObjective

LOSS_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "cispo": "token-mean",
            "dr_grpo": "seq-mean-token-sum-norm", "luspo": "seq-mean-token-sum-norm", "sapo": "seq-mean-token-mean",
            "vespo": "token-mean"}
CLIP_LOSSES = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")  # the loss types TRL's delta applies to


def _refusals(args: Any) -> list[tuple[str, Any, str]]:
    """(setting, value, why) for every TRL setting of `args` that the transaction would not honour."""
    refused = []

    def refuse(name: str, value: Any, why: str) -> None:
        refused.append((name, value, why))

    if args.loss_type not in LOSS_AGG:
        refuse("loss_type", args.loss_type, f"the transaction runs {sorted(LOSS_AGG)}")
    if args.entropy_coef < 0.0:
        refuse("entropy_coef", args.entropy_coef, "the objective's entropy bonus is >= 0")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel", True, "the transaction computes the loss itself")
    if args.cast_lm_head_to_fp32:
        refuse("cast_lm_head_to_fp32", True, "the transaction's log-probs come from its own chunked pass")
    return refused


def check_trl_settings(args: Any) -> None:
    """ValueError naming every refused setting of `args` (a GRPOConfig) and its value."""
    refused = _refusals(args)
    if refused:
        lines = "; ".join(f"{name} = {value!r} ({why})" for name, value, why in refused)
        raise ValueError(f"LongStrawGRPOTrainer with a 'longstraw' block does not run: {lines}")


def objective_from_trl(args: Any, use_vllm: bool | None = None) -> GRPOObjective:
    """The GRPOObjective that TRL's loss of `args` (a GRPOConfig) is, token for token (module docstring)."""
    check_trl_settings(args)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    fields: dict[str, Any] = dict(clip_low=args.epsilon, clip_high=epsilon_high, kl_coef=args.beta,
                                  kl_estimator="k3", kl_ratio_weighted=bool(args.use_bias_correction_kl),
                                  ratio_level=args.importance_sampling_level, loss_agg=LOSS_AGG[args.loss_type],
                                  empty_members="count", temperature=args.temperature,
                                  report_entropy=True,  # TRL logs the mean entropy (metrics.py)
                                  entropy_coef=args.entropy_coef, entropy_agg="scope")  # TRL's bonus: scopes.py
    if args.loss_type == "cispo":
        fields.update(policy_loss="cispo", cispo_ratio_max=epsilon_high)
    if args.loss_type == "sapo":
        fields.update(policy_loss="sapo", sapo_temperature_pos=args.sapo_temperature_pos,
                      sapo_temperature_neg=args.sapo_temperature_neg)
    if args.loss_type == "vespo":
        fields.update(policy_loss="vespo", vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                      vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg)
    if args.delta is not None and args.loss_type in CLIP_LOSSES:
        fields["two_sided_clip"] = args.delta
    if args.off_policy_mask_threshold is not None:
        fields["off_policy_mask"] = args.off_policy_mask_threshold
    if args.loss_type == "dr_grpo":
        fields["norm_length"] = args.max_completion_length
    if args.loss_type == "luspo":
        fields["norm_length"] = 1
    use_vllm = args.use_vllm if use_vllm is None else use_vllm
    if use_vllm and args.vllm_importance_sampling_correction:
        fields.update(rollout_correction=args.vllm_importance_sampling_mode,
                      rollout_correction_min=args.vllm_importance_sampling_clip_min,
                      rollout_correction_max=args.vllm_importance_sampling_clip_max)
    return GRPOObjective(**fields)
