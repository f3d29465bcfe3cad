"""The "lse" layer kind: attention over pages, partials of key shards merged by log-sum-exp.

ring.py          (out, lse) partials across ranks: capture (pages or queries travel), replay (all-gather), grads
ulysses.py       the capture's head/sequence all-to-all alternative (cp_attention "ulysses")
layer_major.py   one attention layer's step in exact mode's layer-major prefix pass
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.cp.kinds.attention.layer_major import (
    attention_layer_backward,
    attention_rows_backward,
    kept_partials,
)
from ds_longstraw.grpo.cp.kinds.attention.ring import (
    PagesAttention,
    accumulation_dtype,
    capture_attention_layer,
    finish_dummies,
    project_chunks,
    shard_attention,
    streamed_grads,
    streamed_partial,
)
from ds_longstraw.grpo.cp.kinds.attention.spread import SpreadPagesAttention
from ds_longstraw.grpo.cp.kinds.attention.ulysses import ulysses_attention_layer
from ds_longstraw.grpo.cp.kinds.base import (
    BACKWARD,
    FORWARD,
    CaptureFrame,
    LayerKind,
    LayerMajorFrame,
    PageRequest,
    Selection,
    register_kind,
)

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import Stager
    from ds_longstraw.parallel.groups import CPContext


class AttentionKind(LayerKind):
    name = "lse"

    def capture(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> torch.Tensor:
        if frame.longstraw.cp_attention == "ulysses":
            return ulysses_attention_layer(frame, spec, normed)
        return capture_attention_layer(frame, spec, normed)

    def capture_rows(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> None:
        """K/V of the shard onto its pages, chunk by chunk (the dummy chunks' projections too, results dropped):
        no queries travel and no pages, in either cp_attention."""
        project_chunks(frame.adapter, spec, normed, frame.chunks, frame.state.pool)

    def forward(self, frame: LayerMajorFrame, spec: LayerState, normed: torch.Tensor,
                selection: Selection | None) -> tuple[list[torch.Tensor], Selection | None]:
        adapter, spans = frame.adapter, frame.chunks.spans
        queries, gates, dummies = project_chunks(adapter, spec, normed, frame.chunks)
        results = kept_partials(frame.state, spec, spans) or shard_attention(frame, spec, queries)
        mixed = [adapter.attention_finish(spec.layer, out, gate) for (out, _), gate in zip(results, gates, strict=True)]
        finish_dummies(adapter, spec.layer, dummies)
        return mixed, selection

    def backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 d_hidden: torch.Tensor) -> torch.Tensor:
        return attention_layer_backward(frame, spec, read_input, d_hidden)

    def rows_backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                      d_hidden: torch.Tensor) -> torch.Tensor:
        return attention_rows_backward(frame, spec, read_input, d_hidden)

    def answer(self, cp: CPContext, adapter: CausalLMAdapter, stager: Stager, chunk: int,
               request: PageRequest) -> None:
        """FORWARD: the partial of the owner's queries over these pages; BACKWARD: dq back, dK/dV onto this rank's
        gradient pages, streamed page by page."""
        layer, owner, tq = request.layer, request.owner, request.tokens
        spec = adapter.specs[layer]
        heads, _, dim = adapter.attention_geometry()
        dtype, device = adapter.dtype, adapter.device
        acc = accumulation_dtype(dtype)
        scale = adapter.attention_scale(layer)
        q = cp.recv((heads, tq, dim), dtype, owner, layer, "prefix_q", device=device)
        if request.op == FORWARD:
            out, lse = streamed_partial(stager, spec, q, scale, end=request.end, query_chunk=chunk)
            cp.send(out, owner)
            cp.send(lse.to(acc), owner)
        elif request.op == BACKWARD:
            dout = cp.recv((heads, tq, dim), dtype, owner, layer, "prefix_dout", device=device)
            lse, delta = cp.recv((2, heads, tq), acc, owner, layer, "prefix_lse_delta", device=device)
            dq = streamed_grads(stager, spec, q, lse, dout, delta, scale, stager.pool, end=request.end)
            cp.send(dq, owner)
        else:
            super().answer(cp, adapter, stager, chunk, request)

    def replay_pages(self, cp: CPContext, state: PrefixState, adapter: CausalLMAdapter, prefix_grad: str,
                     spread: bool) -> PagesAttention | SpreadPagesAttention:
        pages = PagesAttention(cp, state.pool, adapter, grads_to_pages=prefix_grad == "exact")
        return SpreadPagesAttention(pages) if spread else pages


ATTENTION = register_kind(AttentionKind())
