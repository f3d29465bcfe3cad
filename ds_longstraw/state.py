"""The retained state of a captured prompt, and the capture that fills it.

Capture runs prompt[:-1] through the model chunk by chunk WITHOUT autograd and keeps only what later tokens
read: per Gated DeltaNet layer the recurrent state and the conv tail, per full-attention layer K and V on owned
pages. In exact mode it also checkpoints the GDN state at every chunk start (on the pages' tier), so the prefix
pass can recompute one chunk at a time, and with prefix_keep_attention keeps each attention layer's output and log-sum-exp ("o",
"lse" streams) so that recompute skips the prompt's attention.
"""

from dataclasses import dataclass, field

import torch

from ds_longstraw.lockstep import ceil_div
from ds_longstraw.memory import return_freed_host_memory
from ds_longstraw.offload import PagePool, Stager, StagedPast, make_pool
from ds_longstraw.offload.pages import ReadyRead


@dataclass
class ChunkBoundary:
    start: int
    end: int
    gdn_carry: dict  # layer -> (recurrent state, conv tail) at `start` (None, None at the prompt start)


@dataclass
class PrefixState:
    length: int  # captured tokens: len(prompt) - 1
    pool: PagePool  # "k" and "v" streams of every attention layer
    gdn_carry: dict = field(default_factory=dict)  # layer -> (recurrent state, conv tail) after the prefix
    boundaries: list = field(default_factory=list)  # exact mode only
    offset: int = 0  # prompt position of this rank's first captured token (context parallelism; else 0)
    # exact mode with prefix_keep_attention: the pool of every attention layer's "o" and "lse" streams (`pool`, or
    # a pool of offload.kept_attention_tier); None when the attention is not kept
    kept_pool: PagePool | None = None
    # exact mode: the store of the GDN carry checkpoints (CarryCheckpoints on the device, PooledCarryCheckpoints
    # on offload.tier); None in detached mode
    checkpoints: "CarryCheckpoints | PooledCarryCheckpoints | None" = None

    def retained_bytes(self) -> dict:
        """Bytes kept for later tokens, by layer type (exact mode's checkpoints and kept attention apart)."""
        gdn = sum(s.numel() * s.element_size() + t.numel() * t.element_size() for s, t in self.gdn_carry.values())
        checkpoints = 0 if self.checkpoints is None else self.checkpoints.nbytes()
        kv = sum(size for (_, name), size in self.pool.bytes_by_stream().items() if name in ("k", "v"))
        kept = 0 if self.kept_pool is None else sum(
            size for (_, name), size in self.kept_pool.bytes_by_stream().items() if name in KEPT_ATTENTION)
        return {"attention_kv_pages": kv, "gdn_state": gdn, "gdn_checkpoints": checkpoints,
                "attention_output_pages": kept}

    def begin_kept_attention(self, layers, start, end):
        """Issue the reads of tokens [start, end) of the attention kept from capture (issued a segment ahead, the
        reads of a slower tier overlap the prefix pass's compute); result(): layer -> (out_HTD, lse_HT), or None
        when none was kept."""
        if self.kept_pool is None:
            return ReadyRead(None)
        tickets = {(layer, name): self.kept_pool.begin_read(layer, name, start, end)
                   for layer in layers for name in KEPT_ATTENTION}
        return PendingReads(tickets, lambda got: {
            layer: tuple(got[(layer, name)].transpose(0, 1).contiguous() for name in KEPT_ATTENTION)
            for layer in layers})

    def begin_carry(self, boundary):
        """Issue the read of the GDN carry checkpointed at `boundary` (one of self.boundaries); result(): layer ->
        (state, tail), (None, None) for a layer that starts from zeros there (the prompt start)."""
        return self.checkpoints.begin_load(boundary)

    def flush(self):
        """Write back what capture left in partial pages: afterwards every page is on its tier."""
        self.pool.flush()
        if self.kept_pool is not None and self.kept_pool is not self.pool:
            self.kept_pool.flush()
        if self.checkpoints is not None:
            self.checkpoints.flush()

    def release(self):
        """Drop every page and checkpoint (page files of a host/NVMe tier go, on error as on success)."""
        if self.kept_pool is not None and self.kept_pool is not self.pool:
            self.kept_pool.release()
        if self.checkpoints is not None:
            self.checkpoints.release()
        self.pool.release()
        self.gdn_carry.clear()
        self.boundaries.clear()


class PendingReads:
    """Reads issued together: tickets by key. result() waits for every one and hands {key: tensor} to `assemble`;
    release() completes and drops the reads not collected (an error before result())."""

    def __init__(self, tickets, assemble):
        self.tickets, self.assemble = tickets, assemble

    def result(self):
        try:
            return self.assemble({key: ticket.result() for key, ticket in self.tickets.items()})
        finally:
            self.release()

    def release(self):
        for ticket in self.tickets.values():
            ticket.release()


KEPT_ATTENTION = ("o", "lse")  # token-major pages of out_HTD and lse_HT


def open_kept_pool(adapter, settings, pool, length, rank=0):
    """The pool that keeps `length` tokens of every attention layer's output and LSE (exact mode's
    prefix_keep_attention): `pool` itself, or one of offload.kept_attention_tier, with the streams reserved."""
    own = settings.offload.kept_attention_pool()
    # A pool of its own holds one prefix-pass segment a page: the prefix pass reads whole segments.
    kept_pool = pool if own is None else make_pool(own, settings.segment_tokens, adapter.device, rank)
    heads, dim = adapter.attention_shape()
    try:
        for layer in adapter.attn_layers:
            kept_pool.reserve(layer, "o", length, (heads, dim), adapter.dtype)
            kept_pool.reserve(layer, "lse", length, (heads,), adapter.state_dtype())
    except BaseException:
        if kept_pool is not pool:
            kept_pool.release()
        raise
    return kept_pool


def keep_segment_attention(kept_pool, layer, out_HTD, lse_HT):
    """Append one segment's attention result (the next tokens of the layer's "o" and "lse" streams)."""
    kept_pool.append(layer, "o", out_HTD.transpose(0, 1))
    kept_pool.append(layer, "lse", lse_HT.transpose(0, 1))


def _detached_carry(carry):
    return {layer: (state.detach(), tail.detach()) for layer, (state, tail) in carry.items()}


class _CheckpointStore:
    def save(self, index, carry):
        """Checkpoint the carry (layer -> (state, tail)) at the start of segment `index`; returns what the
        segment's boundary holds (layer -> views into the store, or slots of the pool)."""
        return {layer: self.save_layer(index, layer, state, tail) for layer, (state, tail) in carry.items()}


class CarryCheckpoints(_CheckpointStore):
    """Exact mode's GDN carry checkpoints on the compute device, one slot per segment start, in storage allocated
    once per layer (offload.tier "none").

    Why not one small tensor per checkpoint: allocated between a segment's large temporaries, hundreds of live
    16 KB tensors pin the allocator's heap, and what the temporaries free is never returned (measured at 32K
    tokens, 256-token segments: 141 MiB of resident memory held by 15 MiB of checkpoints)."""

    def __init__(self, slots):
        self.slots = slots
        self._store = {}  # layer -> (states [slots, ...], tails [slots, ...])
        self._saved_bytes = 0  # of the checkpoints written (slots of the prompt start stay unused)

    def save_layer(self, index, layer, state, tail):
        if layer not in self._store:  # shapes are known once the layer has run
            self._store[layer] = (state.new_empty((self.slots, *state.shape)), tail.new_empty((self.slots, *tail.shape)))
        states, tails = self._store[layer]
        states[index].copy_(state)
        tails[index].copy_(tail)
        self._saved_bytes += state.numel() * state.element_size() + tail.numel() * tail.element_size()
        return states[index], tails[index]

    def flush(self):
        """Nothing to write back: the store is on the device."""

    def begin_load(self, boundary):
        return ReadyRead(dict(boundary.gdn_carry))  # views into the store: complete at once

    def nbytes(self) -> int:
        return self._saved_bytes

    def release(self):
        self._store.clear()


class PooledCarryCheckpoints(_CheckpointStore):
    """Exact mode's GDN carry checkpoints on a page pool of offload.tier (host memory, or NVMe files through async
    I/O), one checkpoint a page: written once by capture, read once by the prefix pass, a segment ahead of use.

    Each is the model's whole GDN state (about 150 MB at Qwen3.6-27B width): kept on the device, the 64 segments of
    a 256K-token shard would hold 9.6 GB. A layer's checkpoints are the consecutive slots of its two streams, from
    its first checkpointed segment on (segment 0, or 1 where the prompt starts from zeros)."""

    STATE, TAIL = "gdn_checkpoint_state", "gdn_checkpoint_tail"

    def __init__(self, pool, slots):
        self.pool, self.slots = pool, slots
        self._first = {}  # layer -> its first checkpointed segment
        self._next = {}  # layer -> the segment whose checkpoint it writes next

    def save_layer(self, index, layer, state, tail):
        """Append segment `index`'s carry of `layer`; returns the slot it went to (what boundaries hold)."""
        if layer not in self._first:  # shapes are known once the layer has run
            self.pool.reserve(layer, self.STATE, self.slots - index, tuple(state.shape), state.dtype)
            self.pool.reserve(layer, self.TAIL, self.slots - index, tuple(tail.shape), tail.dtype)
            self._first[layer] = self._next[layer] = index
        if index != self._next[layer]:
            raise RuntimeError(f"GDN layer {layer}: checkpoint of segment {index} written out of order "
                               f"(expected {self._next[layer]})")
        self.pool.append(layer, self.STATE, state.unsqueeze(0))
        self.pool.append(layer, self.TAIL, tail.unsqueeze(0))
        self._next[layer] = index + 1
        return index - self._first[layer]

    def flush(self):
        self.pool.flush()

    def begin_load(self, boundary):
        slots = boundary.gdn_carry  # layer -> its slot
        tickets = {(layer, name): self.pool.begin_read(layer, name, slot, slot + 1)
                   for layer, slot in slots.items() for name in (self.STATE, self.TAIL)}
        return PendingReads(tickets, lambda got: {layer: (got[(layer, self.STATE)][0], got[(layer, self.TAIL)][0])
                                                  for layer in slots})

    def nbytes(self) -> int:
        return sum(size for (_, name), size in self.pool.bytes_by_stream().items() if name in (self.STATE, self.TAIL))

    def release(self):
        self.pool.release()


def open_checkpoints(settings, slots, device, rank=0):
    """The store of exact mode's GDN carry checkpoints: on the device (offload.tier "none") or on a pool of the
    pages' tier with one checkpoint a page."""
    if settings.offload.tier == "none":
        return CarryCheckpoints(slots)
    return PooledCarryCheckpoints(make_pool(settings.offload, 1, device, rank), slots)


def open_prefix_state(adapter, settings, tokens, keep_boundaries, rank=0, length=None, offset=0) -> PrefixState:
    """An empty PrefixState for `tokens` captured tokens of this rank (all of the prompt's `length`, default
    `tokens`, from position `offset`): the K/V streams reserved on a pool of offload.tier and, in exact mode
    (keep_boundaries), the GDN checkpoint store and with prefix_keep_attention the kept attention's pool. What
    was opened is released again on error."""
    pool = make_pool(settings.offload, settings.page_tokens, adapter.device, rank)
    state = PrefixState(length=tokens if length is None else length, pool=pool, offset=offset)
    try:
        for layer in adapter.attn_layers:
            for name in ("k", "v"):
                pool.reserve(layer, name, tokens, adapter.kv_shape(), adapter.dtype)
        if keep_boundaries and settings.prefix_keep_attention:
            state.kept_pool = open_kept_pool(adapter, settings, pool, tokens, rank)
        if keep_boundaries:
            state.checkpoints = open_checkpoints(settings, ceil_div(tokens, settings.segment_tokens), adapter.device,
                                                 rank)
    except BaseException:
        state.release()
        raise
    return state


def capture_prefix(adapter, prompt_ids, settings, keep_boundaries=False, progress=None, rank=0) -> PrefixState:
    """Capture prompt_ids[:-1] under no_grad into a PrefixState."""
    ids = prompt_ids[:-1]
    length = ids.numel()
    # The tier (device, host or NVMe pages) comes from settings.offload; pages of earlier chunks are staged one
    # layer at a time as the chunk's forward reaches the layer (offload/stager.py).
    state = open_prefix_state(adapter, settings, length, keep_boundaries, rank)
    pool, kept_pool, checkpoints = state.pool, state.kept_pool, state.checkpoints
    chunk = settings.segment_tokens  # exact mode: the prefix pass's autograd segment
    try:
        carry = {}
        stager = Stager(pool, adapter.attn_layers)
        with torch.no_grad():
            for index, start in enumerate(range(0, length, chunk)):
                end = min(length, start + chunk)
                if keep_boundaries:
                    saved = checkpoints.save(index, carry) if carry else {}
                    state.boundaries.append(ChunkBoundary(start, end, saved))
                past = StagedPast(stager, adapter.attn_layers, 0, start)
                out = adapter.forward_segment(ids[start:end], start, carry, past)
                carry = _detached_carry({layer: (out.gdn_state[layer], out.conv_tail[layer]) for layer in adapter.gdn_layers})
                for layer in adapter.attn_layers:
                    pool.append(layer, "k", out.keys[layer])
                    pool.append(layer, "v", out.values[layer])
                    if kept_pool is not None:
                        keep_segment_attention(kept_pool, layer, *out.attention[layer])
                del out, past
                return_freed_host_memory(adapter.device)
                if progress is not None:
                    progress(end - start)
        stager.close()
        state.flush()
    except BaseException:
        state.release()  # page files are removed on error as on success
        raise
    state.gdn_carry = carry
    return state
