"""Replay over the whole prompt's pages, gathered on every rank ("cp_replay": "gathered"; "auto" where they are small).

The spread replay (spread.py) leaves the pages where capture put them, so every attention layer of every replayed
block exchanges queries and partials with every rank (a sparse layer also its selection's candidates): about nine
collectives per layer and block, and the merges of the ranks' partials. Where the whole prompt's pages are small
(a short prompt in a job sized for long ones: offload/auto.replay_schedule), it is cheaper to move the pages once:

  gather    every rank's replay streams, one all-gather per paged layer (CPContext.gather_tokens packs a token's
            rows of the layer's streams as one row of bytes), laid out in prompt order on a device pool of the
            whole prompt (`GatheredPages.pool`), bit for bit what each rank captured
  replay    rank r replays its own members (m mod N = r, as spread) exactly as one process does: the prompt's pages
            are local (replay.prefix_leaves), no exchange per layer or block
  return    exact mode: the pages' gradients this rank's members left on the gathered pool are summed over the group
            by one reduce-scatter per paged layer, laid out rank-major so that each rank receives only its own
            rows, which it adds to its gradient pages, where the prefix pass reads them (as the spread replay's
            page shares land there); return_grads_reference is the plain all-reduce form

The carry of recurrent layers is every rank's already (the capture's scan ends on all ranks). What is gathered is
freed when the replay's view is released (ReplayView.release). A sum over ranks of d(pages) re-associates the
float64 sums of the spread schedule, nothing more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch.specs import stream_names
from ds_longstraw.grpo.replay import PrefixLeaves, prefix_leaves
from ds_longstraw.grpo.state import PrefixState
from ds_longstraw.offload.pages import PagePool
from ds_longstraw.parallel.groups import local_tokens

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.parallel.groups import CPContext, PromptShards


def shard_positions(pieces: PromptShards) -> list[torch.Tensor]:
    """Per rank, the prompt positions of its shard in its local order: what gather_tokens concatenates in rank
    order, and how each rank's pool holds its rows."""
    positions = torch.arange(sum(pieces.sizes))
    return [local_tokens(positions, own) for own in pieces]


def prompt_order(pieces: PromptShards) -> torch.Tensor:
    """For each prompt position, its row among the ranks' shards concatenated in rank order (each in local order):
    the index that lays gathered rows out in prompt order (the inverse of shard_positions concatenated)."""
    positions = torch.cat(shard_positions(pieces))
    order = torch.empty_like(positions)
    order[positions] = torch.arange(positions.numel())
    return order


class GatheredPages:
    """The whole prompt's replay pages of every paged layer on this rank (gathered once from the CP group), and
    in exact mode the return of their gradients to the ranks that own the rows."""

    def __init__(self, cp: CPContext, adapter: CausalLMAdapter, state: PrefixState, prefix_grad: str) -> None:
        """Collective over the CP group: every rank gathers at once."""
        self.cp, self.state, self.exact = cp, state, prefix_grad == "exact"
        self.pieces = cp.pieces(state.length)
        self.layers = stream_names(adapter.specs)  # layer -> its streams' names
        self.grads = {(spec.layer, stream.name) for spec in adapter.specs for stream in spec.streams if stream.grad}
        self.pool = PagePool(state.pool.page_tokens, device=state.pool.device, rank=cp.rank,
                             staging_depth=state.pool.staging_depth)
        order = prompt_order(self.pieces).to(state.pool.device)
        # a layer at a time (its streams in one collective): what is in flight beside the pool is one layer's
        for layer, names in self.layers.items():
            local = tuple(state.pool.read(layer, name) for name in names)
            whole, _ = cp.gather_tokens(local, 0, layer, "gather_pages")
            for name, rows in zip(names, whole, strict=True):
                self.pool.reserve(layer, name, state.length, rows.shape[1:], rows.dtype)
                self.pool.append(layer, name, rows.index_select(0, order))
        # the state replay reads: the whole prompt's pages, the carry every rank holds
        self.view = PrefixState(length=state.length, pool=self.pool, specs=state.specs, carry=state.carry)

    def leaves(self, adapter: CausalLMAdapter, prefix_grad: str) -> PrefixLeaves:
        """Replay's view of the gathered state, as one process's (exact mode: page gradients on self.pool)."""
        return prefix_leaves(adapter, self.view, prefix_grad)

    def release(self) -> None:
        """Exact mode: the gradients of every rank's members summed, this rank's rows added to its own gradient
        pages (collective over the CP group: every rank releases at the same point); then the gathered pages go."""
        try:
            if self.exact:
                self._return_grads()
        finally:
            self.pool.release()

    def _return_grads(self) -> None:
        # Every rank's rows in rank order, each shard padded to the largest (the pad row, index length, is zero):
        # one reduce-scatter per layer then leaves each rank the sum of its own rows, in its local order.
        rows = self._rank_major_rows()
        for layer, names in self.layers.items():
            names = [name for name in names if (layer, name) in self.grads]
            if not names:
                continue
            grads = [self.pool.read_grad(layer, name) for name in names]
            # widened to float32 at least: bf16 pages' gradients summed in bf16 would lose what each rank's own
            # accumulation kept
            dtype = torch.float32
            for grad in grads:
                dtype = torch.promote_types(dtype, grad.dtype)
            flat = torch.cat([grad.reshape(grad.shape[0], math.prod(grad.shape[1:])).to(dtype) for grad in grads], 1)
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])  # the pad row
            mine = self.cp.reduce_scatter(flat.index_select(0, rows), layer, "return_page_grads")
            at, tokens = 0, self.pieces.tokens
            for name, grad in zip(names, grads, strict=True):
                width = math.prod(grad.shape[1:])
                if tokens:
                    self.state.pool.add_grad(layer, name, 0, mine[:tokens, at: at + width].reshape(tokens,
                                                                                                   *grad.shape[1:]))
                at += width

    def _rank_major_rows(self) -> torch.Tensor:
        """[size * largest] prompt positions: each rank's in its local order, padded with `length` (the pad row)."""
        largest, pad = self.pieces.largest, self.state.length
        padded = [torch.cat([own, own.new_full((largest - own.numel(),), pad)]) for own in shard_positions(self.pieces)]
        return torch.cat(padded).to(self.pool.device)


def return_grads_reference(cp: CPContext, gathered: GatheredPages) -> None:
    """The plain form of GatheredPages._return_grads: each stream's gradient over the whole prompt all-reduced,
    this rank's pieces' rows added at their local starts (tests hold the reduce-scatter to it)."""
    starts = gathered.pieces.starts
    for layer, names in gathered.layers.items():
        for name in names:
            if (layer, name) not in gathered.grads:
                continue
            summed = gathered.pool.read_grad(layer, name).to(torch.float64).clone()
            cp.all_reduce_(summed, layer, "return_page_grads")
            for (lo, hi), start in zip(gathered.pieces.mine, starts, strict=False):
                if hi > lo:
                    gathered.state.pool.add_grad(layer, name, start, summed[lo:hi])
