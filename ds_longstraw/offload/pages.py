"""Pages of per-token retained state, owned by one rank, indexed by (layer, name, token range).

A stream is one retained tensor of one layer (say layer 3's "k"), token-major: [tokens, *shape]. Its tokens are
cut into pages of `page_tokens`; the page table maps (layer, name, page index) to where the page lives. Each
stream may have a gradient stream of the same shape (exact mode accumulates d(state) there).

This module holds the device tier: a stream's pages are views into one arena reserved at the stream's full
length, so reading a token range of a resident layer costs no copy. Host and NVMe tiers (tiered.py,
host_pool.py, nvme_pool.py) store the same pages elsewhere behind the same interface and stage them to the
compute device one layer at a time (stager.py).

The interface every pool offers: reserve / append / flush / read / begin_read (a ticket whose `result()` is the
tensor, so reads can be issued ahead) / add_grad / add_grad_rows (only given rows: a sparse attention's) /
read_grad / release, and the bookkeeping queries streams / length / state_bytes / grad_bytes / bytes_by_stream.
`copies_on_read` says whether `read` returns a fresh copy (host and NVMe tiers: autograd must not keep it alive) or a
view of storage that stays resident.
"""

from collections.abc import Sequence
from typing import Any

import torch


class _Stream:
    def __init__(self, tokens: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = tokens
        self.length = 0
        self.data = torch.empty((tokens, *shape), dtype=dtype, device=device)
        self.grad = None


class ReadyRead:
    """A read that is complete when issued (the device tier's reads are views)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def result(self) -> torch.Tensor:
        return self._tensor

    def release(self) -> None:
        self._tensor = None


def check_grad_rows(stream: tuple[int, str], start: int, rows: torch.Tensor, grad: torch.Tensor, tokens: int) -> None:
    """add_grad_rows' arguments, checked before anything is added: one gradient row per row, ascending, distinct,
    inside the stream's tokens."""
    if rows.dim() != 1 or grad.shape[0] != rows.numel():
        raise ValueError(f"gradient rows of stream {stream}: {rows.numel()} rows for a gradient of shape "
                         f"{tuple(grad.shape)} (one row index per gradient row)")
    if rows.numel() == 0:
        return
    first, last = start + int(rows[0]), start + int(rows[-1])
    if not (0 <= first and last < tokens):
        raise ValueError(f"gradient rows [{first}, {last}] outside stream {stream} of {tokens} tokens")
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise ValueError(f"gradient rows of stream {stream} must ascend without repeats")


def is_one_run(rows: torch.Tensor) -> bool:
    """Whether ascending distinct rows [u > 0] are one run of consecutive rows."""
    return int(rows[-1]) - int(rows[0]) + 1 == rows.numel()


class PoolBase:
    """What every tier's pool holds: page size (checked), compute device, owning rank, staging depth, and its
    streams by (layer, name), empty. PagePool here and tiered.TieredPagePool (host, NVMe) build on it."""

    def __init__(self, page_tokens: int, device: torch.device | str | None = None, rank: int = 0,
                 staging_depth: int = 1) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be > 0, got {page_tokens}")
        self.page_tokens = page_tokens
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.rank = rank
        self.staging_depth = staging_depth
        self._streams: dict[tuple[int, str], Any] = {}


class PagePool(PoolBase):
    """Pages of one rank's retained streams on the compute device (streams: _Stream, an arena each)."""

    tier = "device"
    copies_on_read = False

    # -- bookkeeping -------------------------------------------------------------------------------------
    def reserve(self, layer: int, name: str, tokens: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Declare a stream of `tokens` tokens, each a tensor of `shape`; pages are filled by `append`."""
        key = (layer, name)
        if key in self._streams:
            raise ValueError(f"stream {key} is already reserved")
        self._streams[key] = _Stream(tokens, tuple(shape), dtype, self.device)

    def streams(self) -> list[tuple[int, str]]:
        return list(self._streams)

    def length(self, layer: int, name: str) -> int:
        return self._stream(layer, name).length

    def state_bytes(self) -> int:
        return sum(s.data.numel() * s.data.element_size() for s in self._streams.values())

    def grad_bytes(self) -> int:
        return sum(s.grad.numel() * s.grad.element_size() for s in self._streams.values() if s.grad is not None)

    def bytes_by_stream(self) -> dict:
        return {key: s.data.numel() * s.data.element_size() for key, s in self._streams.items()}

    # -- data ------------------------------------------------------------------------------------------
    def append(self, layer: int, name: str, values: torch.Tensor) -> None:
        """Write the next tokens of a stream (token-major tensor)."""
        stream = self._stream(layer, name)
        end = stream.length + values.shape[0]
        if end > stream.capacity:
            raise ValueError(f"stream {(layer, name)} overflows its {stream.capacity} reserved tokens")
        stream.data[stream.length:end].copy_(values)
        stream.length = end

    def read(self, layer: int, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of a stream, on the compute device (a view for the device tier)."""
        stream = self._stream(layer, name)
        end = stream.length if end is None else end
        if not (0 <= start <= end <= stream.length):
            raise ValueError(f"range [{start}, {end}) outside stream {(layer, name)} of {stream.length} tokens")
        return stream.data[start:end]

    def begin_read(self, layer: int, name: str, start: int = 0, end: int | None = None,
                   kind: str = "state") -> ReadyRead:
        """Issue a read of tokens [start, end); `.result()` is the tensor (here at once: a view)."""
        if kind == "grad":
            return ReadyRead(self.read_grad(layer, name, start, end))
        return ReadyRead(self.read(layer, name, start, end))

    def flush(self) -> None:
        """Nothing to write back: device pages are resident as soon as they are appended."""

    def host_bytes(self) -> int:
        return 0 if self.device.type != "cpu" else self.state_bytes() + self.grad_bytes()

    def add_grad(self, layer: int, name: str, start: int, grad: torch.Tensor) -> None:
        """Accumulate d(loss)/d(tokens [start, start + len(grad))) on the stream's gradient pages."""
        stream = self._stream(layer, name)
        if stream.grad is None:
            stream.grad = torch.zeros_like(stream.data)
        stream.grad[start:start + grad.shape[0]].add_(grad.to(stream.grad.dtype))

    def add_grad_rows(self, layer: int, name: str, start: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Accumulate d(loss)/d(tokens start + rows) on the stream's gradient pages: rows [u] int64, ascending and
        distinct (a sparse attention's selected rows); grad [u, ...]. Only those rows are touched."""
        stream = self._stream(layer, name)
        check_grad_rows((layer, name), start, rows, grad, stream.length)
        if stream.grad is None:
            stream.grad = torch.zeros_like(stream.data)
        if rows.numel():
            first = start + int(rows[0])
            if is_one_run(rows):  # a dense slice (every row of a range selected): one add, no scatter
                stream.grad[first:first + rows.numel()].add_(grad.to(stream.grad.dtype))
            else:
                stream.grad.index_add_(0, rows.to(stream.grad.device) + start, grad.to(stream.grad.dtype))

    def read_grad(self, layer: int, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        stream = self._stream(layer, name)
        end = stream.length if end is None else end
        if stream.grad is None:
            return torch.zeros_like(stream.data[start:end])
        return stream.grad[start:end]

    def release(self) -> None:
        """Free every page (state and gradient)."""
        self._streams.clear()

    def _stream(self, layer: int, name: str) -> _Stream:
        try:
            return self._streams[(layer, name)]
        except KeyError:
            raise KeyError(f"no stream ({layer}, {name!r}) on rank {self.rank}") from None
