"""What replay's attention reaches on other ranks: the remote-attention interfaces of the transaction.

Under context parallelism the prompt's pages stay on the ranks that captured them, so replay (and scoring, and
decoding) has no local prompt pages: each layer's attention over the prompt goes through the replay view's
`remote_attention` (topology.ReplayView), which forward_segment hands to the adapter's layers. What it offers
depends on how the model's layers combine across ranks (arch/specs.py), and which one a view holds is chosen where
the view is made (topology.ContextParallel.replay_view):

  RemoteAttention  "lse" layers: (layer, q_HTD, known=None) -> (out, lse) of the queries over the other ranks'
                   keys (with `known`, the merged result passed through and the remote share of the gradients
                   added in backward); `keys`: None, or (the prefix pass's turns) the request in two halves
                   that the adapter overlaps with its local attention (grpo/cp/prefix.RemoteKeys)
  RemoteSelection  "topk_lse" layers: candidates(layer, selector) of a global top-k selection, then
                   attend(layer, query, positions, valid) -> (out, lse) of the selected rows; `end`: where the
                   remote keys end (the adapter's own past starts there)
Both hold the `stager` through which this rank reads its own pages (closed with the replay's leaves) and close().

A spread replay (grpo/cp/spread.py) wraps the replicated schedule's pages and asks them for this rank's share
only: OwnPages ("lse") and OwnSparsePages ("topk_lse").
"""

from collections.abc import Callable
from typing import Any, Protocol

import torch

Partial = tuple[torch.Tensor, torch.Tensor]  # (out, lse)


class RemoteAttention(Protocol):
    """remote_attention of "lse" layers (grpo/cp/cp_attention.PagesAttention, spread.SpreadPagesAttention,
    prefix.RemotePages, prefix.PageServer)."""

    keys: Callable[[int], Any] | None  # None, or layer -> a request in two halves (prefix.RemoteKeys)

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial: ...


class RemoteSelection(Protocol):
    """remote_attention of "topk_lse" layers (cp_sparse.SparsePagesAttention, spread.SpreadSparsePagesAttention,
    prefix.RemotePages, prefix.PageServer)."""

    end: int  # the remote keys are positions [0, end); the adapter's own past starts there

    def candidates(self, layer: int, selector: tuple) -> Partial | None: ...

    def attend(self, layer: int, query: tuple, positions: torch.Tensor, valid: torch.Tensor) -> Partial: ...


class ReplayPages(Protocol):
    """What a replay view's remote attention is besides RemoteAttention or RemoteSelection: its own pages' stager,
    closed by the replay's leaves (replay.PrefixLeaves.release), and close()."""

    stager: Any

    def close(self) -> None: ...


class OwnPages(ReplayPages, Protocol):
    """This rank's pages' share of an "lse" layer's attention (cp_attention.PagesAttention), for a spread replay."""

    cp: Any  # parallel.groups.CPContext

    def own_partial(self, layer: int, q_HTD: torch.Tensor) -> Partial: ...

    def own_grads(self, layer: int, q_HTD: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                  delta: torch.Tensor) -> torch.Tensor: ...


class OwnSparsePages(ReplayPages, Protocol):
    """This rank's pages' share of a "topk_lse" layer's attention (cp_sparse.SparsePagesAttention), for a spread
    replay."""

    cp: Any
    adapter: Any
    end: int

    def own_candidates(self, layer: int, selector: tuple) -> Partial: ...

    def own_partial(self, layer: int, query: tuple, positions: torch.Tensor, valid: torch.Tensor) -> Partial: ...

    def own_grads(self, layer: int, query: tuple, positions: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor,
                  d_out: torch.Tensor, delta: torch.Tensor) -> list: ...
