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
Each layer kind wraps its replicated view: kinds/attention/spread.py's SpreadPagesAttention the replicated
PagesAttention ("lse" layers), kinds/sparse/spread.py's SpreadSparsePagesAttention the replicated
SparsePagesAttention ("topk_lse"), as the kind's replay_pages says (the interfaces they rely on: ../interfaces.py).
Here: who replays which member, and the members' results gathered back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_longstraw.parallel.groups import CPContext


def spread_members(count: int, size: int, rank: int) -> list[int]:
    """The members rank `rank` of `size` replays: m with m mod size == rank."""
    return list(range(rank, count, size))


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
