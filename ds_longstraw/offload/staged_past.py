"""The captured prompt pages as attention's "past", staged one layer at a time, with autograd support.

`StagedPast` is the mapping the adapters read as `past[layer]` (a list of (K, V) token-major segments): the
prompt pages' segment is fetched from the stager only when a segment's forward reaches that layer, and later
segments (earlier replay blocks) are appended as plain tensors.

What stays alive, with a host or NVMe tier:
- forward: the stager's window (this layer and `depth` layers ahead);
- the autograd graph: NOT the staged pages. `saved_tensors` (the hooks below) replaces every saved tensor that
  shares storage with a live staged copy by a handle (layer, range, name, view geometry); backward re-stages
  the layer through the same stager when it needs it (walking the layers in reverse, reading ahead);
- backward: one layer's staged pages and its dK/dV at a time.
With the device tier the pages are views of storage that stays resident, and the hooks leave them alone.

Exact mode: the staged pair is a `PagesPair` whose `grad_sink` the attention kernel calls key block by key block
(d(pages) goes to `pool.add_grad`, the gradient pages, without a whole layer's dK/dV alive), and whose `row_sink` a
sparse attention calls with the selected rows only (`pool.add_grad_rows`: no dense page gradient); for any other
consumer each segment also goes through `_PagesWithGrad`, an identity whose backward hands d(pages) to the gradient
pages instead of accumulating it on a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .pages import PagePool
    from .stager import Stager
    from .tiered import TieredPagePool


class _PagesWithGrad(torch.autograd.Function):
    """Identity on staged pages; backward adds the incoming gradient to the pool's gradient pages (a kernel that
    took the pair's `grad_sink` sends nothing here)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, pages: torch.Tensor,
                sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # no zero page-sized gradient when the kernel used the sink
        return pages

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None]:
        if grad is not None:
            ctx.sink(grad)
        return None, None, None


class PagesPair(tuple):
    """A staged tuple of a layer's pages (K, V; or GLM's latent, rope key, indexer key) with two sinks that take
    the pages' gradient straight to the gradient pages instead of autograd carrying it whole:
    `grad_sink(offset, dk_KTD, dv_KTD)`, which a dense attention kernel calls one key block at a time (see
    kernels.attention_with_past's sinks), and `row_sink(rows, *grads)`, which a sparse attention calls with only
    the rows its queries selected (rows [u] ascending, from the pages' first token; grads [u, ...] of the first
    streams, in order: kernels/sparse_mla/selected_rows.py)."""

    def __new__(cls, pair: Iterable[torch.Tensor], grad_sink: Callable[[int, torch.Tensor, torch.Tensor], None],
                row_sink: Callable[..., None] | None = None) -> PagesPair:
        self = super().__new__(cls, pair)
        self.grad_sink = grad_sink
        self.row_sink = row_sink
        return self


def _block_sink(pool: PagePool | TieredPagePool, layer: int, names: Sequence[str],
                start: int) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    def sink(offset: int, dk_KTD: torch.Tensor, dv_KTD: torch.Tensor) -> None:
        for name, grad in zip(names, (dk_KTD, dv_KTD), strict=True):
            pool.add_grad(layer, name, start + offset, grad.transpose(0, 1))

    return sink


def _row_sink(pool: PagePool | TieredPagePool, layer: int, names: Sequence[str],
              start: int) -> Callable[..., None]:
    def sink(rows: torch.Tensor, *grads: torch.Tensor) -> None:
        for name, grad in zip(names, grads, strict=False):  # the first streams' gradients (not the indexer key's)
            pool.add_grad_rows(layer, name, start, rows, grad)

    return sink


def _grad_sink(pool: PagePool | TieredPagePool, layer: int, name: str,
               start: int) -> Callable[[torch.Tensor], None]:
    def sink(grad: torch.Tensor) -> None:
        pool.add_grad(layer, name, start, grad)

    return sink


class _AppendedSegments(Mapping):
    """What both pasts below share: layer -> segments, the layers being those with pages; segments appended after
    the pages (earlier replay blocks) with append(), none in a fresh() copy (one per replayed member). A copy
    shares the pages' parts, which nothing appends to."""

    _later: dict

    def __iter__(self) -> Iterator[int]:
        return iter(self._later)

    def __len__(self) -> int:
        return len(self._later)

    def append(self, layer: int, segment: Sequence[torch.Tensor]) -> None:
        self._later[layer].append(segment)

    def fresh(self) -> _AppendedSegments:
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy._later = {layer: [] for layer in self._later}
        return copy


class StagedPast(_AppendedSegments):
    """layer -> [(K, V) of prompt tokens [start, end) (staged on access), *segments appended later].

    grads_to_pages: the prompt segment is differentiable and its gradient lands on the pool's gradient pages
    (the transaction's exact mode). `fresh()` gives an independent copy of the appended segments (one per replayed
    member).
    """

    def __init__(self, stager: Stager, start: int, end: int, grads_to_pages: bool = False) -> None:
        self.stager = stager
        self.start, self.end = start, end
        self.grads_to_pages = grads_to_pages
        self._later = {layer: [] for layer in stager.layers}
        # Pages are constants of the graph; the anchor is the one input that makes _PagesWithGrad differentiable.
        self._anchor = torch.zeros((), requires_grad=True) if grads_to_pages else None

    def __getitem__(self, layer: int) -> list[Sequence[torch.Tensor]]:
        later = self._later[layer]  # KeyError for layers without pages, as a dict would
        names = self.stager.names[layer]
        pages = self.stager.get(layer, self.start, self.end)
        pair = tuple(pages[name] for name in names)
        if self.grads_to_pages and self.end > self.start:
            pool = self.stager.pool
            pair = tuple(_PagesWithGrad.apply(self._anchor, tensor, _grad_sink(pool, layer, name, self.start))
                         for name, tensor in zip(names, pair, strict=True))
            pair = PagesPair(pair, _block_sink(pool, layer, names, self.start),
                             _row_sink(pool, layer, names, self.start))
        return [pair, *later]


class ChainedPast(_AppendedSegments):
    """A tree node's past (grpo/document.py): its ancestors' pages, then its own, each a StagedPast over its own
    pool and in position order, then the segments appended later (earlier replay blocks), read by the adapters as
    a StagedPast is. Parts holding no tokens are left out; each part routes its pages' gradients to its own pool's
    gradient pages where it was made to."""

    def __init__(self, parts: Sequence[StagedPast]) -> None:
        self.parts = [part for part in parts if part.end > part.start]
        self._later = {layer: [] for layer in parts[-1]}

    def __getitem__(self, layer: int) -> list[Sequence[torch.Tensor]]:
        later = self._later[layer]  # KeyError for layers without pages, as a dict would
        return [part[layer][0] for part in self.parts] + later


def node_past(ancestors: Sequence[tuple[Stager, int]], stager: Stager, start: int, grads_to_pages: bool = False,
              past_start: int = 0) -> StagedPast | ChainedPast:
    """The past of a capture's local tokens from `start`: its ancestors' pages whole ((their stager, their
    tokens), root first; none for a prompt's only capture), then its own [past_start, start); grads_to_pages:
    each pool's gradient pages get its pages' gradients."""
    own = StagedPast(stager, past_start, start, grads_to_pages=grads_to_pages)
    if not ancestors:
        return own
    return ChainedPast([StagedPast(each, 0, tokens, grads_to_pages=grads_to_pages) for each, tokens in ancestors]
                       + [own])


class _Handle:
    __slots__ = ("stager", "key", "name", "size", "stride", "offset")

    def __init__(self, stager: Stager, key: tuple[int, int, int], name: str, tensor: torch.Tensor) -> None:
        self.stager, self.key, self.name = stager, key, name
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()


@contextmanager
def staged_saves(*stagers: Stager) -> Iterator[None]:
    """While active, autograd saves staged pages as handles and re-stages them in backward (see module doc); a
    tree node's past stages its ancestors' pages and its own through one stager each, all of them given here.

    Only the forward needs to run inside: the hooks are bound to the saved tensors when they are packed.
    """
    copying = [stager for stager in stagers if stager.pool.copies_on_read]
    if not copying:
        yield
        return

    def pack(tensor: torch.Tensor) -> torch.Tensor | _Handle:
        for stager in copying:
            owner = stager.owner_of(tensor)
            if owner is not None:
                return _Handle(stager, *owner, tensor)
        return tensor

    def unpack(saved: torch.Tensor | _Handle) -> torch.Tensor:
        if not isinstance(saved, _Handle):
            return saved
        layer, start, end = saved.key
        base = saved.stager.get(layer, start, end)[saved.name]
        return base.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
