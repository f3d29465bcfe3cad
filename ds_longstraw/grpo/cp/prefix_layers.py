"""Exact mode's prefix pass under context parallelism, layer-major: every rank busy at once.

The turns of prefix.py walk the prompt's segments right to left, one owner at a time, because a segment's backward
needs the complete gradients of its outputs, which later tokens produce. Walking the LAYERS top to bottom instead,
all ranks together, breaks that chain everywhere but inside a layer, where it is cheap to settle:

  at layer l every rank holds d(layer output) for its own tokens (from layer l+1's step; zero at the top, where
  the prompt's hidden states feed nothing) and the layer's input over its shard (saved at capture on the pages'
  tier, state.input_pool; with prefix_inputs_every k only layers 0, k, 2k, ... are saved, and on reaching a
  group's top layer every rank recomputes the group's other inputs from its base by the layers' own forward,
  recompute_inputs, onto a pool of the tier released when the group is done), and produces d(layer input):
  "lse"          (attention; this module) the output side first, chunk by chunk with autograd from the leaf
                 out (the output gate recomputed with its graph): d(out), and d(input) through the residual, the
                 MLP and the gate. Then the attention's backward for every query of every rank at once: a rank's
                 own keys locally (dK/dV onto its gradient pages), the other ranks' earlier keys by a ring in which
                 queries travel (step t: rank r sends (q, out, dout, lse) of its chunks that see rank r+t's keys
                 to it and answers rank r-t's, whose dK/dV land on its own gradient pages, sending the dq shares
                 back). Then every rank's pages hold every contribution (replay's and all prompt queries'), and
                 each chunk back-propagates its projections (q, K, V) with autograd: d(input).
  "topk_lse"     (sparse attention over a global top-k selection: prefix_sparse.py) the same steps, the queries
                 travelling to the selected rows' owners and the selection recomputed without a graph.
  "affine_scan"  (GDN) scan_backward.py over the family's math (qwen3_5: arch/qwen3_5_scan_backward.py): summaries of
                 the state adjoint all-gathered and folded from the prompt's end, each piece's backward from its
                 own end-state gradient, then the conv tails' gradients likewise.
Finally the embedding gets d(layer 0 input). Nothing of the prompt's graph outlives one chunk of one layer.

The attention's forward result the output side needs is the capture's kept (out, lse) (prefix_keep_attention),
or recomputed for the layer by the capture's own exchange (cp_attention.shard_attention, over the pages already in
place). Bytes received per attention layer and prompt token (the ring, queries travelling): (3 H D + H) values of
every query that sees a rank's keys, per such rank, and H D of dq back (cp.report's "prefix" phase counts them).

Held per rank across one layer (the planner's "layer_major_prefix" workspace, offload/plan.py): d(output) and
d(input) [T, C] in the model's dtype; for attention the shard's q, out and d(out) [T, H D] with lse [T, H];
for GDN d(o) and d(z) [T, Hv dv]. The layer's input is read from the tier chunk by chunk.

Under ZeRO-3 (lockstep) every rank makes the same module calls in the same order: each per-chunk loop is padded to
the largest shard's chunk count with one-token zero iterations (the capture's dummy chunks: the schedule's
chunks(spans), lockstep.ShardChunks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.arch.base import grad_leaf, grad_of, inject_gradients
from ds_longstraw.grpo.cp.capture import mlp_over_chunks
from ds_longstraw.grpo.cp.cp_attention import (
    _acc,
    _pages_KTD,
    add_page_grads,
    finish_dummies,
    layer_stager,
    project_chunks,
    shard_attention,
    streamed_key_grads,
)
from ds_longstraw.grpo.cp.cp_sparse import capture_sparse_layer, uses_selection
from ds_longstraw.grpo.cp.output_side import output_side
from ds_longstraw.grpo.cp.prefix_sparse import Selections, sparse_layer_backward
from ds_longstraw.grpo.cp.scan_backward import prefix_scan_layer, scan_layer_forward
from ds_longstraw.grpo.lockstep import Schedule
from ds_longstraw.grpo.state import INPUT_STREAM
from ds_longstraw.kernels.attention import key_set_grads
from ds_longstraw.offload import make_pool
from ds_longstraw.parallel.groups import local_spans, visible_prefix

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.interfaces import Partial
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import PagePool, Stager
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext


def layer_major_prefix_backward(adapter: CausalLMAdapter, state: PrefixState, ids: torch.Tensor,
                                d_final_carry: Mapping[int, Sequence[torch.Tensor]], cp: CPContext,
                                settings: LongstrawConfig, backward: Callable[[torch.Tensor], Any] | None = None,
                                schedule: Schedule | None = None) -> None:
    """Exact-mode prefix pass of this rank's shard, all ranks layer by layer (see the module docstring).

    ids: this rank's shard of prompt[:-1] in local order; d_final_carry: layer -> d(prompt's final carry) from
    replay; settings: the transaction's (segment_tokens: the capture's chunks; prefix_inputs_every: which layers'
    inputs capture kept; offload: the tier of the recomputed ones). Parameter gradients of this rank's tokens
    accumulate into .grad; the caller reduces them. backward: as prefix_pass.prefix_backward's; schedule: the
    transaction's (None: no padding), whose chunks(spans) every per-chunk loop walks (the capture's dummy chunks
    under a Lockstep)."""
    chunk, every = settings.segment_tokens, settings.prefix_inputs_every
    pieces = cp.pieces(state.length)
    spans = local_spans(pieces[cp.rank], chunk)
    chunks = (schedule or Schedule()).chunks(spans)
    if [(a, b) for a, b, _ in spans] != [(b.start, b.end) for b in state.boundaries]:
        raise RuntimeError("layer-major prefix pass: the capture's chunks differ from this pass's")
    tokens = ids.numel()
    # d(layer output) in the model's dtype, as autograd keeps a hidden state's gradient in the other passes
    d_hidden = torch.zeros(1, tokens, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)
    group = None  # the pool of the recomputed inputs of the layers above the current group's base
    inputs = {}  # "group": the pool of the current group's recomputed inputs, for the selections' reads

    def input_of(layer: int) -> Callable[[int, int], torch.Tensor]:
        if layer % every == 0:
            return partial(state.read_layer_input, layer)
        return partial(_read_group, inputs["group"], layer)

    # "topk_lse" layers: the selections they attend (a group's base keeps the one it reuses from below)
    selections = Selections(adapter, state, chunks, cp, pieces, input_of, every) \
        if uses_selection(adapter.specs) else None
    try:
        for spec in reversed(adapter.specs):
            layer = spec.layer
            base = layer - layer % every
            if layer == base:
                read_input = partial(state.read_layer_input, layer)  # (a, b) -> [1, b - a, C] from the tier
            else:
                if group is None:  # the group's top layer: its inputs recomputed from the base's, once
                    group = recompute_inputs(adapter, state, base, layer, chunks, cp, pieces, settings, selections)
                    inputs["group"] = group
                read_input = partial(_read_group, group, layer)
            if spec.combine == "lse":
                d_hidden = attention_layer_backward(adapter, spec, state, read_input, d_hidden, chunks, cp, pieces,
                                                    chunk, backward)
            elif spec.combine == "topk_lse":
                d_hidden = sparse_layer_backward(adapter, spec, state, read_input, d_hidden, chunks, cp, pieces,
                                                 selections, backward)
            elif spec.combine == "affine_scan":
                d_hidden = prefix_scan_layer(adapter.recurrent_scan(layer), layer, read_input, d_hidden, state,
                                             chunks, cp, pieces, d_final_carry.get(layer), backward=backward)
            else:
                raise NotImplementedError(f"layer {layer}: combine {spec.combine!r} in the layer-major prefix pass")
            if selections is not None:
                selections.done(layer)
            if group is not None and layer == base + 1:  # the group is done
                group.release()
                group = inputs["group"] = None
    finally:
        if group is not None:
            group.release()
    for a, b, _ in spans:  # the embedding's share
        with torch.enable_grad():
            inject_gradients([adapter.embed(ids[a:b])], [d_hidden[:, a:b]], backward)
    for _ in chunks.dummies():
        with torch.enable_grad():
            inject_gradients([adapter.embed(ids[:0].new_zeros(1))], [None], backward)


def _read_group(group: PagePool | TieredPagePool, layer: int, start: int, end: int) -> torch.Tensor:
    return group.read(layer, INPUT_STREAM, start, end).unsqueeze(0)


def recompute_inputs(adapter: CausalLMAdapter, state: PrefixState, base: int, top: int, chunks: ShardChunks,
                     cp: CPContext, pieces: Sequence[Sequence[tuple[int, int]]], settings: LongstrawConfig,
                     selections: Selections | None = None) -> PagePool | TieredPagePool:
    """The inputs of layers base + 1 .. top over this rank's shard, recomputed without a graph from layer base's
    (capture's) by the layers' own forward, with the exchanges their combine needs (every rank recomputes the same
    group at once), onto a pool of offload.tier that the caller releases (prefix_inputs_every). selections: the
    pass's prefix_sparse.Selections ("topk_lse" layers: a base that reuses a selection gets it there)."""
    pool = make_pool(settings.offload, settings.page_tokens, adapter.device, cp.rank)
    try:
        hidden = state.read_layer_input(base)
        for layer in range(base + 1, top + 1):
            pool.reserve(layer, INPUT_STREAM, hidden.shape[1], (adapter.hidden_size,), adapter.dtype)
        # the selection the base reuses ("topk_lse" layers; None: it makes its own, or the family has none)
        first = adapter.specs[base]
        selection = selections.of(base) if first.combine == "topk_lse" and not first.select else None
        with torch.no_grad():
            for spec in adapter.specs[base:top]:
                hidden, selection = layer_forward(adapter, spec, state, hidden, chunks, cp, pieces,
                                                  settings.segment_tokens, selection)
                pool.append(spec.layer + 1, INPUT_STREAM, hidden[0])
        pool.flush()
    except BaseException:
        pool.release()
        raise
    return pool


def layer_forward(adapter: CausalLMAdapter, spec: LayerState, state: PrefixState, hidden_1TC: torch.Tensor,
                  chunks: ShardChunks, cp: CPContext, pieces: Sequence[Sequence[tuple[int, int]]], chunk: int,
                  selection: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(Layer `spec.layer`'s output over this rank's shard from its input, the last top-k selection), no graph, as
    the capture computes it but reading what the capture kept: attention over the pages in place (or the kept
    attention), GDN from each chunk's checkpointed carry (no exchange), a "topk_lse" layer by the capture's
    exchanges (its own selection, or `selection`: the last one made). chunks: lockstep.ShardChunks (the capture's
    dummy chunks too)."""
    layer = spec.layer
    spans = chunks.spans
    normed = adapter.mixer_input(layer, hidden_1TC)
    if spec.combine == "lse":
        queries, gates, dummies = project_chunks(adapter, spec, normed, chunks)
        results = _kept(state, spec, spans) or shard_attention(adapter, spec, queries, spans, cp, pieces, state.pool,
                                                                chunk)
        mixed = [adapter.attention_finish(layer, out, gate) for (out, _), gate in zip(results, gates, strict=True)]
        finish_dummies(adapter, layer, dummies)
    elif spec.combine == "affine_scan":
        mixed = scan_layer_forward(adapter.recurrent_scan(layer), layer, normed, chunks, state)
    elif spec.combine == "topk_lse":
        out, selection = capture_sparse_layer(adapter, spec, normed, chunks, cp, pieces, state.pool, selection,
                                              append=False)
        mixed = [out]
    else:
        raise NotImplementedError(f"layer {layer}: combine {spec.combine!r} in the layer-major prefix pass")
    hidden = hidden_1TC + (torch.cat(mixed, 1) if mixed else torch.zeros_like(hidden_1TC))
    return mlp_over_chunks(adapter, layer, hidden, chunks), selection


def attention_layer_backward(adapter: CausalLMAdapter, spec: LayerState, state: PrefixState,
                             read_input: Callable[[int, int], torch.Tensor], dy_1TC: torch.Tensor, chunks: ShardChunks,
                             cp: CPContext, pieces: Sequence[Sequence[tuple[int, int]]], chunk: int,
                             backward: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """d(layer input) [1, T, C] of attention layer `spec.layer` over this rank's shard (read_input(a, b): the
    layer's input of local tokens [a, b); chunks: lockstep.ShardChunks, each per-chunk loop followed by the
    schedule's dummy chunks); parameter gradients accumulate, and every rank's gradient pages of the layer get every
    prompt query's dK/dV."""
    layer = spec.layer
    spans = chunks.spans
    pool = state.pool
    zero = torch.zeros(1, 1, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)
    heads, _, dim = adapter.attention_geometry()
    # (0) the shard's queries and its merged attention
    with torch.no_grad():
        queries = [adapter.attention_project(layer, adapter.mixer_input(layer, read_input(a, b)), position)[0]
                   for a, b, position in spans]
        for _ in chunks.dummies():
            adapter.attention_project(layer, adapter.mixer_input(layer, zero), 0)
        results = _kept(state, spec, spans) or shard_attention(adapter, spec, queries, spans, cp, pieces, pool,
                                                                chunk)
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
    dq = _attention_grads(adapter, spec, state, spans, cp, pieces, chunk, queries, results, d_outs)
    del results, d_outs, queries
    # (3) the input side: (q, K, V) of each chunk with their complete gradients
    for (a, b, position), d_query in zip(spans, dq, strict=True):
        rows = [pool.read_grad(layer, s.name, a, b) if s.grad else None for s in spec.streams]
        d_x[:, a:b] += _input_side(adapter, layer, read_input(a, b), position, (d_query, None, *rows), backward)
    for _ in chunks.dummies():
        _input_side(adapter, layer, zero, 0, None, backward)
    return d_x


def _kept(state: PrefixState, spec: LayerState, spans: Sequence[tuple[int, int, int]]) -> list[Partial] | None:
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


def _attention_grads(adapter: CausalLMAdapter, spec: LayerState, state: PrefixState,
                     spans: Sequence[tuple[int, int, int]], cp: CPContext, pieces: Sequence[Sequence[tuple[int, int]]],
                     chunk: int, queries: Sequence[torch.Tensor], results: Sequence[Partial],
                     d_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """dq of every chunk of this rank's shard (accumulation precision), with dK/dV of this rank's keys from its own
    queries and from every other rank's added to its gradient pages."""
    layer, pool = spec.layer, state.pool
    scale = adapter.attention_scale(layer)
    acc = _acc(adapter.dtype)
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

    def __init__(self, cp: CPContext, pieces: Sequence[Sequence[tuple[int, int]]], chunk: int,
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
