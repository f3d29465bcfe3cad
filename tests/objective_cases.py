"""The objective cases held against the peers' losses through the transaction, one rank (tests/equivalence/
test_objective_transaction.py) and CP 2 (tests/distributed/test_cp_objectives.py): our settings beside the peer's
loss on the padded batch, and the group they run on."""

import torch
from models import float64_model, full_sequence_logprobs
from peer_losses import TRLLoss, trl_advantages, trl_rollout_ratio, verl_loss

from ds_longstraw import GRPOGroup

LENGTH = 10  # the padded batch's completion length (max_completion_length)

# name: (our objective's settings, the peer's loss on the padded batch)
CASES = {
    "trl-dapo-sequence-kl": (
        dict(kl_coef=0.04, ratio_level="sequence", clip_high=0.28, advantage_eps=1e-4),
        lambda b: TRLLoss("dapo", epsilon_high=0.28, beta=0.04, importance_sampling_level="sequence")(
            b.logps, b.mask, b.trl_adv, old=b.old, ref=b.ref)),
    "trl-bnpo-entropy": (
        dict(entropy_coef=0.05, advantage_eps=1e-4),
        lambda b: TRLLoss("bnpo", entropy_coef=0.05)(b.logps, b.mask, b.trl_adv, old=b.old, entropies=b.entropies)),
    "trl-grpo-bias-corrected-kl": (
        dict(loss_agg="seq-mean-token-mean", kl_coef=0.1, kl_ratio_weighted=True, advantage_eps=1e-4),
        lambda b: TRLLoss("grpo", beta=0.1, use_bias_correction_kl=True)(b.logps, b.mask, b.trl_adv, old=b.old,
                                                                         ref=b.ref)),
    "trl-dr_grpo-rollout-correction": (
        dict(loss_agg="seq-mean-token-sum-norm", norm_length=LENGTH, rollout_correction="sequence_mask",
             rollout_correction_max=2.0, advantage_eps=1e-4),
        lambda b: TRLLoss("dr_grpo", max_completion_length=LENGTH, vllm_importance_sampling_correction=True)(
            b.logps, b.mask, b.trl_adv, old=b.old,
            importance_ratio=trl_rollout_ratio(b.old, b.sampling, b.mask, "sequence_mask", clip_max=2.0))),
    "trl-cispo-token-truncate": (
        dict(policy_loss="cispo", cispo_ratio_max=1.1, rollout_correction="token_truncate", advantage_eps=1e-4),
        lambda b: TRLLoss("cispo", epsilon_high=1.1, vllm_importance_sampling_correction=True)(
            b.logps, b.mask, b.trl_adv, old=b.old,
            importance_ratio=trl_rollout_ratio(b.old, b.sampling, b.mask, "token_truncate"))),
    # scored at TRL's sampling temperature: the policy's and the reference's log-probs and the entropies are of
    # logits / 0.7 (the reference's too: the case's references are computed at the objective's temperature)
    "trl-dapo-temperature-kl-entropy": (
        dict(temperature=0.7, kl_coef=0.04, entropy_coef=0.05, advantage_eps=1e-4),
        lambda b: TRLLoss("dapo", beta=0.04, entropy_coef=0.05)(b.logps, b.mask, b.trl_adv, old=b.old, ref=b.ref,
                                                                 entropies=b.entropies)),
    # TRL's two-sided clip (delta 1.3: objective_group's ratios reach 1.79, so the cap bites on positive advantages)
    "trl-dapo-two-sided-clip-kl": (
        dict(two_sided_clip=1.3, kl_coef=0.04, kl_ratio_weighted=True, advantage_eps=1e-4),
        lambda b: TRLLoss("dapo", delta=1.3, beta=0.04, use_bias_correction_kl=True)(b.logps, b.mask, b.trl_adv,
                                                                                      old=b.old, ref=b.ref)),
    # SAPO's gate temperatures 0.75 and 1.25: TRL's torch.where(A > 0, pos, neg) of two Python floats is a float32
    # tensor, so its temperatures are float32 roundings (1.05, its default, is off by 2e-8): these are exact there
    "trl-sapo-sequence-ratio": (
        dict(policy_loss="sapo", loss_agg="seq-mean-token-mean", ratio_level="sequence", sapo_temperature_pos=0.75,
             sapo_temperature_neg=1.25, advantage_eps=1e-4),
        lambda b: TRLLoss("sapo", importance_sampling_level="sequence", sapo_temperature_pos=0.75,
                          sapo_temperature_neg=1.25)(b.logps, b.mask, b.trl_adv, old=b.old)),
    # VESPO with vLLM's token truncation folded into its weight (not multiplied after it)
    "trl-vespo-token-truncate": (
        dict(policy_loss="vespo", rollout_correction="token_truncate", vespo_k_pos=1.5, vespo_lambda_neg=2.5,
             advantage_eps=1e-4),
        lambda b: TRLLoss("vespo", vllm_importance_sampling_correction=True, vespo_k_pos=1.5, vespo_lambda_neg=2.5)(
            b.logps, b.mask, b.trl_adv, old=b.old,
            importance_ratio=trl_rollout_ratio(b.old, b.sampling, b.mask, "token_truncate"))),
    "trl-vespo-sequence-mask": (
        dict(policy_loss="vespo", rollout_correction="sequence_mask", rollout_correction_max=2.0,
             rollout_correction_min=0.1, advantage_eps=1e-4),
        lambda b: TRLLoss("vespo", vllm_importance_sampling_correction=True)(
            b.logps, b.mask, b.trl_adv, old=b.old,
            importance_ratio=trl_rollout_ratio(b.old, b.sampling, b.mask, "sequence_mask", 0.1, 2.0))),
    # DeepSeek-V3.2's off-policy sequence mask on the sampler's log-probs: threshold 0.05 drops some negative members
    "trl-grpo-off-policy-mask": (
        dict(loss_agg="seq-mean-token-mean", off_policy_mask=0.05, rollout_correction="token_truncate",
             advantage_eps=1e-4),
        lambda b: TRLLoss("grpo", off_policy_mask_threshold=0.05, vllm_importance_sampling_correction=True)(
            b.logps, b.mask, b.trl_adv, old=b.old, sampling=b.sampling,
            importance_ratio=trl_rollout_ratio(b.old, b.sampling, b.mask, "token_truncate"))),
    "verl-dual-clip-low-var-kl-entropy": (
        dict(clip_ratio_c=3.0, kl_coef=0.05, kl_estimator="low_var_kl", entropy_coef=0.02,
             loss_agg="seq-mean-token-mean"),
        lambda b: verl_loss(b.logps, b.mask, b.adv, b.old, clip_ratio_c=3.0, mode="seq-mean-token-mean", ref=b.ref,
                            kl_coef=0.05, kl_penalty="low_var_kl", entropies=b.entropies, entropy_coeff=0.02)),
    # objective_group's ratios reach 1.79 on its negative-advantage members, under the 3.0 above: here the dual clip
    # bites (3 tokens)
    "verl-dual-clip-bites-low-var-kl-entropy": (
        dict(clip_ratio_c=1.5, kl_coef=0.05, kl_estimator="low_var_kl", entropy_coef=0.02,
             loss_agg="seq-mean-token-mean"),
        lambda b: verl_loss(b.logps, b.mask, b.adv, b.old, clip_ratio_c=1.5, mode="seq-mean-token-mean", ref=b.ref,
                            kl_coef=0.05, kl_penalty="low_var_kl", entropies=b.entropies, entropy_coeff=0.02)),
    "verl-k1-sum-norm": (
        dict(clip_ratio_c=3.0, kl_coef=0.05, kl_estimator="k1", loss_agg="seq-mean-token-sum-norm",
             norm_length=LENGTH),
        lambda b: verl_loss(b.logps, b.mask, b.adv, b.old, mode="seq-mean-token-sum-norm", ref=b.ref, kl_coef=0.05,
                            kl_penalty="k1")),
    "verl-k2-token-mean": (
        dict(clip_ratio_c=3.0, kl_coef=0.05, kl_estimator="k2"),
        lambda b: verl_loss(b.logps, b.mask, b.adv, b.old, ref=b.ref, kl_coef=0.05, kl_penalty="k2")),
}


class Batch:
    """One group's members as a padded [G, LENGTH] batch, as the peers take it."""

    def __init__(self, group, objective, logps, refs, entropies):
        def pad(rows):
            return torch.stack([torch.cat([r, r.new_zeros(LENGTH - r.numel())]) for r in rows])

        self.logps, self.entropies = pad(logps), pad(entropies)
        self.mask = pad([group.mask(i).double() for i in range(group.size)])
        self.old, self.sampling = pad(group.old_logprobs), pad(group.sampling_logprobs)
        self.ref = None if refs is None else pad(refs)
        self.adv, self.trl_adv = objective.advantages(group), trl_advantages(group.rewards)


def objective_group(model, seed=0, context=float64_model, prompt_len=21, response_lens=(6, 9, 4, 10)):
    """Members with tool masks (the first token of the first member trained; the third member, where there is
    one, all masked), old log-probs a step away from the current policy (so ratios leave 1 and the clips bite), and
    a sampler's log-probs off from those. context: the float64 reference settings the current log-probs are computed
    under (float64_model for qwen3_5; tests/glm_models.py's glm_reference for GLM; nullcontext for the model's own
    dtype, as tests/dist_scripts/engine_checks.py's float32 engine check)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 97, (n,), generator=gen) for n in response_lens]
    masks = [torch.rand(r.numel(), generator=gen) > 0.25 for r in responses]
    masks[0][0] = True
    if len(masks) > 2:
        masks[2][:] = False
    with torch.no_grad(), context():
        current = full_sequence_logprobs(model, prompt, responses)
    old = [lp.double() + 0.4 * torch.randn(lp.numel(), generator=gen, dtype=torch.float64) for lp in current]
    sampling = [o + 0.3 * torch.randn(o.numel(), generator=gen, dtype=torch.float64) for o in old]
    return GRPOGroup(prompt, responses, rewards=torch.rand(len(responses), generator=gen), old_logprobs=old,
                     response_masks=masks, sampling_logprobs=sampling)
