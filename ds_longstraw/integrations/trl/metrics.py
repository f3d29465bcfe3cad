"""TRL 1.16's training metrics by TRL's definitions, from the transactions' per-token values, and the transaction's own.

TRL's _compute_loss appends, per micro-batch, the metrics below to its `_metrics`, and its log() averages each list
over the micro-batches since the last log. One value per micro-batch is appended here too, from the members TRL drew
into that micro-batch (batch.Member(chunk, row)) and the step's log-probs: every micro-batch of an optimizer step sees
the same weights (no update in between), so those are the log-probs TRL's micro-steps compute. Legend: w the
importance weight, exp(logp - old) per token (old: the first iteration's log-probs, else logp: w = 1), or with
importance_sampling_level "sequence" exp of the sequence's mean log-ratio over its trained tokens; A the advantage.

Each "mean" is over the micro-batch's trained tokens (completion mask x tool mask) on every process, one reduction
of sums and counts (TRL's global_masked_mean); at the sequence level the clip shares count sequences instead (every
row of the micro-batch, an untrained one as unclipped, as TRL's (B, 1) tensors do):
  kl                      exp(ref - logp) - (ref - logp) - 1, times w with use_bias_correction_kl (beta != 0 only)
  entropy                 the policy's entropy at each token, at the sampling temperature
  clip_ratio/low_mean     w < 1 - epsilon_low and A < 0        (clip loss types; w capped at delta first)
  clip_ratio/high_mean    w > 1 + epsilon_high and A > 0
  clip_ratio/region_mean  either
  clip_ratio/low_min      the least per-sequence low share over the micro-batch's sequences on every process
                          (token level: each sequence's mean over its trained tokens; untrained ones left out)
  clip_ratio/high_max     the greatest per-sequence high share
  cispo_clip_ratio        w > epsilon_high and A > 0              (cispo)
  vespo/phi_seq_mean      VESPO's weight phi (objective.py), per sequence (an untrained one: 1)       (vespo)
sapo logs none of the clip metrics (as TRL). Not here: the entropy of a member that ran in steps
(grpo/member_steps.py returns none: left out of the mean).
With the entropy bonus on (entropy_bonus_metrics): policy_loss per micro-batch (the loss without the bonus, TRL's
normaliser before the accumulation's division; averaged over processes) and entropy_coef once per step.

The transaction's own, one value per optimizer step (transaction_metrics):
  longstraw/capture_seconds  the step's prompt (and shared document) captures on this process, the slowest process
  longstraw/pages_bytes      the largest captured prompt's retained pages of the step, the largest process
  longstraw/capture_reused   the share of the step's groups, on every process, that trained on a kept capture
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ds_longstraw.integrations.trl.batch import Member, PromptGroup
from ds_longstraw.objective import GRPOObjective

# the reduced means, in the order of the sums tensor's second axis
MEANS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
         "vespo/phi_seq_mean")


def _member_values(groups: Sequence[PromptGroup], results: Sequence[Any]) -> dict[Member, dict]:
    """Member -> its trained tokens' logp, ref, old, entropy (float64, CPU; ref / entropy None where not scored)
    and advantage."""
    values = {}
    for entry, result in zip(groups, results, strict=True):
        group = entry.group
        for i, member in enumerate(entry.members):
            mask = group.mask(i)
            logp = result.logprobs[i].double()
            old = logp if group.old_logprobs is None else group.old_logprobs[i].double()
            ref = None if result.ref_logprobs is None else result.ref_logprobs[i].double()[mask]
            entropy = None if result.entropies is None else result.entropies[i].double()[mask]
            sampling = None if group.sampling_logprobs is None else group.sampling_logprobs[i].double()[mask]
            values[member] = dict(logp=logp[mask], old=old[mask], ref=ref, entropy=entropy, sampling=sampling,
                                  advantage=float(result.advantages[i]))
    return values


def trl_metrics(chunks: Sequence[dict], groups: Sequence[PromptGroup], results: Sequence[Any],
                objective: GRPOObjective, *, reduce: Callable[[torch.Tensor], torch.Tensor],
                gather: Callable[[torch.Tensor], torch.Tensor], device: Any = None) -> dict[str, list[float]]:
    """{metric: one value per micro-batch} (module docstring) of a generation batch's micro-batches `chunks` (TRL's
    buffered inputs), its groups and their transactions' results. reduce: a sum over processes (accelerate's
    reduce); gather: a concatenation over processes along the first axis (accelerate's gather)."""
    values = _member_values(groups, results)
    sequence = objective.ratio_level == "sequence"
    low_bound, high_bound = 1.0 - objective.clip_low, 1.0 + objective.clip_high
    count = len(chunks)
    rows = int(chunks[0]["completion_mask"].shape[0]) if chunks else 0
    sums = torch.zeros(count, len(MEANS), 2, dtype=torch.float64)
    low_seq = torch.full((count, rows), float("nan"), dtype=torch.float64)
    high_seq = torch.full((count, rows), float("nan"), dtype=torch.float64)
    for k in range(count):
        for row in range(rows):
            member = values.get(Member(k, row))
            if member is None:  # no trained token: a sequence-level weight of 1, unclipped; phi(1) = 1
                sums[k, 6] += 1.0
                if sequence:
                    sums[k, 2:6, 1] += 1.0
                    low_seq[k, row] = high_seq[k, row] = 0.0
                continue
            logp, advantage = member["logp"], member["advantage"]
            log_w = logp - member["old"]
            w = torch.exp(log_w.mean()).expand_as(logp) if sequence else torch.exp(log_w)
            tokens = float(logp.numel())
            if member["ref"] is not None:
                delta = member["ref"] - logp
                kl = torch.exp(delta) - delta - 1.0
                sums[k, 0] += torch.stack([(kl * w if objective.kl_ratio_weighted else kl).sum(),
                                           kl.new_tensor(tokens)])
            if member["entropy"] is not None:
                entropy = member["entropy"][~torch.isnan(member["entropy"])]  # NaN: a member that ran in steps
                sums[k, 1] += torch.stack([entropy.sum(), entropy.new_tensor(float(entropy.numel()))])
            if objective.policy_loss == "vespo":
                rho = None if objective.rollout_correction is None else objective._rollout_weight(
                    member["old"], member["sampling"])
                phi = objective._vespo_weight(log_w, rho, advantage)
                sums[k, 6] += torch.stack([phi, phi.new_tensor(1.0)])
            if objective.two_sided_clip is not None:  # TRL caps its ratio before it counts the clips
                w = torch.clamp(w, max=objective.two_sided_clip)
            low = (w < low_bound) & (advantage < 0)
            high = (w > high_bound) & (advantage > 0)
            cispo = (w > objective.cispo_ratio_max) & (advantage > 0)
            for column, clipped in ((2, low), (3, high), (4, low | high), (5, cispo)):
                share = clipped.double().mean()
                sums[k, column] += (torch.stack([share, share.new_tensor(1.0)]) if sequence
                                    else torch.stack([clipped.double().sum(), share.new_tensor(tokens)]))
            low_seq[k, row], high_seq[k, row] = low.double().mean(), high.double().mean()
    totals = reduce(sums.to(device)).cpu()
    means = totals[..., 0] / totals[..., 1].clamp(min=1.0)
    low_all = gather(low_seq.to(device)).cpu().view(-1, count, rows).transpose(0, 1).reshape(count, -1)
    high_all = gather(high_seq.to(device)).cpu().view(-1, count, rows).transpose(0, 1).reshape(count, -1)
    metrics: dict[str, list[float]] = {}
    if objective.kl_coef > 0:
        metrics["kl"] = means[:, 0].tolist()
    if objective.report_entropy:
        metrics["entropy"] = means[:, 1].tolist()
    if objective.policy_loss == "cispo":
        metrics["cispo_clip_ratio"] = means[:, 5].tolist()
    if objective.policy_loss == "vespo":
        metrics["vespo/phi_seq_mean"] = means[:, 6].tolist()
    if objective.policy_loss != "clip":
        return metrics
    metrics["clip_ratio/low_mean"] = means[:, 2].tolist()
    metrics["clip_ratio/high_mean"] = means[:, 3].tolist()
    metrics["clip_ratio/region_mean"] = means[:, 4].tolist()
    metrics["clip_ratio/low_min"] = [_nan_extreme(low_all[k], torch.min) for k in range(count)]
    metrics["clip_ratio/high_max"] = [_nan_extreme(high_all[k], torch.max) for k in range(count)]
    return metrics


def _nan_extreme(values: torch.Tensor, extreme: Callable) -> float:
    """TRL's nanmin / nanmax: the extreme of the values that are not NaN (NaN where none is)."""
    kept = values[~torch.isnan(values)]
    return float(extreme(kept)) if kept.numel() else float("nan")


def transaction_metrics(results: Sequence[Any], *, gather: Callable[[torch.Tensor], torch.Tensor],
                        device: Any = None) -> dict[str, float]:
    """The transaction's own metrics of one optimizer step (module docstring) from this process's results."""
    seconds = sum(result.phases["capture"].seconds for result in results if "capture" in result.phases)
    documents = {id(result.extras["document"]): result.extras["document"] for result in results
                 if "capture_seconds" in result.extras.get("document", {})}
    seconds += sum(document["capture_seconds"] for document in documents.values())
    pages = max((sum(result.retained_bytes.values()) for result in results), default=0)
    reused = sum(bool(result.extras.get("capture_reused")) for result in results)
    local = torch.tensor([[seconds, pages, reused, len(results)]], dtype=torch.float64)
    every = gather(local.to(device)).cpu()
    return {"longstraw/capture_seconds": float(every[:, 0].max()), "longstraw/pages_bytes": float(every[:, 1].max()),
            "longstraw/capture_reused": float(every[:, 2].sum() / every[:, 3].sum().clamp(min=1.0))}



def entropy_bonus_metrics(count: int, groups: Sequence[PromptGroup], results: Sequence[Any],
                          objective: GRPOObjective, *, loss_type: str, accumulation: int,
                          reduce: Callable[[torch.Tensor], torch.Tensor],
                          gather: Callable[[torch.Tensor], torch.Tensor], device: Any = None) -> tuple[list, float]:
    """What TRL logs and steers with its entropy bonus on, from an optimizer step's `count` trained micro-batches
    (Member.chunk < count; the others were scored only): per micro-batch its policy loss (TRL's `policy_loss`: the
    loss without the bonus, before the accumulation's division for the per-micro-batch loss types; each process's,
    averaged over processes), and the step's entropy over the tokens the bonus acts on, every process (the adaptive
    controller's world entropy)."""
    policy = replace(objective, entropy_coef=0.0)
    losses = torch.zeros(count, dtype=torch.float64)
    entropy = torch.zeros(2, dtype=torch.float64)
    for entry, result in zip(groups, results, strict=True):
        group = entry.group
        for i, member in enumerate(entry.members):
            if member.chunk >= count:
                continue
            scope, mask = entry.scopes[i], group.mask(i)

            def pick(values: list | None, i: int = i, mask: torch.Tensor = mask) -> torch.Tensor | None:
                return None if values is None else values[i].double()[mask]

            tokens = None if scope.policy_tokens is None else scope.policy_tokens[mask]
            losses[member.chunk] += policy.token_losses(
                pick(result.logprobs), float(result.advantages[i]), pick(group.old_logprobs),
                pick(result.ref_logprobs), None, pick(group.sampling_logprobs), tokens).sum() * policy.member_weight(
                group, i, scope)
            if result.entropies is not None:
                h = pick(result.entropies)
                kept = ~torch.isnan(h) if tokens is None else tokens.bool() & ~torch.isnan(h)
                entropy += torch.stack([h[kept].sum(), h.new_tensor(float(kept.sum()))])
    if loss_type not in ("dapo", "cispo", "vespo"):  # TRL logs these before dividing by the accumulation
        losses *= accumulation
    every = gather(losses.view(1, count).to(device)).cpu()
    totals = reduce(entropy.to(device)).cpu()
    return every.mean(0).tolist(), float(totals[0] / totals[1].clamp(min=1.0))
