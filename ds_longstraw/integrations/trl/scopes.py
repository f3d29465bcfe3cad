"""TRL's per-micro-batch normalisation as one LossScope per member.

TRL shuffles a generation batch, splits it into gradient_accumulation_steps micro-batches and normalises each
micro-batch's loss by its own counts, divided by the accumulation steps. Members of one prompt land in different
micro-batches, so a transaction (one per prompt) gives each member the LossScope of the micro-batch it was drawn
into; the sum of the shares over the step is then TRL's loss summed over its micro-batches, term for term.

With A accumulation steps, B members in the member's micro-batch, n its micro-batch's trained tokens, N the
generation batch's trained tokens over all P processes and S = steps_per_generation, member i's weight c_i (the
factor on its summed token losses) in TRL 1.16's _compute_loss is
  grpo      1 / (A B T_i)                (T_i its trained tokens)   objective: seq-mean-token-mean, members A B
  bnpo      1 / (A max(n, 1))                                       token-mean, tokens A max(n, 1)
  dr_grpo   1 / (A B max_completion_length)                         seq-mean-token-sum-norm, members A B
  luspo     1 / (A B)                                               seq-mean-token-sum-norm (length 1), members A B
  dapo,     P S / (A max(N, 1))                                     token-mean, tokens max(N, 1), weight P S / A
  cispo, vespo
  sapo      as grpo
and DeepSpeed (or nothing, on one process) then averages the P processes' gradients as it does TRL's.
"""

from __future__ import annotations

from ds_longstraw.objective import LossScope


def trl_scope(loss_type: str, *, micro_batch_members: int, micro_batch_tokens: int, accumulation: int,
              batch_tokens: int, processes: int, steps_per_generation: int,
              entropy_tokens: int | None = None) -> LossScope:
    """The LossScope of a member drawn into a micro-batch of `micro_batch_members` members holding
    `micro_batch_tokens` trained tokens (the table above; batch_tokens: TRL's num_items_in_batch). Its
    entropy_weight is TRL's entropy bonus's, 1 / (A max(n_H, 1)) whatever the loss type, n_H the micro-batch's
    trained tokens the bonus averages over (`entropy_tokens`: those above the entropy quantile; default all)."""
    members = accumulation * micro_batch_members
    n_entropy = micro_batch_tokens if entropy_tokens is None else entropy_tokens
    entropy_weight = 1.0 / (accumulation * max(n_entropy, 1))
    if loss_type == "bnpo":
        return LossScope(tokens=accumulation * max(micro_batch_tokens, 1), members=members,
                         entropy_weight=entropy_weight)
    if loss_type in ("dapo", "cispo", "vespo"):
        return LossScope(tokens=max(batch_tokens, 1), members=members,
                         weight=processes * steps_per_generation / accumulation, entropy_weight=entropy_weight)
    if loss_type in ("grpo", "dr_grpo", "luspo", "sapo"):
        return LossScope(tokens=accumulation * micro_batch_tokens, members=members, entropy_weight=entropy_weight)
    raise ValueError(f"loss_type {loss_type!r} has no LossScope (integrations/trl/settings.py lists those that map)")
