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
The top layer's output feeds nothing (d(output) = 0): it runs its kind's rows_backward, its state's gradients through
their projections alone, without the attention, its exchanges or the MLP. Finally the embedding gets d(layer 0
input). Nothing of the prompt's graph outlives one chunk of one layer.

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
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch.base import inject_gradients
from ds_longstraw.grpo.cp.capture import mlp_over_chunks
from ds_longstraw.grpo.cp.kinds import LayerMajorFrame, kind_of
from ds_longstraw.grpo.cp.kinds.sparse.layer_major import Selections
from ds_longstraw.grpo.cp.kinds.sparse.selection import uses_selection
from ds_longstraw.grpo.lockstep import Schedule
from ds_longstraw.grpo.state import INPUT_STREAM
from ds_longstraw.offload import make_pool
from ds_longstraw.parallel.groups import local_spans

if TYPE_CHECKING:
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.prefix_pass import ReversePass
    from ds_longstraw.offload import PagePool
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext


def layer_major_prefix_backward(reverse: ReversePass, d_final_carry: Mapping[int, Sequence[torch.Tensor]],
                                cp: CPContext, longstraw: LongstrawConfig, schedule: Schedule | None = None) -> None:
    """Exact-mode prefix pass of this rank's shard, all ranks layer by layer (see the module docstring).

    reverse.ids: this rank's shard of prompt[:-1] in local order; d_final_carry: layer -> d(prompt's final carry)
    from replay; settings: the transaction's (segment_tokens: the capture's chunks; prefix_inputs_every: which
    layers' inputs capture kept; offload: the tier of the recomputed ones). Parameter gradients of this rank's
    tokens accumulate into .grad; the caller reduces them. reverse.backward: as prefix_pass.ReversePass's;
    schedule: the transaction's (None: no padding), whose chunks(spans) every per-chunk loop walks (the capture's
    dummy chunks under a Lockstep)."""
    adapter, state, ids, backward = reverse.adapter, reverse.state, reverse.ids, reverse.backward
    chunk, every = longstraw.segment_tokens, longstraw.prefix_inputs_every
    pieces = cp.pieces(state.length)
    spans = local_spans(pieces.mine, chunk)
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
    frame = LayerMajorFrame(adapter, longstraw, cp, pieces, chunks, state, backward=backward, selections=selections,
                            d_final_carry=d_final_carry)
    try:
        for spec in reversed(adapter.specs):
            layer = spec.layer
            base = layer - layer % every
            if layer == base:
                read_input = partial(state.read_layer_input, layer)  # (a, b) -> [1, b - a, C] from the tier
            else:
                if group is None:  # the group's top layer: its inputs recomputed from the base's, once
                    group = recompute_inputs(frame, base, layer)
                    inputs["group"] = group
                read_input = partial(_read_group, group, layer)
            if spec is adapter.specs[-1]:  # its output feeds nothing: what its state's gradients reach alone
                d_hidden = kind_of(spec).rows_backward(frame, spec, read_input, d_hidden)
            else:
                d_hidden = kind_of(spec).backward(frame, spec, read_input, d_hidden)
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


def recompute_inputs(frame: LayerMajorFrame, base: int, top: int) -> PagePool | TieredPagePool:
    """The inputs of layers base + 1 .. top over this rank's shard, recomputed without a graph from layer base's
    (capture's) by the layers' own forward, with the exchanges their kind needs (every rank recomputes the same
    group at once), onto a pool of offload.tier that the caller releases (prefix_inputs_every). A base that reuses
    a selection ("topk_lse" layers) gets it from the pass's Selections."""
    adapter, state, longstraw = frame.adapter, frame.state, frame.longstraw
    pool = make_pool(longstraw.offload, longstraw.page_tokens, adapter.device, frame.cp.rank)
    try:
        hidden = state.read_layer_input(base)
        for layer in range(base + 1, top + 1):
            pool.reserve(layer, INPUT_STREAM, hidden.shape[1], (adapter.hidden_size,), adapter.dtype)
        # the selection the base reuses (None: it makes its own, or the family has none)
        selection = frame.selections.of(base) if adapter.specs[base].reuses_selection else None
        with torch.no_grad():
            for spec in adapter.specs[base:top]:
                hidden, selection = layer_forward(frame, spec, hidden, selection)
                pool.append(spec.layer + 1, INPUT_STREAM, hidden[0])
        pool.flush()
    except BaseException:
        pool.release()
        raise
    return pool


def layer_forward(frame: LayerMajorFrame, spec: LayerState, hidden_1TC: torch.Tensor,
                  selection: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(Layer `spec.layer`'s output over this rank's shard from its input, the last top-k selection), no graph, as
    the capture computes it but reading what the capture kept (its kind's forward: attention over the pages in
    place or the kept attention, GDN from each chunk's checkpointed carry, a "topk_lse" layer by the capture's
    exchanges with its own selection or `selection`, the last one made). frame.chunks: the capture's dummy chunks
    too."""
    adapter = frame.adapter
    normed = adapter.mixer_input(spec.layer, hidden_1TC)
    mixed, selection = kind_of(spec).forward(frame, spec, normed, selection)
    hidden = hidden_1TC + (torch.cat(mixed, 1) if mixed else torch.zeros_like(hidden_1TC))
    return mlp_over_chunks(adapter, spec.layer, hidden, frame.chunks), selection
