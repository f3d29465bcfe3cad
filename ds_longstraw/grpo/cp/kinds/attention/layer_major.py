"""The "lse" layer kind in exact mode's layer-major prefix pass (ds_longstraw.grpo.cp.prefix_layers walks the
layers; this is one attention layer's step there).

At layer l every rank holds d(layer output) for its own tokens and the layer's input over its shard. The output
side first, chunk by chunk with autograd from the leaf out (the output gate recomputed with its graph): d(out), and
d(input) through the residual, the MLP and the gate. Then the attention's backward for every query of every rank
at once: a rank's own keys locally (dK/dV onto its gradient pages), the other ranks' earlier keys by a ring in which
queries travel (step t: rank r sends (q, out, dout, lse) of its chunks that see rank r+t's keys to it and answers
rank r-t's, whose dK/dV land on its own gradient pages, sending the dq shares back). Then every rank's pages hold
every contribution (replay's and all prompt queries'), and each chunk back-propagates its projections (q, K, V)
with autograd: d(input).

The attention's forward result the output side needs is the capture's kept (out, lse) (prefix_keep_attention), or
recomputed for the layer by the capture's own exchange (ring.shard_attention, over the pages already in place).
Bytes received per attention layer and prompt token (the ring, queries travelling): (3 H D + H) values of every
query that sees a rank's keys, per such rank, and H D of dq back (cp.report's "prefix" phase counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.arch.base import grad_leaf, grad_of, inject_gradients
from ds_longstraw.grpo.cp.kinds.attention.ring import (
    _pages_KTD,
    accumulation_dtype,
    add_page_grads,
    layer_stager,
    shard_attention,
    streamed_key_grads,
)
from ds_longstraw.grpo.cp.output_side import output_side
from ds_longstraw.kernels.attention import key_set_grads
from ds_longstraw.parallel.groups import local_spans, visible_prefix

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.cp.kinds.base import LayerMajorFrame
    from ds_longstraw.grpo.interfaces import Partial
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import PagePool, Stager
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext, PromptShards


def attention_layer_backward(frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                             dy_1TC: torch.Tensor) -> torch.Tensor:
    """d(layer input) [1, T, C] of attention layer `spec.layer` over this rank's shard (read_input(a, b): the
    layer's input of local tokens [a, b); frame.chunks: each per-chunk loop followed by the schedule's dummy
    chunks); parameter gradients accumulate, and every rank's gradient pages of the layer get every prompt query's
    dK/dV."""
    adapter, state, chunks, backward = frame.adapter, frame.state, frame.chunks, frame.backward
    layer = spec.layer
    spans = chunks.spans
    zero = torch.zeros(1, 1, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)
    heads, _, dim = adapter.attention_geometry()
    # (0) the shard's queries and its merged attention
    with torch.no_grad():
        queries = [adapter.attention_project(layer, adapter.mixer_input(layer, read_input(a, b)), position)[0]
                   for a, b, position in spans]
        for _ in chunks.dummies():
            adapter.attention_project(layer, adapter.mixer_input(layer, zero), 0)
        results = kept_partials(state, spec, spans) or shard_attention(frame, spec, queries)
    # (1) the output side: d(out), and d(input) through the residual, the MLP and the output gate
    d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=dy_1TC.device)
    d_outs = []
    for (a, b, position), (out, _) in zip(spans, results, strict=True):
        d_out, d_part = output_side(adapter, layer, read_input(a, b), position, out, dy_1TC[:, a:b], backward,
                                    _output_gate)
        d_outs.append(d_out)
        d_x[:, a:b] += d_part
    for _ in chunks.dummies():
        output_side(adapter, layer, zero, 0, zero.new_zeros(heads, 1, dim), zero, backward, _output_gate)
    # (2) the attention's backward, all ranks' queries at once: dq here, dK/dV onto the pages' owners
    dq = _attention_grads(frame, spec, queries, results, d_outs)
    del results, d_outs, queries
    # (3) the input side: (q, K, V) of each chunk with their complete gradients
    _input_sides(frame, spec, read_input, dq, d_x)
    return d_x


def kept_partials(state: PrefixState, spec: LayerState, spans: Sequence[tuple[int, int, int]]) -> list[Partial] | None:
    """The capture's kept (out, lse) of each chunk, head-major, or None when the attention was not kept."""
    if state.kept_pool is None:
        return None
    out, lse = (state.kept_pool.read(spec.layer, s.name).transpose(0, 1) for s in spec.kept)
    return [(out[:, a:b], lse[:, a:b]) for a, b, _ in spans]


def _output_gate(adapter: CausalLMAdapter, layer: int, mixed: torch.Tensor, position: int) -> torch.Tensor:
    return adapter.attention_project(layer, mixed, position)[1]


def _input_side(adapter: CausalLMAdapter, layer: int, x_1TC: torch.Tensor, position: int,
                injected: Sequence[torch.Tensor | None] | None,
                backward: Callable[[torch.Tensor], Any] | None) -> torch.Tensor:
    """d x of the chunk's (q, gate, K, V) projections given their gradients (the gate's is None: the output side
    took it; None altogether: a lockstep zero iteration)."""
    x = grad_leaf(x_1TC)
    with torch.enable_grad():
        query, gate, rows = adapter.attention_project(layer, adapter.mixer_input(layer, x), position)
        roots = [query, gate, *rows]
        inject_gradients(roots, injected or [None] * len(roots), backward)
    return grad_of(x)


def attention_rows_backward(frame: LayerMajorFrame, spec: LayerState,
                            read_input: Callable[[int, int], torch.Tensor], dy_1TC: torch.Tensor) -> torch.Tensor:
    """attention_layer_backward of a layer whose output over the prompt feeds nothing (the pass's top layer; dy_1TC
    is zero and only its shape is read): step (3) alone, its K/V's gradients on the gradient pages (the replay's,
    the only queries that read them with a gradient) through their projections. No queries, attention or ring:
    with d(output) = 0 the output side and the attention's backward give zeros."""
    d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=dy_1TC.device)
    _input_sides(frame, spec, read_input, None, d_x)
    return d_x


def _input_sides(frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 dq: Sequence[torch.Tensor] | None, d_x: torch.Tensor) -> None:
    """Step (3): each chunk's (q, K, V) projections back-propagated with their gradients (dq: each chunk's, None:
    zero; K/V's from the gradient pages), d(input) added to d_x; then the dummy chunks' zero iterations."""
    adapter, chunks, backward, pool, layer = frame.adapter, frame.chunks, frame.backward, frame.state.pool, spec.layer
    for index, (a, b, position) in enumerate(chunks.spans):
        rows = [pool.read_grad(layer, s.name, a, b) if s.grad else None for s in spec.streams]
        d_query = None if dq is None else dq[index]
        d_x[:, a:b] += _input_side(adapter, layer, read_input(a, b), position, (d_query, None, *rows), backward)
    zero = torch.zeros(1, 1, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)
    for _ in chunks.dummies():
        _input_side(adapter, layer, zero, 0, None, backward)


def _attention_grads(frame: LayerMajorFrame, spec: LayerState, queries: Sequence[torch.Tensor],
                     results: Sequence[Partial], d_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """dq of every chunk of this rank's shard (accumulation precision), with dK/dV of this rank's keys from its own
    queries and from every other rank's added to its gradient pages."""
    adapter, cp, pieces, chunk, spans = frame.adapter, frame.cp, frame.pieces, frame.chunk, frame.chunks.spans
    layer, pool = spec.layer, frame.state.pool
    scale = adapter.attention_scale(layer)
    acc = accumulation_dtype(adapter.dtype)
    heads, _, dim = adapter.attention_geometry()
    requests = _Requests(cp, pieces, chunk, spans, queries, results, d_outs, layer,
                         (heads, dim, adapter.dtype, acc, adapter.device))
    stager = layer_stager(pool, [spec])
    try:
        dq = []
        for step in range(1, cp.size):
            requests.post(step)
            if step == 1:  # the local keys while the first step's requests are being answered
                dq = _local_grads(spec, stager, pool, scale, spans, queries, results, d_outs)
            requests.answer(step, stager, spec, scale, pool)
            requests.collect(step, dq)
        if cp.size == 1:
            dq = _local_grads(spec, stager, pool, scale, spans, queries, results, d_outs)
    finally:
        stager.close()
    return dq


def _local_grads(spec: LayerState, stager: Stager, pool: PagePool | TieredPagePool, scale: float,
                 spans: Sequence[tuple[int, int, int]], queries: Sequence[torch.Tensor], results: Sequence[Partial],
                 d_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's queries against this rank's own keys before them (causal on the chunk itself)."""
    dq = []
    for (a, b, _), q, (out, lse), d_out in zip(spans, queries, results, d_outs, strict=True):
        k_KTD, v_KTD = _pages_KTD(pool, spec, a, b)
        share, dk, dv = key_set_grads(q, k_KTD, v_KTD, out, lse, d_out, scale, causal_offset=0)
        add_page_grads(pool, spec, a, dk, dv)
        earlier = streamed_key_grads(stager, spec, q, out, lse, d_out, scale, pool, end=a)
        dq.append(share.to(earlier.dtype) + earlier)
    return dq


class _Requests:
    """The ring of the attention's backward (queries travelling). In step t rank r sends, for each of its chunks
    that sees keys of rank r+t, (q, out, dout, lse) to it (the merged out and lse: what the kernels' backward
    takes); it answers rank r-t's chunks that see its keys (dK/dV onto its own gradient pages, the dq share back);
    then it collects its own dq shares. Both sides derive which chunks travel from the layout alone
    (groups.visible_prefix), so no header is sent. Sends are posted without blocking in a fixed order per pair of
    ranks, receives in the same order."""

    def __init__(self, cp: CPContext, pieces: PromptShards, chunk: int,
                 spans: Sequence[tuple[int, int, int]], queries: Sequence[torch.Tensor], results: Sequence[Partial],
                 d_outs: Sequence[torch.Tensor], layer: int,
                 geometry: tuple[int, int, torch.dtype, torch.dtype, torch.device]) -> None:
        self.cp, self.pieces, self.chunk, self.layer = cp, pieces, chunk, layer
        self.spans, self.queries, self.results, self.d_outs = spans, queries, results, d_outs
        self.heads, self.dim, self.dtype, self.acc, self.device = geometry
        self.works = []

    def _seen(self, rank: int, spans: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """(index, keys of rank `rank` it sees) of each chunk in `spans` that sees some."""
        out = []
        for index, (_, _, position) in enumerate(spans):
            seen = visible_prefix(self.pieces[rank], position)
            if seen:
                out.append((index, seen))
        return out

    def post(self, step: int) -> None:
        cp = self.cp
        dst = (cp.rank + step) % cp.size
        for index, _ in self._seen(dst, self.spans):
            out, lse = self.results[index]
            for tensor in (self.queries[index], out.to(self.dtype), self.d_outs[index].to(self.dtype),
                           lse.to(self.acc)):
                self.works.append(cp.isend(tensor, dst))

    def answer(self, step: int, stager: Stager, spec: LayerState, scale: float,
               pool: PagePool | TieredPagePool) -> None:
        cp = self.cp
        src = (cp.rank - step) % cp.size
        theirs = local_spans(self.pieces[src], self.chunk)
        for index, seen in self._seen(cp.rank, theirs):
            a, b, _ = theirs[index]
            shape = (self.heads, b - a, self.dim)
            q = cp.recv(shape, self.dtype, src, self.layer, "prefix_layer_q", device=self.device)
            out = cp.recv(shape, self.dtype, src, self.layer, "prefix_layer_out", device=self.device)
            d_out = cp.recv(shape, self.dtype, src, self.layer, "prefix_layer_dout", device=self.device)
            lse = cp.recv((self.heads, b - a), self.acc, src, self.layer, "prefix_layer_lse", device=self.device)
            share = streamed_key_grads(stager, spec, q, out, lse, d_out, scale, pool, end=seen)
            self.works.append(cp.isend(share, src))

    def collect(self, step: int, dq: list[torch.Tensor]) -> None:
        cp = self.cp
        dst = (cp.rank + step) % cp.size
        for index, _ in self._seen(dst, self.spans):
            share = cp.recv(dq[index].shape, dq[index].dtype, dst, self.layer, "prefix_layer_dq",
                            device=dq[index].device)
            dq[index] += share
        for work in self.works:
            work.wait()
        self.works = []
