"""Replay of one group member from captured prompt state, in blocks, with or without autograd.

A member's replay input is [prompt[-1], response[:-1]] at positions len(prompt)-1 onward, and its targets are
the response tokens: every response token's log-prob (the first one too) comes out of the replay. Blocks of
`replay_block` tokens carry each layer's carry forward and append their rows to the past of later blocks, so
attention score memory is bounded by one block while the member's graph spans the whole response.

The prompt's pages reach attention through a StagedPast (ds_longstraw.offload): each block's forward stages
one layer's pages at a time from the pool's tier, and the graph keeps handles instead of staged copies
(re-staged in backward), so with a host or NVMe tier no more than a few layers of pages are on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch.specs import stream_names
from ds_longstraw.grpo.interfaces import RemoteAttention, RemoteSelection
from ds_longstraw.grpo.lockstep import Schedule
from ds_longstraw.grpo.member_steps import replay_in_steps
from ds_longstraw.grpo.memory import return_freed_host_memory
from ds_longstraw.offload import Stager, node_past, staged_saves

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.group import GRPOGroup
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.objective import ScaledObjective, ScopedObjective
    from ds_longstraw.offload import ChainedPast, StagedPast


class ResponsePast(dict):
    """layer -> the row tuples a replayed member appends, and no prompt pages: the past of a replay whose prompt
    pages are reached through the view's remote attention (context parallelism). StagedPast's twin: fresh() (one
    per replayed member) and append()."""

    def fresh(self) -> ResponsePast:
        return ResponsePast({layer: list(segments) for layer, segments in self.items()})

    def append(self, layer: int, rows: Sequence[torch.Tensor]) -> None:
        self[layer].append(rows)


@dataclass
class PrefixLeaves:
    """The captured state as seen by replay: constants (detached mode) or leaves whose gradients are collected
    onto gradient pages (exact mode)."""

    carry: dict  # layer -> tuple of tensors
    past: StagedPast | ChainedPast | ResponsePast  # layer -> list of row tuples (Chained: a tree's node; Response: CP)
    stager: object = None  # the stager of this rank's pages (a tree node: a tuple, one per node), closed by release()
    # while a member's forward runs: autograd's saved-tensor hooks of a StagedPast (staged pages saved as handles,
    # re-staged in backward), or none
    saves: Callable[[], AbstractContextManager] = nullcontext

    def release(self) -> None:
        """Drop every staged layer (in-flight reads complete first)."""
        for stager in self.stager if isinstance(self.stager, tuple) else (self.stager,):
            if stager is not None:
                stager.close()


def prefix_leaves(adapter: CausalLMAdapter, state: PrefixState, prefix_grad: str) -> PrefixLeaves:
    """Replay's view of the captured state. prefix_grad "exact": the carry tensors are leaves, and the pages'
    gradients go to the pool's gradient pages as each block's backward produces them."""
    # wrap: every block walks all layers, so the read-ahead after the last layer is the first one. A tree's node
    # (grpo/document.py) reads its ancestors' pages before its own, one stager each.
    names = stream_names(adapter.specs)
    ancestors = state.ancestor_stagers(names, wrap=True)
    own = Stager(state.pool, names, wrap=True)
    stagers = [*(each for each, _ in ancestors), own]
    past = node_past(ancestors, own, state.length, grads_to_pages=prefix_grad == "exact")
    return PrefixLeaves(carry=carry_leaves(state.carry, prefix_grad), past=past,
                        stager=own if len(stagers) == 1 else tuple(stagers),
                        saves=partial(staged_saves, *stagers))


def carry_leaves(carry: Mapping[int, Iterable[torch.Tensor]], prefix_grad: str) -> dict[int, tuple[torch.Tensor, ...]]:
    """The carry as replay's inputs: detached, and leaves collecting d(loss)/d(carry) where prefix_grad is "exact"."""
    leaves = prefix_grad == "exact"
    return {layer: tuple(t.detach().requires_grad_(leaves) for t in parts) for layer, parts in carry.items()}


@dataclass(frozen=True)
class MemberReplay:
    """What replaying any member of one group reads: the adapter, the captured prefix's leaves, where responses
    start (the prompt's length minus one), the replay block, and the remote attention (None, or the context-parallel
    attention over every rank's prompt pages; then `leaves.past` holds no prompt pages: interfaces.py)."""

    adapter: CausalLMAdapter
    leaves: PrefixLeaves
    start: int
    block: int
    remote_attention: RemoteAttention | RemoteSelection | None = None
    # longstraw.member_span_capture: a member with an untrained span of at least this many tokens runs in steps
    # (member_steps.py); None: every member is replayed whole
    span_capture: int | None = None

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor,
                 with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return replay_member(self, inputs, targets, with_entropy)


def replay_member(source: MemberReplay, inputs: torch.Tensor, targets: torch.Tensor,
                  with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` given the captured prefix (differentiable when grad mode is on), a block at a time;
    with_entropy: (log-probs, the policy's entropy at each position), for an entropy bonus."""
    adapter, leaves, start, block = source.adapter, source.leaves, source.start, source.block
    carry = dict(leaves.carry)
    past = leaves.past.fresh()
    blocks = []  # per block: log-probs, or with_entropy (log-probs, entropies)
    with leaves.saves():
        for offset in range(0, inputs.numel(), block):
            end = min(inputs.numel(), offset + block)
            out = adapter.forward_segment(inputs[offset:end], start + offset, carry, past, source.remote_attention)
            carry = dict(out.carry)
            for layer, rows in out.rows.items():
                past.append(layer, rows)
            blocks.append(adapter.logprobs(out.hidden, targets[offset:end], with_entropy=with_entropy))
    if not with_entropy:
        return torch.cat(blocks)
    logps, entropies = zip(*blocks, strict=True)
    return torch.cat(logps), torch.cat(entropies)


def member_inputs(group: GRPOGroup, member: int) -> tuple[torch.Tensor, torch.Tensor]:
    response = group.response_ids[member]
    inputs = torch.cat([group.prompt_ids[-1:], response[:-1]])
    return inputs, response


def replay_group(source: MemberReplay, group: GRPOGroup, objective: ScopedObjective | ScaledObjective,
                 advantages: torch.Tensor, ref_logprobs: Sequence[torch.Tensor] | None, *,
                 backward: Callable | None = None, schedule: Schedule | None = None,
                 members: list | None = None, kept: list | None = None) -> tuple[float, list[torch.Tensor], int,
                                                                                  list | None]:
    """Replay every member one at a time WITH autograd, back-propagate its loss share, drop its graph.

    backward: how a share is back-propagated (default loss.backward(); the DeepSpeed engine passes its own);
    schedule: a lockstep.Schedule; under ZeRO-3 a Lockstep, which pads this rank's module calls to the other ranks'
    (dummy tokens and members; results unchanged); members: the members to replay (default all; a spread CP
    replay: this rank's share), whose positions in the list are the schedule's member slots; kept: per member,
    what generate kept of its observations (grpo/kept_spans.KeptSpans) or None (not under a schedule that pads).
    Returns (the replayed members' loss as a float, their log-probs detached on the CPU in float64, how many of
    them ran in steps: member_steps.py, and with objective.report_entropy their entropies likewise, None for a
    member that ran in steps, else None).
    """
    schedule = schedule or Schedule()
    logprobs, loss, stepped = [], 0.0, 0
    with_entropy = objective.computes_entropy
    entropies = [] if objective.report_entropy else None
    for slot, member in enumerate(range(group.size) if members is None else members):
        inputs, targets = member_inputs(group, member)
        ref = None if ref_logprobs is None else ref_logprobs[member]
        real = targets.numel()
        # a lockstep may run this slot in steps on every rank, over the padded length (lockstep.py)
        steps = schedule.member_steps(slot, group.mask(member), source.span_capture, source.block, group.held(member))
        # what generate kept of the observations; not with a held prefix, whose steps kept spans do not cut
        spans = None if kept is None or kept[member] is None or steps is None or group.held(member) else kept[member]
        kept_steps = None if spans is None else spans.steps(targets, group.mask(member), source.span_capture,
                                                            source.block)
        steps = steps if kept_steps is None else kept_steps
        inputs, targets = schedule.pad_member(slot, inputs, targets)
        if steps is not None:
            share_of = partial(_real_share, objective, group, member, advantages, ref, real)
            share, logp = replay_in_steps(source, steps, inputs, targets, share_of, objective.needs_entropy,
                                          backward, None if kept_steps is None else spans)
            loss += share
            logprobs.append(logp[:real].double().cpu())
            if entropies is not None:
                entropies.append(None)  # member_steps returns no entropies
            stepped += 1
            continue
        with torch.enable_grad():
            replayed = replay_member(source, inputs, targets, with_entropy=with_entropy)
            logp, entropy = replayed if with_entropy else (replayed, None)
            logp, entropy = logp[:real], None if entropy is None else entropy[:real]
            share = _member_share(objective, group, member, advantages, ref, logp, entropy)
            if share.requires_grad:
                share.backward() if backward is None else backward(share)
        loss += float(share.detach())
        logprobs.append(logp.detach().double().cpu())
        if entropies is not None:
            entropies.append(entropy.detach().double().cpu())
        del logp, entropy, share
        return_freed_host_memory(source.adapter.device)
    schedule.replay_dummy_members(source, backward, in_steps=partial(_dummy_in_steps, source, backward))
    return loss, logprobs, stepped, entropies


def _real_share(objective: ScopedObjective | ScaledObjective, group: GRPOGroup, member: int, advantages: torch.Tensor,
                ref: torch.Tensor | None, real: int, logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """The member's share from the log-probs (and entropies) of its real tokens, a lockstep's padding cut off."""
    return _member_share(objective, group, member, advantages, ref, logp[:real],
                         None if entropy is None else entropy[:real])


def _dummy_in_steps(source: MemberReplay, backward: Callable | None, steps: list, inputs: torch.Tensor,
                    targets: torch.Tensor) -> None:
    """A dummy member of a slot that runs in steps: its calls, a loss of 0."""
    replay_in_steps(source, steps, inputs, targets, lambda logp, entropy: logp.sum() * 0.0, False, backward)


def _member_share(objective: ScopedObjective | ScaledObjective, group: GRPOGroup, member: int,
                  advantages: torch.Tensor, ref: torch.Tensor | None, logp: torch.Tensor,
                  entropy: torch.Tensor | None) -> torch.Tensor:
    return objective.member_loss(group, member, logp, advantages, None if ref is None else ref.to(logp.device),
                                 entropy)


def final_carry_grads(leaves: PrefixLeaves) -> dict[int, tuple[torch.Tensor, ...]]:
    """d(loss)/d(carry after the prefix), accumulated over the members (zeros where none)."""
    return {layer: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in parts)
            for layer, parts in leaves.carry.items()}


def score_group(source: MemberReplay, group: GRPOGroup, *, schedule: Schedule | None = None,
                members: list | None = None) -> list[torch.Tensor]:
    """Log-probs of the members' responses (default all; members: as replay_group's) WITHOUT a graph (reference
    scoring), float64 on the CPU."""
    schedule = schedule or Schedule()
    scores = []
    with torch.no_grad():
        for slot, member in enumerate(range(group.size) if members is None else members):
            inputs, targets = member_inputs(group, member)
            real = targets.numel()
            inputs, targets = schedule.pad_member(slot, inputs, targets)
            scores.append(replay_member(source, inputs, targets)[:real].double().cpu())
        schedule.replay_dummy_members(source, train=False)
    return scores
