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
        """Issue the reads of tokens [start, end) of the attention kept from capture (a KeptRead; issued a
        segment ahead, the reads of a slower tier overlap the prefix pass's compute)."""
        if self.kept_pool is None:
            return KeptRead({}, layers)
        return KeptRead({(layer, name): self.kept_pool.begin_read(layer, name, start, end)
                         for layer in layers for name in KEPT_ATTENTION}, layers)

    def begin_carry(self, boundary):
        """Issue the read of the GDN carry checkpointed at `boundary` (one of self.boundaries); result(): layer ->
        (state, tail), (None, None) for a layer that starts from zeros there (the prompt start)."""
        return self.checkpoints.begin_load(boundary)

    def release(self):
        if self.kept_pool is not None and self.kept_pool is not self.pool:
            self.kept_pool.release()
        if self.checkpoints is not None:
            self.checkpoints.release()
        self.pool.release()
        self.gdn_carry.clear()
        self.boundaries.clear()


class KeptRead:
    """The reads of one segment's kept attention. result(): layer -> (out_HTD, lse_HT), or None when none was kept;
    release() completes and drops reads not collected (an error before result())."""

    def __init__(self, tickets, layers):
        self.tickets, self.layers = tickets, layers

    def result(self):
        if not self.tickets:
            return None
        try:
            return {layer: tuple(self.tickets[(layer, name)].result().transpose(0, 1).contiguous()
                                 for name in KEPT_ATTENTION) for layer in self.layers}
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


class CarryCheckpoints:
    """Exact mode's GDN carry checkpoints on the compute device, one slot per segment start, in storage allocated
    once per layer (offload.tier "none").

    Why not one small tensor per checkpoint: allocated between a segment's large temporaries, hundreds of live
    16 KB tensors pin the allocator's heap, and what the temporaries free is never returned (measured at 32K
    tokens, 256-token segments: 141 MiB of resident memory held by 15 MiB of checkpoints)."""

    def __init__(self, slots):
        self.slots = slots
        self._store = {}  # layer -> (states [slots, ...], tails [slots, ...])
        self._saved = {}  # layer -> checkpoints written

    def save(self, index, carry):
        """The carry (layer -> (state, tail)) at the start of segment `index` as views into the store."""
        return {layer: self.save_layer(index, layer, state, tail) for layer, (state, tail) in carry.items()}

    def save_layer(self, index, layer, state, tail):
        if layer not in self._store:  # shapes are known once the layer has run
            self._store[layer] = (state.new_empty((self.slots, *state.shape)), tail.new_empty((self.slots, *tail.shape)))
        states, tails = self._store[layer]
        states[index].copy_(state)
        tails[index].copy_(tail)
        self._saved[layer] = self._saved.get(layer, 0) + 1
        return states[index], tails[index]

    def flush(self):
        """Nothing to write back: the store is on the device."""

    def begin_load(self, boundary):
        return ReadyRead(dict(boundary.gdn_carry))  # views into the store: complete at once

    def nbytes(self) -> int:
        return sum(count * (states[0].numel() * states.element_size() + tails[0].numel() * tails.element_size())
                   for (states, tails), count in ((self._store[layer], n) for layer, n in self._saved.items()))

    def release(self):
        self._store.clear()


class PooledCarryCheckpoints:
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

    def save(self, index, carry):
        return {layer: self.save_layer(index, layer, state, tail) for layer, (state, tail) in carry.items()}

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
        tickets = {layer: tuple(self.pool.begin_read(layer, name, slot, slot + 1) for name in (self.STATE, self.TAIL))
                   for layer, slot in boundary.gdn_carry.items()}
        return _PooledCarryRead(tickets)

    def nbytes(self) -> int:
        return sum(size for (_, name), size in self.pool.bytes_by_stream().items() if name in (self.STATE, self.TAIL))

    def release(self):
        self.pool.release()


class _PooledCarryRead:
    def __init__(self, tickets):
        self.tickets = tickets

    def result(self):
        try:
            return {layer: (state.result()[0], tail.result()[0]) for layer, (state, tail) in self.tickets.items()}
        finally:
            self.release()

    def release(self):
        for pair in self.tickets.values():
            for ticket in pair:
                ticket.release()


def open_checkpoints(settings, slots, device, rank=0):
    """The store of exact mode's GDN carry checkpoints: on the device (offload.tier "none") or on a pool of the
    pages' tier with one checkpoint a page."""
    if settings.offload.tier == "none":
        return CarryCheckpoints(slots)
    return PooledCarryCheckpoints(make_pool(settings.offload, 1, device, rank), slots)


def capture_prefix(adapter, prompt_ids, settings, keep_boundaries=False, progress=None, rank=0) -> PrefixState:
    """Capture prompt_ids[:-1] under no_grad into a PrefixState."""
    ids = prompt_ids[:-1]
    length = ids.numel()
    # The tier (device, host or NVMe pages) comes from settings.offload; pages of earlier chunks are staged one
    # layer at a time as the chunk's forward reaches the layer (offload/stager.py).
    pool = make_pool(settings.offload, settings.page_tokens, adapter.device, rank)
    keep_attention = keep_boundaries and settings.prefix_keep_attention
    kept_pool = checkpoints = None
    chunk = settings.segment_tokens  # exact mode: the prefix pass's autograd segment
    try:
        for layer in adapter.attn_layers:
            for name in ("k", "v"):
                pool.reserve(layer, name, length, adapter.kv_shape(), adapter.dtype)
        if keep_attention:
            kept_pool = open_kept_pool(adapter, settings, pool, length, rank)
        if keep_boundaries:
            checkpoints = open_checkpoints(settings, ceil_div(length, chunk), adapter.device, rank)
        state = PrefixState(length=length, pool=pool, kept_pool=kept_pool, checkpoints=checkpoints)
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
                    if keep_attention:
                        keep_segment_attention(kept_pool, layer, *out.attention[layer])
                del out, past
                return_freed_host_memory(adapter.device)
                if progress is not None:
                    progress(end - start)
        stager.close()
        pool.flush()  # the last partial pages too: after capture every page is on its tier
        if kept_pool is not None and kept_pool is not pool:
            kept_pool.flush()
        if checkpoints is not None:
            checkpoints.flush()
    except BaseException:
        if kept_pool is not None and kept_pool is not pool:
            kept_pool.release()
        if checkpoints is not None:
            checkpoints.release()
        pool.release()  # page files are removed on error as on success
        raise
    state.gdn_carry = carry
    return state
