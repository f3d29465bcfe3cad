"""A member whose long untrained spans (tool outputs, observations: response_masks False) are captured rather than
kept as graph.

Replay keeps the graph of a member's whole response (replay.replay_member), so an agent's tool outputs cost what
conventional training costs. Where an untrained span of a member reaches longstraw.member_span_capture tokens, the
member runs in steps instead (member_steps): each region between captured spans (the actions, with any short
untrained span) one step, each captured span cut into steps as long as the longest region (at least
offload/plan.MIN_CAPTURED_STEP, at most replay_block tokens), and

  1. a forward without a graph over the whole response, step by step: each step's rows (the keys its later tokens
     read) and the carry at its start kept, detached; the log-probs (and entropies) of the regions recorded;
  2. d(loss)/d(log-probs) from the objective on those values, then the steps last to first, each recomputed with
     autograd from its start carry over the prefix and the earlier steps' rows (leaves): its log-probs get
     d(loss)/d(log-probs), its rows the gradient the later steps left on them, its end carry d(carry) from the
     step after it; one backward each. The first step starts from the prefix's leaves, so d(carry after the
     prompt) and, in exact mode, the prompt pages' gradients collect where a whole member's replay puts them.

The gradient is the whole member's (the same function, differentiated in pieces): a member's own context is exact
in both modes. Memory: one step's graph plus the member's rows, their gradients and each step's start carry, flat
in the span's length, instead of the whole response's graph; those are kept in one buffer per stream for the
whole member (member_buffers.py), not one host allocation per block, which broke up the heap. A later step's
attention adds d(rows) to each earlier block's gradient in place, one key block at a time, through the block's
sink (RowLeaves), instead of returning every earlier block's dK/dV at once through autograd. Time: the response
runs forward twice (the captured spans' steps skip the vocabulary projection both times).

Under a lockstep that pads module calls across ranks (ZeRO-3 through the engine, the spread CP replay) the ranks
agree per member slot (lockstep.GroupCalls.stepped): where any rank's member of a slot runs in steps, every rank
runs that slot in steps of one replay block each over the padded length, every step scored, so that they make the
same calls; the others are replayed whole (lockstep.Lockstep.member_steps, replay.replay_group).

The earlier steps' rows stay one segment per replay block in a step's past. Tried: joined into one leaf per row
tensor, read as one segment, the replay peak was 1.25x L = 0's plus the tool pages at 16,384 tool tokens and 2.85x
at 65,536 (the attention over that segment is one call over every earlier key, whose work grows with them; per
block, each call stays a block's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ds_longstraw.arch.base import inject_gradients
from ds_longstraw.grpo.member_buffers import MemberBuffers
from ds_longstraw.grpo.memory import return_freed_host_memory

# How long a captured span's steps are: the planner sizes them by the same rule (offload/plan.member_replay)
from ds_longstraw.offload.plan import captured_step
from ds_longstraw.offload.staged_past import PagesPair

if TYPE_CHECKING:
    from collections.abc import Callable

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.grpo.interfaces import RemoteAttention, RemoteSelection


class MemberReplay(Protocol):
    """What a stepped member reads (replay.MemberReplay: replay names this module, not the other way round)."""

    adapter: CausalLMAdapter
    leaves: Any  # replay.PrefixLeaves: carry, past (StagedPast or ResponsePast: layer -> segments, fresh, append)
    start: int
    block: int
    remote_attention: RemoteAttention | RemoteSelection | None


class KeptSteps(Protocol):
    """What pass 1 reads of steps kept elsewhere (kept_spans.KeptSpans: it names this module, not the other way)."""

    carries: dict  # input position -> the carry there

    def covers(self, step: Step) -> bool: ...

    def rows(self, first: int, end: int) -> dict: ...


@dataclass(frozen=True)
class Step:
    start: int  # input positions [start, end) of the member's response
    end: int
    scored: bool  # whether its targets' log-probs are computed (False: a captured span's, untrained)
    # inside the member's held prefix (GRPOGroup.held_prefixes): its rows and end carry are constants to the steps
    # after it, and it has no reverse pass of its own (a lockstep's, scored, runs one of zero gradient for the calls)
    held: bool = False


def member_steps(mask: torch.Tensor, threshold: int | None, block: int, held: int = 0) -> list[Step] | None:
    """The steps of a member whose targets' training mask is `mask` (True: in the loss), or None where no
    untrained run reaches `threshold` tokens (None: never) and the member is replayed whole. Each region between
    captured runs is one scored step (a short untrained run stays in its region); a captured run is cut into steps
    as long as the longest region, at least MIN_CAPTURED_STEP and at most `block` (replay_block) tokens: the
    member's graph is then its longest region's, what its replay without the span would keep. held: the member's
    leading tokens held constant (GRPOGroup.held_prefixes), always a captured run of their own, whatever their
    length, whose steps are `held`."""
    if held:
        return _with_held(mask, threshold, block, held)
    if threshold is None:
        return None
    values = mask.tolist()
    runs, start = [], 0  # (start, end, trained) maximal runs
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[start]:
            runs.append((start, index, values[start]))
            start = index
    captured = [(a, b) for a, b, trained in runs if not trained and b - a >= threshold]
    if not captured:
        return None
    regions, position = [], 0
    for a, b in captured:
        if a > position:
            regions.append((position, a))
        position = b
    if position < len(values):
        regions.append((position, len(values)))
    size = captured_step(max((b - a for a, b in regions), default=0), block)
    steps, position = [], 0
    for a, b in captured:
        if a > position:
            steps.append(Step(position, a, True))
        steps += [Step(s, min(b, s + size), False) for s in range(a, b, size)]
        position = b
    if position < len(values):
        steps.append(Step(position, len(values), True))
    return steps


def _with_held(mask: torch.Tensor, threshold: int | None, block: int, held: int) -> list[Step]:
    """member_steps of a member whose first `held` tokens are held: those in steps of `block` tokens, then the
    rest's own steps (one scored step where it has no captured run)."""
    steps = [Step(s, min(held, s + block), False, held=True) for s in range(0, held, block)]
    if held == mask.numel():
        return steps
    rest = member_steps(mask[held:], threshold, block) or [Step(0, mask.numel() - held, True)]
    return steps + [Step(held + step.start, held + step.end, step.scored) for step in rest]


def replay_in_steps(source: MemberReplay, steps: list[Step], inputs: torch.Tensor, targets: torch.Tensor,
                    share_of: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], with_entropy: bool,
                    backward: Callable | None = None, kept: KeptSteps | None = None,
                    buffered: bool = True) -> tuple[float, torch.Tensor]:
    """The member's loss share (a float) and its log-probs (detached; 0 at captured positions, which no loss reads),
    its gradients accumulated as a whole replay's would be (module docstring). share_of(log-probs, entropies or
    None): the member's share of the loss from every target's values. kept: what generate kept of the member's
    observations (grpo/kept_spans.py): pass 1 takes the captured steps it covers from there instead of running
    them. buffered: keep the rows, carries and row gradients in one buffer per stream (member_buffers.py); False,
    the plain form, keeps each as it came."""
    buffers = MemberBuffers(steps[0].start, steps[-1].end, len(steps)) if buffered else None
    with torch.no_grad():
        recorded, logp, entropy = _forward(source, steps, inputs, targets, with_entropy, kept, buffers)
    # d(loss)/d(log-probs) (and entropies) on the recorded values: the objective is any function of them
    logp_leaf = logp.requires_grad_(True)
    entropy_leaf = None if entropy is None else entropy.requires_grad_(True)
    with torch.enable_grad():
        share = share_of(logp_leaf, entropy_leaf)
        wrt = [t for t in (logp_leaf, entropy_leaf) if t is not None]
        grads = torch.autograd.grad(share, wrt, allow_unused=True) if share.requires_grad else [None] * len(wrt)
    d_logp, d_entropy = (list(grads) + [None])[:2]
    _reverse(source, steps, inputs, targets, recorded, (d_logp, d_entropy), backward)
    return float(share.detach()), logp.detach()


@dataclass
class Recorded:
    """What pass 1 keeps for pass 2: per step, its rows (layer -> its blocks' row tuples, token-major) and the
    carry at its start (layer -> tensors), detached; the buffers they are views of (None: kept as they came)."""

    rows: list[dict]
    carries: list[dict]
    buffers: MemberBuffers | None = None


def _forward(source: MemberReplay, steps: list[Step], inputs: torch.Tensor, targets: torch.Tensor,
             with_entropy: bool, kept: KeptSteps | None = None,
             buffers: MemberBuffers | None = None) -> tuple[Recorded, torch.Tensor, torch.Tensor | None]:
    """Pass 1, no graph: what pass 2 reads, and the scored log-probs (and entropies) of every target; a captured
    step `kept` covers is taken from it (its rows, the carry at its end), not run. What this pass computes is kept
    in `buffers` where given (what `kept` holds already lives there)."""
    adapter, leaves = source.adapter, source.leaves
    carry = {layer: tuple(t.detach() for t in parts) for layer, parts in leaves.carry.items()}
    past = leaves.past.fresh()
    rows, carries = [], []
    logp = torch.zeros(targets.numel(), dtype=torch.float32, device=adapter.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    computed = False  # whether `carry` was computed here (the prefix's and kept ones live elsewhere already)
    for index, step in enumerate(steps):
        carries.append(buffers.keep_carry(index, carry) if computed and buffers is not None else carry)
        computed = True
        if kept is not None and kept.covers(step):
            out_rows = _kept_blocks(kept, step, source.block)
            for layer, blocks in out_rows.items():
                for parts in blocks:
                    past.append(layer, parts)
            rows.append(out_rows)
            carry = dict(kept.carries[step.end])
            computed = False
            continue
        out_rows, carry, scores = _run_step(source, step, inputs, targets, carry, past, with_entropy, buffers)
        rows.append(out_rows)
        if step.scored:
            step_logp, step_entropy = scores
            logp = logp.to(step_logp.dtype)
            logp[step.start:step.end] = step_logp
            if entropy is not None:
                entropy = entropy.to(step_entropy.dtype)
                entropy[step.start:step.end] = step_entropy
    return Recorded(rows, carries, buffers), logp, entropy


def _kept_blocks(kept: KeptSteps, step: Step, block: int) -> dict:
    """A kept step's rows by layer, cut into the replay blocks _run_step would make (pass 2 pairs them up)."""
    rows = kept.rows(step.start, step.end)
    return {layer: [tuple(part[offset: offset + block] for part in parts)
                    for offset in range(0, step.end - step.start, block)] for layer, parts in rows.items()}


def _run_step(source: MemberReplay, step: Step, inputs: torch.Tensor, targets: torch.Tensor, carry: dict,
              past: Any, with_entropy: bool, buffers: MemberBuffers | None = None) -> tuple[dict, dict, tuple | None]:
    """One step a replay block at a time over `past` (a fresh copy of the leaves' past: the prefix and the earlier
    steps' rows), to which its blocks' rows are appended as they come: (its rows by layer, a tuple of token-major
    tensors per block, the very tensors appended: copied into `buffers` first where given; its end carry;
    (log-probs, entropies or None) where it is scored)."""
    adapter, block = source.adapter, source.block
    carry = dict(carry)
    blocks, logps, entropies = {}, [], []
    # a captured span's step scores nothing: its last layer computes only its rows and carry, which is all its later
    # tokens read (under context parallelism the whole layer, whose exchanges the other ranks serve)
    need_hidden = step.scored or source.remote_attention is not None
    for offset in range(step.start, step.end, block):
        end = min(step.end, offset + block)
        out = adapter.forward_segment(inputs[offset:end], source.start + offset, carry, past, source.remote_attention,
                                      need_hidden=need_hidden)
        carry = dict(out.carry)
        for layer, parts in out.rows.items():
            if buffers is not None:
                parts = buffers.keep_row(layer, offset, parts)
            past.append(layer, parts)
            blocks.setdefault(layer, []).append(parts)
        if step.scored:
            result = adapter.logprobs(out.hidden, targets[offset:end], with_entropy=with_entropy)
            logps.append(result[0] if with_entropy else result)
            if with_entropy:
                entropies.append(result[1])
    scores = (torch.cat(logps), torch.cat(entropies) if with_entropy else None) if step.scored else None
    return blocks, carry, scores


def _reverse(source: MemberReplay, steps: list[Step], inputs: torch.Tensor, targets: torch.Tensor,
             recorded: Recorded, d_scores: tuple, backward: Callable | None) -> None:
    """Pass 2: the steps last to first, each with autograd, its outputs given their gradients (module docstring).
    A held step's rows and end carry are constants to the steps after it; it runs no reverse pass, or, where a
    lockstep scores it (the other ranks' step of the slot may be trained), one of zero gradient, for the calls."""
    leaves, carries = source.leaves, recorded.carries
    d_logp, d_entropy = d_scores
    # every step's rows as leaves (a held step's as constants): what the later steps' backward leaves on them is
    # the step's d(rows)
    buffers, block = recorded.buffers, source.block
    row_leaves = [{layer: [parts if step.held else
                           RowLeaves(parts, None if buffers is None else _grad_views(buffers, layer, first))
                           for first, parts in zip(range(step.start, step.end, block), blocks, strict=True)]
                   for layer, blocks in rows.items()}
                  for step, rows in zip(steps, recorded.rows, strict=True)]
    recorded.rows = []
    d_carry = None  # d(end carry) of the step in turn, from the step after it
    for index in reversed(range(len(steps))):
        step = steps[index]
        if step.held and not step.scored:
            row_leaves[index] = {}
            continue
        constant_start = step.held or (index > 0 and steps[index - 1].held)
        if constant_start:
            carry = {layer: tuple(t.detach() for t in parts) for layer, parts in carries[index].items()}
        elif index == 0:
            carry = dict(leaves.carry)  # the prefix's leaves (exact mode collects d(carry after the prompt) there)
        else:
            carry = {layer: tuple(t.detach().requires_grad_(True) for t in parts)
                     for layer, parts in carries[index].items()}
        past = leaves.past.fresh()
        for earlier in row_leaves[:index]:
            for layer, blocks in earlier.items():
                for leaves_of_block in blocks:
                    past.append(layer, leaves_of_block.pair if isinstance(leaves_of_block, RowLeaves)
                                else leaves_of_block)
        with torch.enable_grad(), leaves.saves():
            out_rows, end_carry, scores = _run_step(source, step, inputs, targets, carry, past, d_entropy is not None)
            outputs, grads = [], []
            if scores is not None:
                outputs.append(scores[0])  # a gradient of None is zeros (inject_gradients), as a held step's are
                grads.append(None if step.held or d_logp is None else d_logp[step.start:step.end])
                if scores[1] is not None:
                    outputs.append(scores[1])
                    grads.append(None if step.held else d_entropy[step.start:step.end])
            # a held step's outputs are roots too, of zero gradient: the same roots as a trained step's, so that
            # ranks in lockstep walk the same modules backward (arch/base.inject_gradients)
            for layer, blocks in out_rows.items():
                for parts, leaves_of_block in zip(blocks, row_leaves[index][layer], strict=True):
                    outputs += parts
                    grads += [None] * len(parts) if step.held else leaves_of_block.grads()
            if index < len(steps) - 1:
                for layer, parts in end_carry.items():
                    outputs += parts
                    grads += [None] * len(parts) if d_carry is None else list(d_carry[layer])
            inject_gradients(outputs, grads, backward)
        d_carry = None if index == 0 or constant_start else {
            layer: tuple(t.grad for t in parts) for layer, parts in carry.items()}
        row_leaves[index] = {}  # its gradient is spent
        del out_rows, end_carry, scores, outputs, grads, carry, past
        return_freed_host_memory(source.adapter.device)


def _grad_views(buffers: MemberBuffers, layer: int, first: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """RowLeaves' grad_of for the block of `layer` whose first input is `first`: its rows' zeroed views in the
    member's buffers."""
    return lambda part, like: buffers.row_grad(layer, part, first, like)


class RowLeaves:
    """An earlier step block's rows as leaves, read by the later steps' attention: its pair (a PagesPair) carries a
    sink that an attention kernel taking it (kernels.attention_with_past's sinks) adds d(rows) to one key block at
    a time, in place, instead of returning every earlier block's dK/dV at once through autograd (what the kernel
    does not take, say a layer whose attention reads no sink, lands on the leaves' .grad as before). grad_of(part,
    like): the zeroed tensor part `part`'s d(rows) sums into (member_buffers.py); None: a zeros_like of the leaf."""

    def __init__(self, parts: tuple, grad_of: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> None:
        leaves = tuple(t.detach().requires_grad_(True) for t in parts)
        summed: list[torch.Tensor | None] = [None] * len(parts)

        # A closure over the leaves and the sums, not a bound method: the pair holds the sink, and a sink holding
        # this object would make a reference cycle that keeps every block's rows and gradients alive until the
        # garbage collector runs (measured: the rows of every earlier member still held by the next one).
        def sink(offset: int, *grads_KTD: torch.Tensor) -> None:
            for index, grad_KTD in enumerate(grads_KTD):
                rows = grad_KTD.transpose(0, 1)
                if summed[index] is None:
                    like = leaves[index]
                    summed[index] = torch.zeros_like(like) if grad_of is None else grad_of(index, like)
                summed[index][offset:offset + rows.shape[0]] += rows

        self.leaves, self.summed, self.pair = leaves, summed, PagesPair(leaves, sink)

    def grads(self) -> list[torch.Tensor | None]:
        """d(rows) per part: what the sink summed and what autograd left on the leaf."""
        out = []
        for leaf, summed in zip(self.leaves, self.summed, strict=True):
            if leaf.grad is None:
                out.append(summed)
            elif summed is None:
                out.append(leaf.grad)
            else:
                out.append(leaf.grad + summed)
        return out
