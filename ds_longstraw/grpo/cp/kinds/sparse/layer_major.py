"""The layer-major prefix pass (prefix_layers.py) at a layer that attends a global top-k selection ("topk_lse").

At such a layer every rank holds d(layer output) for its own tokens and the layer's input over its shard, and
produces d(layer input), all ranks at once, as the capture runs the layer (cp_sparse.capture_sparse_layer):
  selection  the layer's selection, recomputed without a graph: a selecting layer's from its own input (the
             capture's candidate exchange, every rank client and server); a layer that reuses one takes the
             selection of the selecting layer below it, computed once on the way down (`Selections`) and kept
             until that layer is passed. The indexer takes no gradient, so nothing of it is differentiated.
  forward    the queries and the merged (out, lse) over every rank's selected rows (the capture's exchange).
  output     chunk by chunk with autograd from the leaf out: y = mlp_residual(x + finish(out)): d(out), and
             d(input) through the residual and the MLP (the absorbed W_UV recomputed with its graph).
  backward   every rank's queries at once: the rows of this rank locally, the others' at their owners, which add
             d(rows) to their gradient pages and send the d(query) shares back (delta = rowsum(d_out * out), the
             ring-attention form; the output's lse takes no gradient).
  input      once every rank's pages hold every contribution (replay's and every prompt query's), each chunk
             back-propagates its projections (the query and its rows) with autograd: d(input).
Nothing of the prompt's graph outlives one chunk of one layer. Held across the layer, beside d(output) and
d(input): the shard's queries, out and d(out) [T, H, R(+E)] with lse [T, H] and the selection [T, K].
Under ZeRO-3 (lockstep) each per-chunk loop is padded with one-token zero iterations (the capture's dummy chunks,
lockstep.ShardChunks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.arch.base import grad_leaf, grad_of, inject_gradients
from ds_longstraw.grpo.cp.kinds.sparse.selection import (
    _cat,
    answer_grads,
    collect_grads,
    exchange_all_at_once,
    key_stager,
    local_selection,
    row_stager,
    send_grad_requests,
    shard_partial,
    shard_selection,
    streamed_sparse_grads,
)
from ds_longstraw.grpo.cp.output_side import output_side
from ds_longstraw.grpo.interfaces import MergedGrad, Selected
from ds_longstraw.kernels.attention import attention_delta

if TYPE_CHECKING:
    from torch.distributed import Work

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.cp.kinds.base import LayerMajorFrame
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import Stager
    from ds_longstraw.parallel.groups import CPContext, PromptShards


class Selections:
    """The selections of the layer-major pass's "topk_lse" layers, walking the layers top to bottom. The one a layer
    attends is its own (a selecting layer) or that of the selecting layer below it: computed the first time a layer
    above needs it, from that layer's input (input_of(layer) -> read(a, b)), and dropped once that layer is done;
    where that layer lies below the group's base (prefix_inputs_every) and its input is not kept, the selection kept
    with the base's input (state.read_selection)."""

    def __init__(self, adapter: CausalLMAdapter, state: PrefixState, chunks: ShardChunks, cp: CPContext,
                 pieces: PromptShards,
                 input_of: Callable[[int], Callable[[int, int], torch.Tensor]], every: int = 1) -> None:
        self.adapter, self.state, self.chunks, self.cp, self.pieces = adapter, state, chunks, cp, pieces
        self.spans = chunks.spans
        self.input_of, self.every = input_of, every
        self.specs = {spec.layer: spec for spec in adapter.specs}
        self.made = {}

    def source(self, layer: int) -> int:
        """The selecting layer whose selection `layer` attends."""
        for below in range(layer, -1, -1):
            if self.specs[below].select:
                return below
        raise ValueError(f"layer {layer} reuses a selection, but no earlier layer selects")

    def of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, base = self.source(layer), layer - layer % self.every
        if source < base and source % self.every:  # made in a group below, from an input not kept: kept with the
            # base's input (state.selection_bases)
            if ("kept", base) not in self.made:
                self.made[("kept", base)] = self.state.read_selection(base)
            return self.made[("kept", base)]
        if source not in self.made:
            self.made[source] = self._select(self.specs[source])
        return self.made[source]

    def done(self, layer: int) -> None:
        """Drop what no layer at or below `layer` needs any more."""
        self.made.pop(layer, None)
        self.made.pop(("kept", layer), None)

    def _select(self, spec: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        adapter, layer = self.adapter, spec.layer
        read = self.input_of(layer)
        with torch.no_grad():
            selectors = [adapter.sparse_project(layer, adapter.mixer_input(layer, read(a, b)), position)[0]
                         for a, b, position in self.spans]
            _pad_projections(adapter, layer, self.chunks)
            keys = key_stager(self.state.pool, [spec])
            try:
                return shard_selection(self.cp, adapter, spec, keys, _cat(selectors) if selectors else None,
                                       self.spans, self.pieces)
            finally:
                keys.close()


def _zero(adapter: CausalLMAdapter) -> torch.Tensor:
    return torch.zeros(1, 1, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)


def _pad_projections(adapter: CausalLMAdapter, layer: int, chunks: ShardChunks) -> None:
    """The dummy chunks' projections (results discarded)."""
    for _ in chunks.dummies():
        adapter.sparse_project(layer, adapter.mixer_input(layer, _zero(adapter)), 0)


def sparse_layer_backward(frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                          dy_1TC: torch.Tensor) -> torch.Tensor:
    """d(layer input) [1, T, C] of "topk_lse" layer `spec.layer` over this rank's shard (read_input(a, b): the
    layer's input of local tokens [a, b); frame.chunks: each per-chunk loop followed by the schedule's dummy chunks;
    frame.selections: the pass's Selections); parameter gradients accumulate, and every rank's gradient pages of
    the layer get every prompt query's d(rows)."""
    adapter, cp, pieces, chunks, backward = frame.adapter, frame.cp, frame.pieces, frame.chunks, frame.backward
    selections = frame.selections
    layer, pool = spec.layer, frame.state.pool
    spans = chunks.spans
    positions, valid = selections.of(layer)
    rows = row_stager(pool, [spec])
    try:
        # (0) the shard's queries and their merged attention over every rank's selected rows
        with torch.no_grad():
            queries = [adapter.sparse_project(layer, adapter.mixer_input(layer, read_input(a, b)), position)[1]
                       for a, b, position in spans]
            _pad_projections(adapter, layer, chunks)
            geometry = adapter.sparse_geometry(layer)
            query = _cat(queries) if queries else None
            selected = Selected(query, positions, valid)
            out, lse = shard_partial(cp, adapter, spec, rows, selected, pieces)
        # (1) the output side: d(out), and d(input) through the residual and the MLP
        d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=dy_1TC.device)
        d_out = torch.zeros(out.shape, dtype=geometry.lse_dtype, device=out.device)
        for a, b, position in spans:
            d_part, d_x[:, a:b] = output_side(adapter, layer, read_input(a, b), position, out[a:b], dy_1TC[:, a:b],
                                              backward, _output_map)
            d_out[a:b] = d_part
        for _ in chunks.dummies():
            output_side(adapter, layer, _zero(adapter), 0, out.new_zeros((1, *out.shape[1:])), _zero(adapter),
                        backward, _output_map)
        # (2) the attention's backward, every rank's queries at once: d(query) here, d(rows) at their owners
        d_query = _sparse_grads(frame, spec, rows, selected, MergedGrad(lse, d_out, attention_delta(out, d_out, None)))
    finally:
        rows.close()
    del out, d_out
    # (3) the input side: the query and the rows of each chunk with their complete gradients
    _input_sides(frame, spec, read_input, d_query, d_x)
    return d_x


def sparse_rows_backward(frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                         dy_1TC: torch.Tensor) -> torch.Tensor:
    """sparse_layer_backward of a layer whose output over the prompt feeds nothing (the pass's top layer; dy_1TC is
    zero and only its shape is read): step (3) alone, its rows' gradients on the gradient pages (the replay's, the
    only queries that read them with a gradient) through their projections. No selection, attention or exchange:
    the whole step's other terms are zero there."""
    d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=dy_1TC.device)
    _input_sides(frame, spec, read_input, None, d_x)
    return d_x


def _input_sides(frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 d_query: Sequence[torch.Tensor] | None, d_x: torch.Tensor) -> None:
    """Step (3): each chunk's query and rows back-propagated with their gradients (d_query: the shard's, per query
    part; None: zero; the rows' from the gradient pages), d(input) added to d_x; then the dummy chunks' zero
    iterations."""
    adapter, chunks, backward, pool, layer = frame.adapter, frame.chunks, frame.backward, frame.state.pool, spec.layer
    for a, b, position in chunks.spans:
        grads = [pool.read_grad(layer, s.name, a, b) if s.grad else None for s in spec.streams]
        if d_query is None:
            d_x[:, a:b] += _input_side(adapter, layer, read_input(a, b), position, grads, backward, rows_only=True)
        else:
            injected = [d[a:b] for d in d_query] + grads
            d_x[:, a:b] += _input_side(adapter, layer, read_input(a, b), position, injected, backward)
    for _ in chunks.dummies():
        _input_side(adapter, layer, _zero(adapter), 0, None, backward)


def _output_map(adapter: CausalLMAdapter, layer: int, mixed: torch.Tensor, position: int) -> Any:
    return adapter.sparse_project(layer, mixed, position)[2]


def _input_side(adapter: CausalLMAdapter, layer: int, x_1TC: torch.Tensor, position: int,
                injected: list[torch.Tensor | None] | None,
                backward: Callable[[torch.Tensor], Any] | None, rows_only: bool = False) -> torch.Tensor:
    """d x of the chunk's query and rows given their gradients (None: a lockstep zero iteration; rows_only: the
    rows' alone, the query's zero); the indexer's outputs take none, as the model defines it."""
    x = grad_leaf(x_1TC)
    with torch.enable_grad():
        _, query, _, rows = adapter.sparse_project(layer, adapter.mixer_input(layer, x), position)
        roots = [*query, *rows]
        if rows_only:
            injected = [None] * len(query) + list(injected)
        inject_gradients(roots, (injected or []) + [None] * (len(roots) - len(injected or [])), backward)
    return grad_of(x)


def _sparse_grads(frame: LayerMajorFrame, spec: LayerState, rows: Stager, selected: Selected,
                  merged: MergedGrad) -> list[torch.Tensor]:
    """d(query) of this rank's shard: its own rows' share locally, every other owner's by the exchange (every rank
    client and server at once); each owner adds its rows' gradients to its gradient pages."""
    adapter, cp, pieces, layer = frame.adapter, frame.cp, frame.pieces, spec.layer

    def post(servers: list[int], works: list[Work]) -> None:
        if selected.query is not None:
            send_grad_requests(cp, adapter.sparse_geometry(layer), selected, merged, pieces, servers, works)

    def collect(servers: list[int]) -> list[torch.Tensor]:
        if selected.query is None:
            return []
        own = streamed_sparse_grads(rows, adapter, spec, local_selection(selected, pieces.mine), merged,
                                    rows.pool)
        return collect_grads(cp, adapter, layer, selected.query, servers, own)

    return exchange_all_at_once(
        cp, pieces, post,
        lambda j, works: answer_grads(cp, j, adapter, rows, spec, pieces.size(j), works),
        collect)
