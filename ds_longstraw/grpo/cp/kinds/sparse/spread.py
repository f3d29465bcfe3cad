"""The "topk_lse" layers' replay spread (grpo/cp/spread.py says the schedule): selectors and queries of every rank
against every rank's pages by all-gather, candidates and partials back to their owners by all-to-all. Each exchange
carries all of its tensors in one collective (CPContext.gather_tokens, return_tokens_together)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds_longstraw.grpo.cp.kinds.attention.ring import sum_in_order
from ds_longstraw.grpo.cp.kinds.sparse.selection import (
    merge_partials_as,
    merge_rank_candidates,
    merged_grad,
    selected_rows_attention,
)
from ds_longstraw.grpo.interfaces import MergedGrad, Selected

if TYPE_CHECKING:
    from ds_longstraw.grpo.interfaces import OwnSparsePages, Partial


class SpreadSparsePagesAttention:
    """remote_attention of "topk_lse" layers when each rank replays its own members; `pages` is the replicated
    schedule's SparsePagesAttention."""

    def __init__(self, pages: OwnSparsePages) -> None:
        self.pages, self.cp, self.adapter = pages, pages.cp, pages.adapter
        self.end = pages.end
        self.stager = pages.stager

    def candidates(self, layer: int, selector: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        gathered, counts = self.cp.gather_tokens(tuple(selector), 0, layer, "spread_selector")
        scores, positions = self.pages.own_candidates(layer, gathered)
        all_scores, all_positions = self.cp.return_tokens_together((scores, positions), counts, 0, layer,
                                                                   "spread_candidates")
        return merge_rank_candidates(self.adapter, all_scores, all_positions)

    def attend(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
               valid: torch.Tensor) -> Partial:
        return selected_rows_attention(self, layer, query, positions, valid)

    def _full_width(self, layer: int, selected: Selected) -> Selected:
        """The selection widened to topk columns (invalid slots): a block's width, min(topk, position + 1), differs
        between ranks (a padded member of one token at position 0 on one, a real block on another), and the
        gather's rows must be alike everywhere."""
        query, positions, valid = selected
        extra = self.adapter.sparse_geometry(layer).topk - positions.shape[1]
        return Selected(query, F.pad(positions, (0, extra)), F.pad(valid, (0, extra), value=False))

    def partials(self, layer: int, selected: Selected) -> Partial:
        query, positions, valid = self._full_width(layer, selected)
        (*q_all, pos_all, valid_all), counts = self.cp.gather_tokens((*query, positions, valid), 0, layer,
                                                                     "spread_query")
        out, lse = self.pages.own_partial(layer, Selected(tuple(q_all), pos_all, valid_all))
        outs, lses = self.cp.return_tokens_together((out, lse), counts, 0, layer, "spread_partial")
        return merge_partials_as(self.adapter.sparse_geometry(layer), list(zip(outs, lses, strict=True)))

    def partial_grads(self, layer: int, selected: Selected, partial: Partial,
                      d_partial: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        lse, d_out, delta = merged_grad(partial, d_partial)
        query, positions, valid = self._full_width(layer, selected)
        wire = (*query, positions, valid, lse, d_out.to(partial[0].dtype), delta.to(lse.dtype))
        (*gathered, lse_all, d_out_all, delta_all), counts = self.cp.gather_tokens(wire, 0, layer, "spread_backward")
        q_all, (pos_all, valid_all) = tuple(gathered[: len(query)]), gathered[len(query):]
        shares = self.pages.own_grads(layer, Selected(q_all, pos_all, valid_all),
                                      MergedGrad(lse_all, d_out_all, delta_all))
        return [sum_in_order(by_rank)
                for by_rank in self.cp.return_tokens_together(tuple(shares), counts, 0, layer, "spread_dq")]

    def close(self) -> None:
        self.pages.close()
