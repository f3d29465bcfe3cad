"""The part of a host or NVMe page pool that does not depend on where the bytes live.

A tiered pool keeps the PagePool interface (pages.py) but its pages live off the compute device; every read
returns a fresh copy on the compute device (`copies_on_read`), which the caller drops when the layer's turn
is over. Streams, their page table (page_table.py) and the page state machine (states.py) are kept here; the
subclass stores and fetches bytes (`_write_state`, `_read`, `_accumulate_grad`, `_flush`, `_free`).

Gradient streams ("grad" kind) are created on the first `add_grad` of a stream and accumulate in the stream's
dtype, exactly as the device tier does, so every tier yields the same numbers.
"""

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .page_table import PageTable
from .pages import PoolBase, check_grad_rows, is_one_run
from .states import STAGING_TRANSITIONS, PageState, advance


@dataclass
class StreamInfo:
    layer: int
    name: str
    tokens: int  # reserved capacity
    shape: tuple
    dtype: torch.dtype
    length: int = 0
    has_grad: bool = False

    @property
    def token_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def token_bytes(self) -> int:
        return self.token_numel * torch.empty((), dtype=self.dtype).element_size()


class ReadTicket:
    """A read of tokens [start, end) of one stream, issued ahead; `result()` waits once and returns the tensor.

    States (states.STAGING_TRANSITIONS): IN_FLIGHT when issued, RESIDENT once the data is on the compute device
    and verified, RELEASED when the owner drops it (a ticket still in flight is completed first, so no buffer is
    freed under a running transfer).
    """

    def __init__(self, description: str, finish: Callable[[], torch.Tensor]) -> None:
        self.description = description
        self.state = PageState.FREE
        advance(self, PageState.IN_FLIGHT, STAGING_TRANSITIONS)
        self._finish = finish
        self._tensor = None

    def result(self) -> torch.Tensor:
        if self.state is PageState.IN_FLIGHT:
            if self._finish is None:
                raise AssertionError(f"result() again after a failed read: {self!r}")
            finish, self._finish = self._finish, None
            self._tensor = finish()  # on error the ticket stays IN_FLIGHT with nothing left to wait for
            advance(self, PageState.RESIDENT, STAGING_TRANSITIONS)
        if self.state is not PageState.RESIDENT:
            raise AssertionError(f"result() of a released read: {self!r}")
        return self._tensor

    def release(self) -> None:
        if self.state is PageState.IN_FLIGHT and self._finish is not None:
            try:
                self.result()  # complete the transfer before its buffers are reused
            except Exception:
                pass  # the read is being dropped; a read that is used reports its own error
        if self.state is not PageState.RELEASED:
            advance(self, PageState.RELEASED, STAGING_TRANSITIONS)
        self._tensor = None

    def __repr__(self) -> str:
        return f"read of {self.description}: {self.state.value}"


class TieredPagePool(PoolBase):
    """Base of the host and NVMe tiers: streams (StreamInfo), page table, state machine, and the public pool
    interface."""

    tier = "?"
    copies_on_read = True

    def __init__(self, page_tokens: int, device: torch.device | str | None = None, rank: int = 0,
                 staging_depth: int = 1) -> None:
        super().__init__(page_tokens, device, rank, staging_depth)
        self.table = PageTable(page_tokens, rank)
        self._released = False
        # A pool dropped without release() (an exception unwinding past its owner) still frees its storage.
        self._finalizer = weakref.finalize(self, type(self)._finalize, self._finalize_state())

    # -- subclass hooks ----------------------------------------------------------------------------------
    def _finalize_state(self) -> object:
        """An object (not the pool) that `_finalize` can clean up from; the default has nothing to clean."""
        return None

    @staticmethod
    def _finalize(state: Any) -> None:
        pass

    def _create_stream(self, info: StreamInfo, kind: str) -> None:
        raise NotImplementedError

    def _write_state(self, info: StreamInfo, start: int, values_cpu: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, info: StreamInfo, kind: str, start: int, end: int) -> ReadTicket:
        raise NotImplementedError

    def _accumulate_grad(self, info: StreamInfo, start: int, grad_cpu: torch.Tensor) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        raise NotImplementedError

    def host_bytes(self) -> int:
        raise NotImplementedError

    # -- bookkeeping -------------------------------------------------------------------------------------
    def reserve(self, layer: int, name: str, tokens: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Declare a stream of `tokens` tokens, each a tensor of `shape`; pages are filled by `append`."""
        self._check_open()
        key = (layer, name)
        if key in self._streams:
            raise ValueError(f"stream {key} is already reserved")
        info = StreamInfo(layer, name, tokens, tuple(shape), dtype)
        self._create_stream(info, "state")
        self.table.add_stream(layer, name, "state", tokens)
        self._streams[key] = info

    def streams(self) -> list[tuple[int, str]]:
        return list(self._streams)

    def length(self, layer: int, name: str) -> int:
        return self._stream(layer, name).length

    def state_bytes(self) -> int:
        """Bytes of retained state reserved (the same figure on every tier; padding on the tier not counted)."""
        return sum(s.tokens * s.token_bytes for s in self._streams.values())

    def grad_bytes(self) -> int:
        return sum(s.tokens * s.token_bytes for s in self._streams.values() if s.has_grad)

    def bytes_by_stream(self) -> dict:
        return {key: s.tokens * s.token_bytes for key, s in self._streams.items()}

    # -- data ------------------------------------------------------------------------------------------
    def append(self, layer: int, name: str, values: torch.Tensor) -> None:
        """Write the next tokens of a stream (token-major tensor on any device)."""
        self._check_open()
        info = self._stream(layer, name)
        end = info.length + values.shape[0]
        if end > info.tokens:
            raise ValueError(f"stream {(layer, name)} overflows its {info.tokens} reserved tokens")
        if tuple(values.shape[1:]) != info.shape:
            raise ValueError(f"stream {(layer, name)} holds tokens of shape {info.shape}, "
                             f"got {tuple(values.shape[1:])}")
        if values.shape[0]:
            self._write_state(info, info.length, values.detach().to("cpu", info.dtype).contiguous())
        info.length = end

    def begin_read(self, layer: int, name: str, start: int = 0, end: int | None = None,
                   kind: str = "state") -> ReadTicket:
        """Issue a read of tokens [start, end) to the compute device; `.result()` waits and returns the copy."""
        self._check_open()
        info = self._stream(layer, name)
        end = info.length if end is None else end
        if not (0 <= start <= end <= info.length):
            raise ValueError(f"range [{start}, {end}) outside stream {(layer, name)} of {info.length} tokens")
        if kind == "grad" and not info.has_grad:
            zeros = torch.zeros((end - start, *info.shape), dtype=info.dtype, device=self.device)
            return ReadTicket(f"zero gradient of {(layer, name)}", lambda: zeros)
        if start == end:
            empty = torch.empty((0, *info.shape), dtype=info.dtype, device=self.device)
            return ReadTicket(f"empty range of {(layer, name)}", lambda: empty)
        return self._read(info, kind, start, end)

    def read(self, layer: int, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of a stream: a fresh tensor on the compute device."""
        return self.begin_read(layer, name, start, end).result()

    def add_grad(self, layer: int, name: str, start: int, grad: torch.Tensor) -> None:
        """Accumulate d(loss)/d(tokens [start, start + len(grad))) on the stream's gradient pages."""
        self._check_open()
        info = self._stream(layer, name)
        if not (0 <= start <= start + grad.shape[0] <= info.tokens):
            raise ValueError(f"gradient rows [{start}, {start + grad.shape[0]}) outside stream {(layer, name)}")
        self._open_grad(info)
        if grad.shape[0]:
            # .to(dtype) first, on the gradient's own device: the device tier rounds there too.
            self._accumulate_grad(info, start, grad.detach().to(info.dtype).to("cpu").contiguous())

    def add_grad_rows(self, layer: int, name: str, start: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Accumulate d(loss)/d(tokens start + rows) on the stream's gradient pages: rows [u] int64, ascending and
        distinct (a sparse attention's selected rows); grad [u, ...]. Only the pages holding one of them are
        touched (an NVMe page that no row lies in is neither read nor written)."""
        self._check_open()
        info = self._stream(layer, name)
        check_grad_rows((layer, name), start, rows, grad, info.tokens)
        if not rows.numel():
            return
        self._open_grad(info)
        grad_cpu = grad.detach().to(info.dtype).to("cpu").contiguous()
        if is_one_run(rows):  # a dense slice (every row of a range selected): the dense addition
            self._accumulate_grad(info, start + int(rows[0]), grad_cpu)
        else:
            self._accumulate_grad_rows(info, rows.to("cpu") + start, grad_cpu)

    def _open_grad(self, info: StreamInfo) -> None:
        if not info.has_grad:
            self._create_stream(info, "grad")
            self.table.add_stream(info.layer, info.name, "grad", info.tokens)
            info.has_grad = True

    def _accumulate_grad_rows(self, info: StreamInfo, rows: torch.Tensor, grad_cpu: torch.Tensor) -> None:
        """Rows (absolute, ascending) added page run by page run: each run of consecutive pages that hold a row
        is one dense read-add-write of those pages (`_accumulate_grad`, zero where no row lies)."""
        pages = rows // self.page_tokens
        cuts = ((pages[1:] - pages[:-1]) > 1).nonzero().squeeze(1).add(1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, rows.numel()], strict=True):
            first = int(pages[lo]) * self.page_tokens
            end = min(info.tokens, (int(pages[hi - 1]) + 1) * self.page_tokens)
            span = grad_cpu.new_zeros((end - first, *grad_cpu.shape[1:]))
            self._accumulate_grad(info, first, span.index_copy_(0, rows[lo:hi] - first, grad_cpu[lo:hi]))

    def read_grad(self, layer: int, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.begin_read(layer, name, start, end, kind="grad").result()

    def flush(self) -> None:
        """Seal partly filled pages and wait until every page is resident on its tier."""
        self._check_open()
        self._flush()

    def release(self) -> None:
        """Free every page (state and gradient) and its storage; safe to call twice."""
        if self._released:
            return
        self._released = True
        try:
            self._free()
        finally:
            self.table.release_all()
            self._finalizer()

    def _check_open(self) -> None:
        if self._released:
            raise AssertionError(f"{self.tier} page pool of rank {self.rank} used after release()")

    def _stream(self, layer: int, name: str) -> StreamInfo:
        try:
            return self._streams[(layer, name)]
        except KeyError:
            raise KeyError(f"no stream ({layer}, {name!r}) on rank {self.rank}") from None
