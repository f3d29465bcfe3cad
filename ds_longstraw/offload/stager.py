"""The stager: brings one layer's pages to the compute device at a time, reading the next layers ahead.

Computation walks the layers in order (forward) or in reverse (backward). `get(layer, start, end)` returns
{name: tensor} for tokens [start, end) of that layer's streams; it also issues reads of the next
`depth` layers in the direction of the walk (so their I/O overlaps this layer's compute) and releases every
staged layer outside that window (the layer just finished among them). At most depth + 1 layers are staged at
once; that and the pool's write queue bound the staging buffers.

`wrap=True` makes the read-ahead wrap around the ends of the layer list, for walks that repeat (replay runs
every block through all layers; backward then walks them back). A read-ahead for a range that the walk does
not ask for (the next capture chunk asks for a longer one) is released unused.

For the device tier reads are views and nothing moves, but the same code runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .pages import PagePool, ReadyRead
    from .tiered import ReadTicket, TieredPagePool


class _Staged:
    def __init__(self, tickets: dict[str, ReadTicket | ReadyRead]) -> None:
        self.tickets = tickets  # name -> ReadTicket

    def result(self) -> dict[str, torch.Tensor]:
        return {name: ticket.result() for name, ticket in self.tickets.items()}

    def release(self) -> None:
        for ticket in self.tickets.values():
            ticket.release()


class Stager:
    """layers: a mapping layer -> the names of its streams (layers may differ), or a list of layers that all
    stage the streams `names`."""

    def __init__(self, pool: PagePool | TieredPagePool, layers: dict[int, Iterable[str]] | Iterable[int],
                 names: Iterable[str] | None = None, depth: int | None = None, wrap: bool = False) -> None:
        self.pool = pool
        if isinstance(layers, dict):
            self.names = {layer: tuple(streams) for layer, streams in layers.items()}
        elif names is None:
            raise ValueError("Stager: give the stream names of the layers (names=...), or layers as a mapping")
        else:
            self.names = {layer: tuple(names) for layer in layers}
        self.layers = list(self.names)
        self.depth = pool.staging_depth if depth is None else depth
        if self.depth < 0:
            raise ValueError(f"staging depth must be >= 0, got {self.depth}")
        self.wrap = wrap
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._window: dict[tuple, _Staged] = {}  # (layer, start, end) -> staged reads
        self._pending: dict[tuple, _Staged] = {}  # stream(): the piece read ahead
        self._last = None
        self._direction = 1
        self._owned = {}  # storage address -> (weakref to a staged tensor, key, name); see owner_of
        self.reads = 0  # reads issued (tests and the benchmark count them)
        self.peak_staged = 0

    def _move_to(self, layer: int) -> int:
        position = self._position[layer]
        if self._last is not None and position != self._last:
            self._direction = self._walk_direction(self._last, position)
        self._last = position
        return position

    def get(self, layer: int, start: int, end: int) -> dict:
        """{name: tokens [start, end) of `layer`} on the compute device; valid until the walk moves on."""
        key = (layer, start, end)
        position = self._move_to(layer)
        if key not in self._window:
            self._window[key] = self._issue(layer, start, end)
        ahead = [(other, start, end) for other in self._ahead(position)]
        for other in [k for k in self._window if k != key and k not in ahead]:
            self._window.pop(other).release()
        staged = self._window[key].result()
        for k in ahead:
            if k not in self._window:
                self._window[k] = self._issue(*k)
        self.peak_staged = max(self.peak_staged, len(self._window))
        if self.pool.copies_on_read:
            self._owned = {p: e for p, e in self._owned.items() if e[0]() is not None}  # drop dead copies
            for name, tensor in staged.items():
                ptr = tensor.untyped_storage().data_ptr()
                self._owned[ptr] = (weakref.ref(tensor), key, name)
        return staged

    def stream(self, layer: int, start: int = 0,
               end: int | None = None) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """Tokens [start, end) of `layer` page by page (end None: the stream's length): yields (lo, hi, {name:
        tensor}) for each page-aligned piece. The next piece's read is issued before this one is handed out, and
        after the layer's last piece the first piece of the next layer of the walk, so the tier's reads overlap the
        compute on the piece in hand; at most two pieces are staged at once and no layer is ever staged whole.
        A piece is released when the caller asks for the next one (or closes the generator)."""
        position = self._move_to(layer)
        for lo, hi in self._pieces(layer, start, end):
            key = (layer, lo, hi)
            current = self._pending.pop(key, None) or self._issue(layer, lo, hi)
            for stale in list(self._pending):  # a read-ahead the walk did not take
                self._pending.pop(stale).release()
            ahead = self._next_piece(layer, position, hi, end)
            if ahead is not None:
                self._pending[ahead] = self._issue(*ahead)
            self.peak_staged = max(self.peak_staged, 1 + len(self._pending))
            try:
                yield lo, hi, current.result()
            finally:
                current.release()

    def _pieces(self, layer: int, start: int, end: int | None) -> Iterator[tuple[int, int]]:
        end = self.pool.length(layer, self.names[layer][0]) if end is None else end
        page = self.pool.page_tokens
        lo = start
        while lo < end:
            hi = min(end, (lo // page + 1) * page)
            yield lo, hi
            lo = hi

    def _next_piece(self, layer: int, position: int, hi: int, end: int | None) -> tuple[int, int, int] | None:
        """The piece after [.., hi) of `layer`: its next page, or the first page of the walk's next layer."""
        following = next(self._pieces(layer, hi, end), None)
        if following is not None:
            return (layer, *following)
        ahead = self._ahead(position)
        if not ahead or self.depth == 0:
            return None
        first = next(self._pieces(ahead[0], 0, None), None)
        return None if first is None else (ahead[0], *first)

    def owner_of(self, tensor: torch.Tensor) -> tuple[tuple[int, int, int], str] | None:
        """(key, name) when `tensor` shares storage with a live staged copy, else None.

        Storage addresses are reused after a free, so a match counts only while the staged tensor is alive
        (its storage, and so its address, cannot belong to anything else then).
        """
        entry = self._owned.get(tensor.untyped_storage().data_ptr())
        if entry is None:
            return None
        ref, key, name = entry
        staged = ref()
        if staged is None or staged.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            return None
        return key, name

    def close(self) -> None:
        """Release every staged layer (in-flight reads are completed first)."""
        for staged in self._window.values():
            staged.release()
        self._window.clear()
        for staged in self._pending.values():
            staged.release()
        self._pending.clear()
        self._owned.clear()
        self._last = None

    def _walk_direction(self, last: int, position: int) -> int:
        """+1 or -1. A step to a neighbour gives the direction; a jump restarts a walk: forward from the first
        layer, backward from the last (replay's next block, capture's next chunk, a backward after a forward)."""
        count = len(self.layers)
        step = position - last
        if self.wrap and abs(step) > count // 2:  # the short way round
            step -= count if step > 0 else -count
        if abs(step) == 1:
            return step
        if position == 0:
            return 1
        if position == count - 1:
            return -1
        return 1 if step > 0 else -1

    def _issue(self, layer: int, start: int, end: int) -> _Staged:
        self.reads += 1
        return _Staged({name: self.pool.begin_read(layer, name, start, end) for name in self.names[layer]})

    def _ahead(self, position: int) -> list[int]:
        count = len(self.layers)
        out = []
        for step in range(1, self.depth + 1):
            nxt = position + step * self._direction
            if self.wrap:
                nxt %= count
            elif not 0 <= nxt < count:
                break
            if nxt == position:
                break
            out.append(self.layers[nxt])
        return out
