"""Exact mode's reverse pass over the prompt's capture chunks.

After every member has replayed, the gradient pages hold d(loss)/d(rows) of every prompt token that replay read,
and the carry leaves hold d(loss)/d(final carry). Walking the chunks last to first, chunk c is recomputed WITH
autograd from its checkpointed boundary carry and the pages before it; the accumulated gradients of its outputs
(its rows of every stream that carries a gradient, its end carry) are injected; backward adds parameter gradients, adds
the gradients that land on earlier pages to their gradient pages, and yields d(boundary state), carried to chunk c-1.
The live graph is one chunk; every prompt token's contribution is counted once, as in full-sequence autograd.
Earlier pages are staged one layer at a time from the pool's tier (forward ascending, the backward re-stages
descending; ds_longstraw.offload.staged_past) and their gradients go straight to the gradient pages.
Where capture kept the graph of its first segments (longstraw.prefix_keep_graph: grpo/kept_graph.py), the walk
stops at them and ends with one backward of that graph, which runs no forward again.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch.specs import stream_names
from ds_longstraw.grpo.memory import return_freed_host_memory
from ds_longstraw.offload import Stager, node_past, staged_saves

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
    from typing import Any

    from ds_longstraw.arch.base import CausalLMAdapter, SegmentOutput
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.interfaces import RemoteAttention, RemoteSelection
    from ds_longstraw.offload import PagePool
    from ds_longstraw.offload.pages import ReadyRead
    from ds_longstraw.offload.tiered import TieredPagePool

    # state.py's PrefixState, ChunkBoundary and PendingReads, by name only: importing them here would close the
    # import cycle state -> lockstep -> prefix_pass -> state
    PrefixState = ChunkBoundary = PendingReads = Any


@dataclass
class ReversePass:
    """What exact mode's reverse pass over captured segments reads.

    ids: prompt[:-1] (a context-parallel rank: its own shard in local order, each chunk at the prompt position its
    boundary says); remote_attention: earlier keys on other ranks (ds_longstraw.parallel); past_start: the first
    local token of the pages a segment sees as its past (a context-parallel turn of a family whose past must be
    contiguous in positions: its piece's start; remote_attention the rest).
    backward: None (torch.autograd.backward of the outputs with the injected gradients), or a callable that takes
    one scalar (say DeepSpeed's engine.backward): it gets sum((output * grad).sum()), whose gradient with respect
    to each output is exactly the injected grad. prefix_recompute: recompute each layer in backward (one layer's
    graph alive instead of the segment's); longstraw.prefix_recompute_runs says where that is allowed. progress:
    called with each segment's tokens; timings: gets the seconds spent in the segments' forwards and in their
    backwards ("forward", "backward"; with `prefix_recompute`, the backward includes the layers' recompute).
    last_layer_whole: whether the segments run their last layer whole (None: the state's,
    PrefixState.last_layer_whole; a context-parallel turn decides as its capture did, cp/capture.last_layer_rows_only:
    a state it captured layer-major always has the last layer's pages)."""

    adapter: CausalLMAdapter
    state: PrefixState
    ids: torch.Tensor
    backward: Callable[[torch.Tensor], object] | None = None
    remote_attention: RemoteAttention | RemoteSelection | None = None
    prefix_recompute: bool = True
    past_start: int = 0
    progress: Callable[[int], object] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    last_layer_whole: bool | None = None

    @property
    def whole_last_layer(self) -> bool:
        """Whether the segments run their last layer whole (else its rows alone: no token reads its outputs)."""
        return self.state.last_layer_whole if self.last_layer_whole is None else self.last_layer_whole


def prefix_backward(reverse: ReversePass, d_final_carry: dict[int, tuple[torch.Tensor, ...]],
                    boundaries: Sequence[ChunkBoundary] | None = None) -> dict[int, tuple[torch.Tensor, ...]]:
    """The reverse pass over `boundaries` (None: all of the state's chunks; a context-parallel turn walks one
    piece's), last first, from d_final_carry (layer -> d(its carry) after them). Returns d(carry) at the start of
    the captured tokens (empty at the prompt start)."""
    state = reverse.state
    names = stream_names(reverse.adapter.specs, last_layer=reverse.whole_last_layer)
    stager = Stager(state.pool, names)
    # a tree's node (grpo/document.py): its segments attend its ancestors' pages too, whose gradients go to them
    ancestors = state.ancestor_stagers(names)
    kept = state.kept_graph if boundaries is None else None
    boundaries = list(reversed(state.boundaries if boundaries is None else boundaries))
    try:
        with closing(_segments_ahead(state, boundaries)) as segments:
            d_carry = _reverse_chunks(reverse, stager, ancestors, segments, d_final_carry)
        if kept is not None and kept.segments:
            # the segments capture kept with their graph (grpo/kept_graph.py), from the prompt start: one backward
            tokens = kept.tokens
            kept.backward(state.pool, d_carry, reverse.backward, reverse.timings)
            return_freed_host_memory(reverse.adapter.device)
            if reverse.progress is not None:
                reverse.progress(tokens)
            return {}
        return d_carry
    finally:
        for each in (stager, *(ancestor for ancestor, _ in ancestors)):
            each.close()


def _segments_ahead(state: PrefixState, boundaries: Sequence[ChunkBoundary]) -> Generator[
        tuple[ChunkBoundary, dict[int, tuple[torch.Tensor, ...]], dict[int, tuple[torch.Tensor, ...]] | None],
        None, None]:
    """(boundary, the carry checkpointed there, the attention kept from capture or None) of each segment, the
    next segment's reads issued before this one's are collected, so a slower tier's reads overlap the segment's
    compute. Closing the generator completes and drops reads still in flight (an error half-way)."""
    in_flight = []  # reads issued and not yet collected
    try:
        ahead = None
        for index, boundary in enumerate(boundaries):
            current = ahead or _begin_segment(state, boundary, in_flight)
            ahead = None
            if index + 1 < len(boundaries):
                ahead = _begin_segment(state, boundaries[index + 1], in_flight)
            carry, kept = (read.result() for read in current)
            for read in current:
                in_flight.remove(read)
            yield boundary, carry, kept
    finally:
        for read in in_flight:
            read.release()


def _begin_segment(state: PrefixState, boundary: ChunkBoundary, in_flight: list[ReadyRead | PendingReads]
                   ) -> tuple[ReadyRead | PendingReads, ReadyRead | PendingReads]:
    """Issue the reads of one segment's checkpointed carry and kept attention (each recorded in in_flight)."""
    carry = state.begin_carry(boundary)
    in_flight.append(carry)
    kept = state.begin_kept_attention(boundary.start, boundary.end)
    in_flight.append(kept)
    return carry, kept


def _reverse_chunks(reverse: ReversePass, stager: Stager, ancestors: Sequence[tuple[Stager, int]],
                    segments: Iterable[tuple[ChunkBoundary, dict[int, tuple[torch.Tensor, ...]],
                                             dict[int, tuple[torch.Tensor, ...]] | None]],
                    d_final_carry: dict[int, tuple[torch.Tensor, ...]]) -> dict[int, tuple[torch.Tensor, ...]]:
    """segments: (boundary, checkpointed carry, kept attention or None) of every segment, last first; ancestors:
    (stager, tokens) of a tree node's ancestors, whose pages its segments attend."""
    adapter, state, ids, backward, timings = reverse.adapter, reverse.state, reverse.ids, reverse.backward, \
        reverse.timings
    pool = state.pool
    timings.setdefault("forward", 0.0)
    timings.setdefault("backward", 0.0)
    d_carry = d_final_carry
    for boundary, checkpointed, kept in segments:
        start, end = boundary.start, boundary.end
        # the prompt start has no checkpoint: zeros there, nothing to carry further back
        carry = {layer: tuple(t.detach().requires_grad_(True) for t in parts)
                 for layer, parts in checkpointed.items()}
        past = node_past(ancestors, stager, start, grads_to_pages=True, past_start=reverse.past_start)
        with torch.enable_grad(), staged_saves(stager, *(ancestor for ancestor, _ in ancestors)):
            started = time.perf_counter()
            position = getattr(state, "offset", 0) + start if boundary.position is None else boundary.position
            out = adapter.forward_segment(ids[start:end], position, carry, past,
                                          reverse.remote_attention, prefix_recompute=reverse.prefix_recompute,
                                          known_attention=kept, need_hidden=reverse.whole_last_layer)
            outputs = segment_roots(adapter.specs, out)
            grads = [g.to(o) for o, g in zip(outputs, injected_grads(adapter.specs, d_carry, pool, start, end),
                                             strict=True)]
            # A frozen model part (say a LoRA policy whose adapters miss a layer) can leave an output graph-free.
            live = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
            forwarded = time.perf_counter()
            timings["forward"] += forwarded - started
            if live and backward is None:
                torch.autograd.backward([o for o, _ in live], [g for _, g in live])
            elif live:
                backward(sum((o * g.detach()).sum() for o, g in live))
            timings["backward"] += time.perf_counter() - forwarded
        d_carry = {layer: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in parts)
                   for layer, parts in carry.items()}
        del out, outputs, grads, live, kept, checkpointed
        return_freed_host_memory(adapter.device)
        if reverse.progress is not None:
            reverse.progress(end - start)
    return d_carry


def segment_roots(specs: Iterable[LayerState], out: SegmentOutput, carries: bool = True) -> list[torch.Tensor]:
    """The outputs of a segment that later tokens read, in a fixed order: each layer's end carry (unless `carries`
    is False: a kept segment whose carry the next one reads inside the same graph, grpo/kept_graph.py), then its
    rows of every stream that carries a gradient."""
    outputs = []
    for spec in specs:
        if spec.carry and carries:
            outputs += list(out.carry[spec.layer])
        for stream, rows in zip(spec.streams, out.rows.get(spec.layer, ()), strict=True):
            if stream.grad:
                outputs.append(rows)
    return outputs


def injected_grads(specs: Iterable[LayerState], d_carry: Mapping[int, Sequence[torch.Tensor]],
                   pool: PagePool | TieredPagePool, start: int, end: int, carries: bool = True) -> list[torch.Tensor]:
    """The accumulated gradients of segment_roots' outputs (with the same `carries`): d(end carry) from the later
    segment (or replay), and the gradient pages of the segment's rows."""
    grads = []
    for spec in specs:
        if spec.carry and carries:
            grads += list(d_carry[spec.layer])
        for stream in spec.streams:
            if stream.grad:
                grads.append(pool.read_grad(spec.layer, stream.name, start, end))
    return grads
