"""The retained state of a captured prompt, and the capture that fills it.

Capture runs prompt[:-1] through the model chunk by chunk WITHOUT autograd and keeps only what later tokens
read, as the adapter's layer-state specs (arch/specs.py) declare: each layer's per-token streams on owned pages,
each layer's per-sequence carry. In exact mode it also checkpoints the carry at every chunk start (on the pages'
tier), so the prefix pass can recompute one chunk at a time, and with prefix_keep_attention keeps each layer's
`kept` streams (its attention output and log-sum-exp) so that recompute skips the prompt's attention. With a graph
budget (exact mode, a root capture: prefix_keep_graph) its first segments run WITH autograd and keep their graph
instead (kept_graph.py); the checkpoints and kept streams then start where they end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch.specs import stream_names
from ds_longstraw.grpo.kept_graph import KeptGraph
from ds_longstraw.grpo.lockstep import ceil_div
from ds_longstraw.grpo.memory import return_freed_host_memory
from ds_longstraw.offload import PagePool, Stager, make_pool, node_past
from ds_longstraw.offload.auto import keeps_attention
from ds_longstraw.offload.pages import ReadyRead

if TYPE_CHECKING:
    from collections.abc import Callable, Container, Iterable, Mapping, Sequence
    from typing import Any

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.offload.tiered import ReadTicket, TieredPagePool


@dataclass
class ChunkBoundary:
    start: int
    end: int
    carry: dict  # layer -> its carry at `start` (views or checkpoint slots; absent at the prompt start)
    position: int | None = None  # the prompt position of local token `start` (None: the state's offset + start)


@dataclass
class PrefixState:
    length: int  # captured tokens: len(prompt) - 1
    pool: PagePool  # the streams of every paged layer
    specs: list  # the adapter's layer-state specs (arch/specs.py)
    carry: dict = field(default_factory=dict)  # layer -> its carry (tuple of tensors) after the prefix
    boundaries: list = field(default_factory=list)  # exact mode only
    offset: int = 0  # prompt position of this rank's first captured token (context parallelism; else 0)
    # exact mode with prefix_keep_attention: the pool of every layer's kept streams (`pool`, or a pool of
    # offload.kept_attention_tier); None when the attention is not kept
    kept_pool: PagePool | None = None
    # exact mode: the store of the carry checkpoints (CarryCheckpoints on the device, PooledCarryCheckpoints on
    # offload.tier); None in detached mode
    checkpoints: CarryCheckpoints | PooledCarryCheckpoints | None = None
    # exact mode's layer-major prefix pass under context parallelism (grpo/cp/prefix_layers.py): every layer's
    # input hidden states over this rank's shard, on a pool of offload.tier (stream INPUT_STREAM); None otherwise
    input_pool: PagePool | None = None
    # a tree's child (grpo/document.py): the capture whose tokens precede this one's (its pages are this one's
    # past, its final carry this one's first); None for a root. A child's offset is where its parent ends.
    parent: PrefixState | None = None
    # generate's kept capture of a multi-turn rollout: per sample, what its observations' forwards left
    # (grpo/kept_spans.KeptSpans: their rows and carries), which the members' first pass takes; None otherwise
    kept_spans: list | None = None
    # exact mode's capture with prefix_keep_graph: the segments it ran with autograd and keeps, from the prompt
    # start (grpo/kept_graph.KeptGraph; the prefix pass back-propagates them last, and `boundaries` holds only the
    # segments after them); None otherwise
    kept_graph: KeptGraph | None = None
    # whether this state's capture and prefix pass run the last layer whole (context parallelism's), or only what
    # later tokens read of it, its rows and carry (False: one rank, capture_prefix; forward_segment's need_hidden).
    # No token reads a captured segment's hidden states (the prompt's last token is replayed with the members), so
    # the last layer's queries, attention and MLP over the prompt feed nothing, and none of its attention is kept.
    last_layer_whole: bool = True

    @property
    def kept_from(self) -> int:
        """The first captured token of the kept attention's pages: the kept graph's segments keep none."""
        return 0 if self.kept_graph is None else self.kept_graph.tokens

    def lineage(self) -> list[PrefixState]:
        """The root first, ..., this state: whose pages a token after this capture sees, in position order."""
        return ([] if self.parent is None else self.parent.lineage()) + [self]

    def ancestor_stagers(self, names: Mapping[int, Sequence[str]], wrap: bool = False) -> list[tuple[Stager, int]]:
        """(a stager of its pages, its tokens) of each ancestor, root first (none for a root): what
        offload.node_past reads before this state's own pages. The caller closes the stagers."""
        return [(Stager(node.pool, names, wrap=wrap), node.length) for node in self.lineage()[:-1]]

    def retained_bytes(self) -> dict:
        """Bytes kept for later tokens, by the specs' labels, plus exact mode's carry checkpoints and kept
        attention ("carry_checkpoints", "kept_attention_pages")."""
        out = {}
        by_stream = self.pool.bytes_by_stream()
        for spec in self.specs:
            for stream in spec.streams:
                label = spec.stream_label(stream)
                out[label] = out.get(label, 0) + by_stream.get((spec.layer, stream.name), 0)
            if spec.carry:
                carried = sum(t.numel() * t.element_size() for t in self.carry.get(spec.layer, ()))
                out[spec.label] = out.get(spec.label, 0) + carried
        out["carry_checkpoints"] = 0 if self.checkpoints is None else self.checkpoints.nbytes()
        kept = 0
        if self.kept_pool is not None:
            kept_by_stream = self.kept_pool.bytes_by_stream()
            kept = sum(kept_by_stream.get((spec.layer, s.name), 0) for spec in self.kept_specs() for s in spec.kept)
        out["kept_attention_pages"] = kept
        if self.input_pool is not None:
            out["layer_inputs"] = sum(self.input_pool.bytes_by_stream().values())
        return out

    def read_layer_input(self, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Layer `layer`'s input hidden states over captured tokens [start, end), [1, T, C] (the layer-major prefix
        pass)."""
        return self.input_pool.read(layer, INPUT_STREAM, start, end).unsqueeze(0)

    def read_selection(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection (positions, valid) [T, topk] that base layer `layer` reuses, kept with its input."""
        return decode_selection(self.input_pool.read(layer, SELECTION_STREAM))

    def kept_specs(self) -> list[LayerState]:
        """The specs of the layers whose attention capture keeps for the prefix pass (prefix_keep_attention), where
        it keeps any: every layer with kept streams, but the last one where it runs only its rows."""
        return kept_specs(self.specs, self.last_layer_whole)

    def begin_kept_attention(self, start: int, end: int) -> ReadyRead | PendingReads:
        """Issue the reads of tokens [start, end) of the attention kept from capture (issued a segment ahead, the
        reads of a slower tier overlap the prefix pass's compute); result(): layer -> its kept tensors, each
        head-major ([H, T, ...]), or None when none was kept."""
        if self.kept_pool is None:
            return ReadyRead(None)
        kept = {spec.layer: spec.kept for spec in self.kept_specs()}
        start, end = start - self.kept_from, end - self.kept_from
        tickets = {(layer, s.name): self.kept_pool.begin_read(layer, s.name, start, end)
                   for layer, streams in kept.items() for s in streams}
        return PendingReads(tickets, lambda got: {
            layer: tuple(got[(layer, s.name)].transpose(0, 1).contiguous() for s in streams)
            for layer, streams in kept.items()})

    def begin_carry(self, boundary: ChunkBoundary, layers: Container[int] | None = None) -> ReadyRead | PendingReads:
        """Issue the read of the carry checkpointed at `boundary` (one of self.boundaries), of every layer or of
        `layers` only; result(): layer -> its carry, absent for a layer that starts from zeros there (the prompt
        start)."""
        return self.checkpoints.begin_load(boundary, layers)

    def _other_pools(self) -> list:
        """The pools besides the main one that this state holds (the kept-attention pool when it is its own)."""
        kept = self.kept_pool if self.kept_pool is not self.pool else None
        return [p for p in (kept, self.checkpoints, self.input_pool) if p is not None]

    def flush(self) -> None:
        """Write back what capture left in partial pages: afterwards every page is on its tier."""
        for pool in [self.pool, *self._other_pools()]:
            pool.flush()

    def release(self) -> None:
        """Drop every page and checkpoint (page files of a host/NVMe tier go, on error as on success)."""
        for pool in [*self._other_pools(), self.pool]:
            pool.release()
        if self.kept_graph is not None:
            self.kept_graph.release()
        self.carry.clear()
        self.boundaries.clear()
        self.kept_spans = None


class PendingReads:
    """Reads issued together: tickets by key. result() waits for every one and hands {key: tensor} to `assemble`;
    release() completes and drops the reads not collected (an error before result())."""

    def __init__(self, tickets: Mapping[Any, ReadTicket | ReadyRead],
                 assemble: Callable[[dict[Any, torch.Tensor]], dict[int, tuple[torch.Tensor, ...]]]) -> None:
        self.tickets, self.assemble = tickets, assemble

    def result(self) -> dict[int, tuple[torch.Tensor, ...]]:
        try:
            return self.assemble({key: ticket.result() for key, ticket in self.tickets.items()})
        finally:
            self.release()

    def release(self) -> None:
        for ticket in self.tickets.values():
            ticket.release()


def kept_specs(specs: Sequence[LayerState], last_layer_whole: bool) -> list[LayerState]:
    """The specs with kept streams, without the last layer's where it runs only its rows (PrefixState)."""
    return [spec for spec in specs if spec.kept and (last_layer_whole or spec is not specs[-1])]


def open_kept_pool(adapter: CausalLMAdapter, longstraw: LongstrawConfig, pool: PagePool | TieredPagePool, length: int,
                   rank: int = 0, last_layer_whole: bool = True) -> PagePool | TieredPagePool:
    """The pool that keeps `length` tokens of the kept layers' `kept` streams (exact mode's prefix_keep_attention;
    kept_specs): `pool` itself, or one of offload.kept_attention_tier, with the streams reserved."""
    own = longstraw.offload.kept_attention_pool()
    # A pool of its own holds one prefix-pass segment a page: the prefix pass reads whole segments.
    kept_pool = pool if own is None else make_pool(own, longstraw.segment_tokens, adapter.device, rank)
    try:
        for spec in kept_specs(adapter.specs, last_layer_whole):
            for stream in spec.kept:
                kept_pool.reserve(spec.layer, stream.name, length, stream.shape, stream.dtype)
    except BaseException:
        if kept_pool is not pool:
            kept_pool.release()
        raise
    return kept_pool


def keep_segment_attention(kept_pool: PagePool | TieredPagePool, spec: LayerState,
                           result: Sequence[torch.Tensor]) -> None:
    """Append one segment's kept tensors of layer `spec.layer` (head-major [H, T, ...], as attention returns
    them) as the next tokens of its kept streams."""
    for stream, tensor in zip(spec.kept, result, strict=True):
        kept_pool.append(spec.layer, stream.name, tensor.transpose(0, 1))


def append_rows(pool: PagePool | TieredPagePool, spec: LayerState, rows: Sequence[torch.Tensor]) -> None:
    """Append one segment's rows of layer `spec.layer` (token-major, in the order of spec.streams)."""
    for stream, tensor in zip(spec.streams, rows, strict=True):
        pool.append(spec.layer, stream.name, tensor)


def _detached_carry(carry: Mapping[int, Iterable[torch.Tensor]]) -> dict[int, tuple[torch.Tensor, ...]]:
    return {layer: tuple(t.detach() for t in parts) for layer, parts in carry.items()}


class _CheckpointStore:
    def save(self, index: int,
             carry: Mapping[int, Sequence[torch.Tensor]]) -> dict[int, tuple[torch.Tensor, ...] | int]:
        """Checkpoint the carry (layer -> tuple of tensors) at the start of segment `index`; returns what the
        segment's boundary holds (layer -> views into the store, or slots of the pool)."""
        return {layer: self.save_layer(index, layer, parts) for layer, parts in carry.items()}


class CarryCheckpoints(_CheckpointStore):
    """Exact mode's carry checkpoints on the compute device, one slot per segment start, in storage allocated
    once per layer (offload.tier "none").

    Why not one small tensor per checkpoint: allocated between a segment's large temporaries, hundreds of live
    16 KB tensors pin the allocator's heap, and what the temporaries free is never returned (measured at 32K
    tokens, 256-token segments: 141 MiB of resident memory held by 15 MiB of checkpoints)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._store = {}  # layer -> tuple of [slots, ...] tensors, one per carry part
        self._saved_bytes = 0  # of the checkpoints written (slots of the prompt start stay unused)

    def save_layer(self, index: int, layer: int, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if layer not in self._store:  # shapes are known once the layer has run
            self._store[layer] = tuple(t.new_empty((self.slots, *t.shape)) for t in parts)
        stores = self._store[layer]
        for store, tensor in zip(stores, parts, strict=True):
            store[index].copy_(tensor)
            self._saved_bytes += tensor.numel() * tensor.element_size()
        return tuple(store[index] for store in stores)

    def flush(self) -> None:
        """Nothing to write back: the store is on the device."""

    def begin_load(self, boundary: ChunkBoundary, layers: Container[int] | None = None) -> ReadyRead:
        # views into the store: complete at once
        return ReadyRead({layer: parts for layer, parts in boundary.carry.items() if layers is None or layer in layers})

    def nbytes(self) -> int:
        return self._saved_bytes

    def release(self) -> None:
        self._store.clear()


class PooledCarryCheckpoints(_CheckpointStore):
    """Exact mode's carry checkpoints on a page pool of offload.tier (host memory, or NVMe files through async
    I/O), one checkpoint a page: written once by capture, read once by the prefix pass, a segment ahead of use.

    Each is the model's whole carry (about 150 MB at Qwen3.6-27B width): kept on the device, the 64 segments of a
    256K-token shard would hold 9.6 GB. A layer's checkpoints are the consecutive slots of its streams (one per
    carry part), from its first checkpointed segment on (segment 0, or 1 where the prompt starts from zeros)."""

    PREFIX = "carry_checkpoint_"

    def __init__(self, pool: PagePool | TieredPagePool, slots: int) -> None:
        self.pool, self.slots = pool, slots
        self._first = {}  # layer -> its first checkpointed segment
        self._next = {}  # layer -> the segment whose checkpoint it writes next
        self._parts = {}  # layer -> number of carry parts

    def _name(self, part: int) -> str:
        return f"{self.PREFIX}{part}"

    def save_layer(self, index: int, layer: int, parts: Sequence[torch.Tensor]) -> int:
        """Append segment `index`'s carry of `layer`; returns the slot it went to (what boundaries hold)."""
        if layer not in self._first:  # shapes are known once the layer has run
            for part, tensor in enumerate(parts):
                self.pool.reserve(layer, self._name(part), self.slots - index, tuple(tensor.shape), tensor.dtype)
            self._first[layer] = self._next[layer] = index
            self._parts[layer] = len(parts)
        if index != self._next[layer]:
            raise RuntimeError(f"layer {layer}: carry checkpoint of segment {index} written out of order "
                               f"(expected {self._next[layer]})")
        for part, tensor in enumerate(parts):
            self.pool.append(layer, self._name(part), tensor.unsqueeze(0))
        self._next[layer] = index + 1
        return index - self._first[layer]

    def flush(self) -> None:
        self.pool.flush()

    def begin_load(self, boundary: ChunkBoundary, layers: Container[int] | None = None) -> PendingReads:
        slots = {layer: slot for layer, slot in boundary.carry.items()  # layer -> its slot
                 if layers is None or layer in layers}
        tickets = {(layer, part): self.pool.begin_read(layer, self._name(part), slot, slot + 1)
                   for layer, slot in slots.items() for part in range(self._parts[layer])}
        return PendingReads(tickets, lambda got: {
            layer: tuple(got[(layer, part)][0] for part in range(self._parts[layer])) for layer in slots})

    def nbytes(self) -> int:
        return sum(size for (_, name), size in self.pool.bytes_by_stream().items() if name.startswith(self.PREFIX))

    def release(self) -> None:
        self.pool.release()


def open_checkpoints(longstraw: LongstrawConfig, slots: int, device: torch.device,
                     rank: int = 0) -> CarryCheckpoints | PooledCarryCheckpoints:
    """The store of exact mode's carry checkpoints: on the device (offload.tier "none") or on a pool of the
    pages' tier with one checkpoint a page."""
    if longstraw.offload.tier == "none":
        return CarryCheckpoints(slots)
    return PooledCarryCheckpoints(make_pool(longstraw.offload, 1, device, rank), slots)


INPUT_STREAM = "layer_input"
SELECTION_STREAM = "selection_in"  # the top-k selection a group's base layer reuses (int32 positions, -1: none)


def selection_bases(specs: Iterable[LayerState], every: int) -> list[int]:
    """The layers whose input the layer-major pass keeps (0, every, 2 every, ...) that reuse a selection ("topk_lse"
    layers that select nothing) made by a layer whose input it does not keep: that selection is kept with their
    input (the pass cannot remake it from the layer's input)."""
    source, bases = None, []
    for spec in specs:
        if spec.layer % every == 0 and spec.reuses_selection and source is not None \
                and source % every:
            bases.append(spec.layer)
        if spec.select:
            source = spec.layer
    return bases


def encode_selection(positions: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """(positions, valid) [T, K] -> int32 [T, width]: the position where valid, -1 elsewhere and beyond K."""
    encoded = torch.where(valid, positions, torch.full_like(positions, -1)).to(torch.int32)
    return torch.nn.functional.pad(encoded, (0, width - encoded.shape[1]), value=-1)


def decode_selection(encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    valid = encoded >= 0
    return torch.where(valid, encoded.long(), torch.zeros_like(encoded, dtype=torch.long)), valid


def open_input_pool(longstraw: LongstrawConfig, hidden_size: int, dtype: torch.dtype, layers: Iterable[int],
                    tokens: int, device: torch.device, rank: int = 0,
                    selections: Mapping[int, int] | None = None) -> PagePool | TieredPagePool:
    """The pool of every layer's input hidden states [tokens, hidden_size] (the layer-major prefix pass), on
    offload.tier, its streams reserved; selections: {layer: topk} of the bases that keep the selection they reuse
    (selection_bases)."""
    pool = make_pool(longstraw.offload, longstraw.page_tokens, device, rank)
    try:
        for layer in layers:
            pool.reserve(layer, INPUT_STREAM, tokens, (hidden_size,), dtype)
        for layer, topk in (selections or {}).items():
            pool.reserve(layer, SELECTION_STREAM, tokens, (topk,), torch.int32)
    except BaseException:
        pool.release()
        raise
    return pool


def keeps_kept_streams(adapter: CausalLMAdapter, longstraw: LongstrawConfig, prefix_grad: str) -> bool:
    """longstraw.prefix_keep_attention resolved for this model (offload/auto.keeps_attention): whether capture keeps
    the specs' kept streams for the prefix pass."""
    return keeps_attention(longstraw.prefix_keep_attention, prefix_grad, longstraw.cp_size,
                           any(spec.select for spec in adapter.specs))


def open_prefix_state(adapter: CausalLMAdapter, longstraw: LongstrawConfig, tokens: int, prefix_grad: str,
                      rank: int = 0, length: int | None = None, offset: int = 0, chunks: int | None = None,
                      keep_inputs: bool = False, last_layer_whole: bool = True) -> PrefixState:
    """An empty PrefixState for `tokens` captured tokens of this rank (all of the prompt's `length`, default
    `tokens`, from position `offset`) in `chunks` capture chunks (default: ceil(tokens / segment); a CP rank's
    pieces are chunked one by one): every layer's streams reserved on a pool of offload.tier and, for prefix_grad
    "exact", the carry checkpoint store and with prefix_keep_attention the kept attention's pool;
    keep_inputs: also the pool of every layer's inputs (the layer-major prefix pass); last_layer_whole: as
    PrefixState's. What was opened is released again on error."""
    pool = make_pool(longstraw.offload, longstraw.page_tokens, adapter.device, rank)
    state = PrefixState(length=tokens if length is None else length, pool=pool, specs=adapter.specs, offset=offset,
                        last_layer_whole=last_layer_whole)
    try:
        for spec in adapter.specs:
            for stream in spec.streams:
                pool.reserve(spec.layer, stream.name, tokens, stream.shape, stream.dtype)
        exact = prefix_grad == "exact"  # what the prefix pass reads: checkpoints, kept attention
        if keeps_kept_streams(adapter, longstraw, prefix_grad):
            state.kept_pool = open_kept_pool(adapter, longstraw, pool, tokens, rank, last_layer_whole)
        if exact:
            slots = ceil_div(tokens, longstraw.segment_tokens) if chunks is None else chunks
            state.checkpoints = open_checkpoints(longstraw, slots, adapter.device, rank)
        if keep_inputs:
            every = longstraw.prefix_inputs_every
            saved = [spec.layer for spec in adapter.specs if spec.layer % every == 0]
            bases = {layer: adapter.sparse_geometry(layer).topk for layer in selection_bases(adapter.specs, every)}
            state.input_pool = open_input_pool(longstraw, adapter.hidden_size, adapter.dtype, saved, tokens,
                                               adapter.device, rank, bases)
    except BaseException:
        state.release()
        raise
    return state


def capture_prefix(adapter: CausalLMAdapter, prompt_ids: torch.Tensor, longstraw: LongstrawConfig,
                   prefix_grad: str = "detached", progress: Callable[[int], object] | None = None,
                   rank: int = 0, parent: PrefixState | None = None, graph_budget: int | None = 0) -> PrefixState:
    """Capture prompt_ids[:-1] under no_grad into a PrefixState (one rank, token-major: chunk by chunk through
    every layer). parent: None, or the capture of the tokens before these (a tree's node, grpo/document.py):
    this one then starts at the parent's end, from its final carry, with its pages before its own as the past;
    the parent is neither changed nor released here. graph_budget (exact mode, a root): the bytes of autograd
    graph the first segments may keep (grpo/kept_graph.py; None: no bound, 0: none)."""
    ids = prompt_ids[:-1]
    length = ids.numel()
    # The tier (device, host or NVMe pages) comes from longstraw.offload; pages of earlier chunks are staged one
    # layer at a time as the chunk's forward reaches the layer (offload/stager.py).
    offset = 0 if parent is None else parent.offset + parent.length
    # the last layer's rows alone: no token reads its outputs over the prompt (PrefixState.last_layer_whole)
    state = open_prefix_state(adapter, longstraw, length, prefix_grad, rank, offset=offset, last_layer_whole=False)
    state.parent = parent
    if graph_budget != 0:
        if prefix_grad != "exact" or parent is not None:
            raise ValueError("a kept capture graph is exact mode's, for a prompt's root capture")
        state.kept_graph = KeptGraph(adapter, graph_budget)
    pool, kept_pool, checkpoints, kept_graph = state.pool, state.kept_pool, state.checkpoints, state.kept_graph
    paged = [spec for spec in adapter.specs if spec.streams]
    keeps = state.kept_specs() if kept_pool is not None else []  # the kept attention's layers
    names = stream_names(adapter.specs, last_layer=state.last_layer_whole)
    chunk = longstraw.segment_tokens  # exact mode: the prefix pass's autograd segment
    ancestors = state.ancestor_stagers(names)
    try:
        carry = {} if parent is None else dict(parent.carry)
        live_carry = carry  # the kept graph's: its last segment's end carry, with its graph
        stager = Stager(pool, names)
        start, index = 0, 0
        while start < length:
            end = start if kept_graph is None or not kept_graph.open else kept_graph.next_end(start, length, chunk)
            kept = end > start
            if kept:  # a kept segment: with autograd, over the kept segments' live rows
                out = kept_graph.run(ids, start, end, offset + start, live_carry)
                live_carry = out.carry
            else:
                end = min(length, start + chunk)
                if checkpoints is not None:  # exact mode: the prefix pass starts its segments here
                    saved = checkpoints.save(index, carry) if carry else {}
                    state.boundaries.append(ChunkBoundary(start, end, saved))
                index += 1
                past = node_past(ancestors, stager, start)
                with torch.no_grad():
                    out = adapter.forward_segment(ids[start:end], offset + start, carry, past, need_hidden=False)
                del past
            carry = _detached_carry(out.carry)
            with torch.no_grad():
                for spec in paged:
                    append_rows(pool, spec, [rows.detach() for rows in out.rows[spec.layer]])
                    if spec in keeps and not kept:  # the kept graph's segments need none
                        keep_segment_attention(kept_pool, spec, out.attention[spec.layer])
            del out
            return_freed_host_memory(adapter.device)
            if progress is not None:
                progress(end - start)
            start = end
        stager.close()
        state.flush()
    except BaseException:
        state.release()  # page files are removed on error as on success
        raise
    finally:
        for ancestor, _ in ancestors:
            ancestor.close()
    state.carry = carry
    return state
