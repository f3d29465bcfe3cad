"""The page table: which pages hold tokens [a, b) of layer l's stream on this rank, and in which state.

Plain Python bookkeeping (ids, token ranges, states, checksums); the bytes live in tensors or files that the
tiers index by (stream, page index). A stream is one retained tensor of one layer ("k" of layer 3) of one kind:
"state" (the captured values) or "grad" (exact mode's accumulated d(loss)/d(state), same shape).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from .states import PageState, advance

KINDS = ("state", "grad")


@dataclass(eq=False)
class PageEntry:
    rank: int
    layer: int
    name: str
    kind: str
    index: int
    start: int  # first token the page can hold
    end: int  # one past the last token it can hold (the last page of a stream may be short)
    state: PageState = PageState.FREE
    filled: int = 0  # tokens written so far, counted from `start`
    checksum: int | None = None  # of the filled bytes, set when the page is sealed (tiers that verify reads)

    def __repr__(self) -> str:
        return (f"page {self.index} of layer {self.layer} {self.name!r} ({self.kind}) tokens [{self.start}, "
                f"{self.end}) on rank {self.rank}: {self.state.value}")


@dataclass
class StreamPages:
    tokens: int  # reserved capacity
    entries: list = field(default_factory=list)


class PageTable:
    """Pages of every stream of one rank, created at `add_stream` (all FREE) and looked up by token range."""

    def __init__(self, page_tokens: int, rank: int = 0) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be > 0, got {page_tokens}")
        self.page_tokens = page_tokens
        self.rank = rank
        self._streams: dict[tuple, StreamPages] = {}

    def add_stream(self, layer: int, name: str, kind: str, tokens: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"page kind must be one of {KINDS}, got {kind!r}")
        key = (layer, name, kind)
        if key in self._streams:
            raise ValueError(f"stream {key} is already in the page table")
        count = -(-tokens // self.page_tokens)
        entries = [PageEntry(self.rank, layer, name, kind, i, i * self.page_tokens,
                             min(tokens, (i + 1) * self.page_tokens)) for i in range(count)]
        self._streams[key] = StreamPages(tokens, entries)

    def has_stream(self, layer: int, name: str, kind: str = "state") -> bool:
        return (layer, name, kind) in self._streams

    def entries(self, layer: int, name: str, kind: str = "state") -> list:
        return self._stream(layer, name, kind).entries

    def lookup(self, layer: int, name: str, start: int, end: int, kind: str = "state") -> list:
        """The pages that hold tokens [start, end) of a stream, in token order (empty for an empty range)."""
        stream = self._stream(layer, name, kind)
        if not (0 <= start <= end <= stream.tokens):
            raise ValueError(f"range [{start}, {end}) outside stream ({layer}, {name!r}, {kind}) of "
                             f"{stream.tokens} tokens")
        if start == end:
            return []
        return stream.entries[start // self.page_tokens: -(-end // self.page_tokens)]

    def all_entries(self) -> Iterator[PageEntry]:
        for stream in self._streams.values():
            yield from stream.entries

    def counts(self) -> dict:
        """Number of pages in each state (states with no page are left out)."""
        counts = {}
        for entry in self.all_entries():
            counts[entry.state] = counts.get(entry.state, 0) + 1
        return counts

    def release_all(self) -> None:
        """Mark every page RELEASED; the caller has drained all I/O (an IN_FLIGHT page here is a bug)."""
        for entry in self.all_entries():
            if entry.state is not PageState.RELEASED:
                advance(entry, PageState.RELEASED)

    def _stream(self, layer: int, name: str, kind: str) -> StreamPages:
        try:
            return self._streams[(layer, name, kind)]
        except KeyError:
            raise KeyError(f"no stream ({layer}, {name!r}, {kind}) on rank {self.rank}") from None
