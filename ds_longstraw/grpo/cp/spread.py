"""Replay spread over the CP group ("cp_replay": "spread"): each rank replays (and scores) its own share of the
members instead of every member.

Member m is replayed by rank m mod N (`spread_members`). Everything of a response but its attention over the prompt
is then done once instead of N times. The prompt's pages stay where capture put them, so at each attention layer:

  forward   the ranks' queries are all-gathered (each rank brings its own block's, of its own length); each rank
            computes every rank's queries against its own pages (the replicated schedule's per-rank piece:
            PagesAttention.own_partial, SparsePagesAttention.own_candidates / own_partial); the partials travel
            back to each query's owner by all-to-all, where they merge in rank order (the same order as the
            replicated schedule's all-gathered merge, hence the same bits)
  backward  each owner's (d_out, lse, delta) are all-gathered with its queries; every rank computes its pages'
            share of d(query) for all of them (adding d(pages) to its own gradient pages in exact mode: complete
            once every rank has run) and the shares travel back to the owners by all-to-all, summed in rank order.
A GLM layer that selects does the same with its selectors: candidates come back to the owner and merge into its
global top-k. Recurrent layers exchange nothing: every rank holds the prompt's final carry.

The ranks' calls must pair up: a rank with fewer members or blocks pads with dummy ones (lockstep.Lockstep over the
CP group, `replay_lockstep`), whose queries travel like real ones and whose results are thrown away.
SpreadPagesAttention wraps the replicated PagesAttention ("lse" layers), SpreadSparsePagesAttention the replicated
SparsePagesAttention ("topk_lse"); which one is chosen where the replay view is made
(topology.ContextParallel.replay_view; the interfaces they rely on: ../interfaces.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ds_longstraw.grpo.cp.cp_attention import merge_in_order, remote_pages_attention
from ds_longstraw.grpo.cp.cp_sparse import merge_partials_as, merge_rank_candidates, selected_rows_attention
from ds_longstraw.grpo.interfaces import OwnPages, OwnSparsePages
from ds_longstraw.kernels.attention import attention_delta

if TYPE_CHECKING:
    from ds_longstraw.grpo.interfaces import Partial
    from ds_longstraw.parallel.groups import CPContext


def spread_members(count: int, size: int, rank: int) -> list[int]:
    """The members rank `rank` of `size` replays: m with m mod size == rank."""
    return list(range(rank, count, size))


def _sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class SpreadPagesAttention:
    """remote_attention of "lse" layers when each rank replays its own members (see the module docstring);
    `pages` is the replicated schedule's PagesAttention, whose per-rank pieces it calls."""

    keys = None  # one request per layer (interfaces.RemoteAttention)

    def __init__(self, pages: OwnPages) -> None:
        self.pages, self.cp = pages, pages.cp
        self.stager = pages.stager  # what the replay's leaves close

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
        return remote_pages_attention(self, layer, q_HTD, known)

    def forward(self, layer: int, q_HTD: torch.Tensor) -> Partial:
        (q_all,), counts = self.cp.gather_tokens((q_HTD,), 1, layer, "spread_q")
        out, lse = self.pages.own_partial(layer, q_all)
        outs = self.cp.return_tokens(out, counts, 1, layer, "spread_out")
        lses = self.cp.return_tokens(lse, counts, 1, layer, "spread_lse")
        return merge_in_order(list(zip(outs, lses, strict=True)))

    def backward(self, layer: int, q_HTD: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                 dlse_HT: torch.Tensor | None) -> torch.Tensor:
        delta = attention_delta(out, dout_HTD, dlse_HT)
        (q_all, dout_all, lse_all, delta_all), counts = self.cp.gather_tokens(
            (q_HTD, dout_HTD.to(q_HTD.dtype), lse, delta.to(lse.dtype)), 1, layer, "spread_backward")
        dq = self.pages.own_grads(layer, q_all, lse_all, dout_all, delta_all)
        return _sum_in_order(self.cp.return_tokens(dq, counts, 1, layer, "spread_dq"))

    def close(self) -> None:
        self.pages.close()


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
        all_scores = self.cp.return_tokens(scores, counts, 0, layer, "spread_candidate_scores")
        all_positions = self.cp.return_tokens(positions, counts, 0, layer, "spread_candidates")
        return merge_rank_candidates(self.adapter, all_scores, all_positions)

    def attend(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
               valid: torch.Tensor) -> Partial:
        return selected_rows_attention(self, layer, query, positions, valid)

    def _full_width(self, layer: int, positions: torch.Tensor,
                    valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection widened to topk columns (invalid slots): a block's width, min(topk, position + 1), differs
        between ranks (a padded member of one token at position 0 on one, a real block on another), and the
        gather's rows must be alike everywhere."""
        extra = self.adapter.sparse_geometry(layer).topk - positions.shape[1]
        return F.pad(positions, (0, extra)), F.pad(valid, (0, extra), value=False)

    def partials(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
                 valid: torch.Tensor) -> Partial:
        positions, valid = self._full_width(layer, positions, valid)
        (*q_all, pos_all, valid_all), counts = self.cp.gather_tokens((*query, positions, valid), 0, layer,
                                                                     "spread_query")
        out, lse = self.pages.own_partial(layer, tuple(q_all), pos_all, valid_all)
        outs = self.cp.return_tokens(out, counts, 0, layer, "spread_out")
        lses = self.cp.return_tokens(lse, counts, 0, layer, "spread_lse")
        return merge_partials_as(self.adapter.sparse_geometry(layer), list(zip(outs, lses, strict=True)))

    def partial_grads(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor, valid: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor,
                      d_lse: torch.Tensor | None) -> list[torch.Tensor]:
        delta = attention_delta(out, d_out, d_lse)
        positions, valid = self._full_width(layer, positions, valid)
        wire = (*query, positions, valid, lse, d_out.to(out.dtype), delta.to(lse.dtype))
        (*gathered, lse_all, d_out_all, delta_all), counts = self.cp.gather_tokens(wire, 0, layer, "spread_backward")
        q_all, (pos_all, valid_all) = tuple(gathered[: len(query)]), gathered[len(query):]
        shares = self.pages.own_grads(layer, q_all, pos_all, valid_all, lse_all, d_out_all, delta_all)
        return [_sum_in_order(self.cp.return_tokens(share, counts, 0, layer, "spread_dq")) for share in shares]

    def close(self) -> None:
        self.pages.close()


def gather_members(cp: CPContext, values: Sequence[Any], members: Sequence[int], count: int) -> list[Any]:
    """Per-member values (a list in `members` order) from every rank, as one list in member order (objects: the
    log-prob tensors each rank replayed)."""
    gathered = [None] * cp.size
    torch.distributed.all_gather_object(gathered, list(zip(members, values, strict=True)), group=cp.process_group)
    ordered = [None] * count
    for pairs in gathered:
        for member, value in pairs:
            ordered[member] = value
    return ordered
