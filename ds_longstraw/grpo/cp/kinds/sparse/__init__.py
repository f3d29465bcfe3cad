"""The "topk_lse" layer kind: sparse attention over a global top-k selection (DSA). The ranks' candidates merge into
one top-k in canonical order, then the selected rows' partials merge by log-sum-exp; a layer that selects nothing
reuses the last selection made below it.

selection.py     the selection's and the partials' exchanges: capture, replay (SparsePagesAttention), the turns
layer_major.py   one sparse layer's step in exact mode's layer-major prefix pass (Selections: what each layer attends)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.cp.kinds.base import (
    BACKWARD,
    FORWARD,
    SELECT,
    CaptureFrame,
    LayerKind,
    LayerMajorFrame,
    PageRequest,
    Selection,
    register_kind,
)
from ds_longstraw.grpo.cp.kinds.sparse.layer_major import sparse_layer_backward, sparse_rows_backward
from ds_longstraw.grpo.cp.kinds.sparse.selection import (
    SparsePagesAttention,
    answer_candidates,
    answer_grads,
    answer_partial,
    capture_sparse_layer,
    capture_sparse_rows,
)
from ds_longstraw.grpo.cp.kinds.sparse.spread import SpreadSparsePagesAttention

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import Stager
    from ds_longstraw.parallel.groups import CPContext


class SparseKind(LayerKind):
    name = "topk_lse"

    def capture(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> torch.Tensor:
        mixed, frame.selection = capture_sparse_layer(frame, spec, normed, frame.selection)
        return mixed

    def capture_rows(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> None:
        """The shard's rows (latent, rope key, and on a selecting layer the indexer key) onto its pages, chunk by
        chunk (the dummy chunks' projections too, results dropped): no selection, no partials, no exchange."""
        capture_sparse_rows(frame, spec, normed)

    def forward(self, frame: LayerMajorFrame, spec: LayerState, normed: torch.Tensor,
                selection: Selection | None) -> tuple[list[torch.Tensor], Selection | None]:
        out, selection = capture_sparse_layer(frame, spec, normed, selection, append=False)
        return [out], selection

    def backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 d_hidden: torch.Tensor) -> torch.Tensor:
        return sparse_layer_backward(frame, spec, read_input, d_hidden)

    def rows_backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                      d_hidden: torch.Tensor) -> torch.Tensor:
        return sparse_rows_backward(frame, spec, read_input, d_hidden)

    def answer(self, cp: CPContext, adapter: CausalLMAdapter, stager: Stager, chunk: int,
               request: PageRequest) -> None:
        """SELECT: candidates from the pages [0, end), every key of which precedes the owner's piece; FORWARD and
        BACKWARD: the selected rows' partial and its gradients."""
        spec = adapter.specs[request.layer]
        if request.op == SELECT:
            answer_candidates(cp, request.owner, adapter, stager, spec, [(request.tokens, request.end)])
        elif request.op == FORWARD:
            answer_partial(cp, request.owner, adapter, stager, spec, request.tokens)
        elif request.op == BACKWARD:
            answer_grads(cp, request.owner, adapter, stager, spec, request.tokens)
        else:
            super().answer(cp, adapter, stager, chunk, request)

    def replay_pages(self, cp: CPContext, state: PrefixState, adapter: CausalLMAdapter, prefix_grad: str,
                     spread: bool) -> SparsePagesAttention | SpreadSparsePagesAttention:
        pages = SparsePagesAttention(cp, state.pool, adapter, state.length,
                                     grads_to_pages=prefix_grad == "exact")
        return SpreadSparsePagesAttention(pages) if spread else pages


SPARSE = register_kind(SparseKind())
