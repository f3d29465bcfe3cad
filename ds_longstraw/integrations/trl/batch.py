"""A TRL generation batch (its micro-batches as _prepare_inputs buffers them) as GRPO groups, one per prompt.

TRL's rows are left-padded prompts and right-padded completions; a member here is one row without its padding:
the prompt where prompt_mask is 1, the completion up to its last position with completion_mask 1 (before
mask_truncated_completions zeroed it: the true length is then the row's non-pad tail). Its trained tokens are
completion_mask x tool_mask, as TRL's loss mask. Rows with no trained token are left out of the groups: their
share is 0 whatever the normalisation, and they still count in their micro-batch's scope (scopes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ds_longstraw.group import GRPOGroup
from ds_longstraw.integrations.trl.scopes import trl_scope
from ds_longstraw.objective import LossScope


@dataclass(frozen=True)
class Member:
    """Row `row` of micro-batch `chunk`: where a member's old log-probs are kept between iterations."""

    chunk: int
    row: int


@dataclass
class PromptGroup:
    group: GRPOGroup
    members: list  # Member per response, in the group's order
    scopes: list  # LossScope per response


def _response_length(completion_ids: torch.Tensor, completion_mask: torch.Tensor, pad_token_id: int | None) -> int:
    """The completion's length: through its last masked-in token, or (a row mask_truncated_completions zeroed)
    through its last token that is not padding."""
    positions = completion_mask.nonzero()
    if positions.numel():
        return int(positions[-1]) + 1
    if pad_token_id is None:
        return completion_ids.numel()
    real = (completion_ids != pad_token_id).nonzero()
    return int(real[-1]) + 1 if real.numel() else 0


def prompt_groups(chunks: Sequence[dict[str, Any]], *, loss_type: str, accumulation: int, processes: int,
                  steps_per_generation: int, pad_token_id: int | None,
                  old_logprobs: dict[Member, torch.Tensor] | None = None, scored: int = 0,
                  policy_masks: Sequence[torch.Tensor] | None = None) -> list[PromptGroup]:
    """An optimizer step's members grouped by prompt (first appearance order), each with TRL's advantage, loss
    mask, sampler log-probs (where TRL keeps them), old log-probs (`old_logprobs`: the generation's weights', for
    the members that have them; a prompt's members with and without them form two groups) and its micro-batch's
    LossScope. The last `scored` chunks are scored, not trained: their members' LossScope has weight 0 (a share of
    0; the transaction returns their log-probs, the old log-probs of a later step). policy_masks: per chunk, TRL's
    entropy mask (rows x completion positions; top_entropy_quantile): each member's LossScope.policy_tokens, and
    the tokens the entropy bonus averages over."""
    by_prompt: dict[tuple, dict[str, list]] = {}
    for index, chunk in enumerate(chunks):
        loss_mask = chunk["completion_mask"]
        if chunk.get("tool_mask") is not None:
            loss_mask = loss_mask * chunk["tool_mask"]
        loss_mask = loss_mask.bool()
        policy_mask = None if policy_masks is None or index >= len(policy_masks) else policy_masks[index]
        scope = trl_scope(loss_type, micro_batch_members=int(loss_mask.shape[0]),
                          micro_batch_tokens=int(loss_mask.sum()), accumulation=accumulation,
                          batch_tokens=int(chunk["num_items_in_batch"]), processes=processes,
                          steps_per_generation=steps_per_generation,
                          entropy_tokens=None if policy_mask is None else int((loss_mask.cpu() & policy_mask).sum()))
        if index >= len(chunks) - scored:
            scope = LossScope(tokens=1, members=1, weight=0.0)
        sampling = chunk.get("sampling_per_token_logps")
        for row in range(loss_mask.shape[0]):
            if not loss_mask[row].any():
                continue
            prompt = chunk["prompt_ids"][row][chunk["prompt_mask"][row].bool()].cpu()
            length = _response_length(chunk["completion_ids"][row], chunk["completion_mask"][row], pad_token_id)
            member = Member(index, row)
            has_old = old_logprobs is not None and member in old_logprobs
            entry = by_prompt.setdefault((tuple(prompt.tolist()), has_old), {
                "prompt": prompt, "responses": [], "masks": [], "advantages": [], "sampling": [], "members": [],
                "scopes": [], "has_old": has_old})
            entry["responses"].append(chunk["completion_ids"][row, :length].cpu())
            entry["masks"].append(loss_mask[row, :length].cpu())
            entry["advantages"].append(float(chunk["advantages"][row]))
            entry["sampling"].append(None if sampling is None else sampling[row, :length].detach().cpu())
            entry["members"].append(member)
            entry["scopes"].append(scope if policy_mask is None or scope.weight == 0.0
                                   else replace(scope, policy_tokens=policy_mask[row, :length]))
    groups = []
    for entry in by_prompt.values():
        masks = entry["masks"]
        old = None
        if entry["has_old"]:
            old = [old_logprobs[member] for member in entry["members"]]
        sampling = None if entry["sampling"][0] is None else entry["sampling"]
        group = GRPOGroup(entry["prompt"], entry["responses"], advantages=entry["advantages"],
                          response_masks=None if all(bool(m.all()) for m in masks) else masks,
                          old_logprobs=old, sampling_logprobs=sampling)
        groups.append(PromptGroup(group, entry["members"], entry["scopes"]))
    return groups
