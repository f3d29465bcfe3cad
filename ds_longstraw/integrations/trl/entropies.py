"""TRL's top_entropy_quantile before the transaction: the policy's entropies scored first, without a graph.

TRL masks the policy term of every token whose entropy is below the (1 - top_entropy_quantile) quantile of its
micro-batch's trained tokens on every process (GRPOTrainer.get_high_entropy_mask). A transaction back-propagates each
member as it replays it, so the threshold must be known before any member's loss: each group of the step is scored
first with the current weights (its prompt captured detached, every member replayed under no_grad with its
entropies), the masks are taken by TRL's own get_high_entropy_mask on those entropies, and the transactions then
train with them. Cost: one more detached capture of every prompt and one more forward (no graph) of every trained
member per optimizer step. One process, or several without ZeRO-3 (a ZeRO-3 capture gathers weights with
collectives that this pass does not pad across processes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ds_longstraw.arch import adapter_for
from ds_longstraw.grpo.lockstep import Schedule
from ds_longstraw.grpo.replay import MemberReplay, member_inputs, replay_member
from ds_longstraw.grpo.topology import OneRank
from ds_longstraw.integrations.trl.batch import PromptGroup


def score_entropies(model: torch.nn.Module, groups: Sequence[PromptGroup], longstraw: Any,
                    temperature: float) -> dict:
    """Member -> the policy's entropy at each of its response tokens (float64, CPU), without a graph."""
    adapter = adapter_for(model)
    adapter.logprobs_temperature = temperature
    topology, schedule = OneRank(), Schedule()
    entropies = {}
    with torch.no_grad():
        for entry in groups:
            group = entry.group
            state = topology.capture(adapter, group.prompt_ids, longstraw, "detached", schedule)
            try:
                view = topology.replay_view(adapter, state, "detached")
                try:
                    source = MemberReplay(adapter, view.leaves, group.prompt_ids.numel() - 1, longstraw.replay_block)
                    for i, member in enumerate(entry.members):
                        inputs, targets = member_inputs(group, i)
                        _, entropy = replay_member(source, inputs, targets, with_entropy=True)
                        entropies[member] = entropy.double().cpu()
                finally:
                    view.release()
            finally:
                state.release()
    return entropies


def entropy_masks(chunks: Sequence[dict], entropies: dict, high_entropy_mask: Callable, quantile: float) -> list:
    """Per micro-batch (Member.chunk indexes `chunks`), TRL's mask of the tokens it trains the policy on:
    high_entropy_mask(entropies [rows, T], loss mask, 1 - quantile) (TRL's own get_high_entropy_mask, gathering over
    processes), as a bool CPU tensor."""
    from ds_longstraw.integrations.trl.batch import Member

    masks = []
    for k, chunk in enumerate(chunks):
        mask = chunk["completion_mask"]
        if chunk.get("tool_mask") is not None:
            mask = mask * chunk["tool_mask"]
        values = torch.zeros(mask.shape, dtype=torch.float64)
        for row in range(mask.shape[0]):
            entropy = entropies.get(Member(k, row))
            if entropy is not None:
                values[row, :entropy.numel()] = entropy
        values = values.to(device=mask.device)
        masks.append(high_entropy_mask(values, mask, 1.0 - quantile).bool().cpu())
    return masks
