"""Asynchronous page-file reads and writes: DeepSpeed's aio op, or buffered I/O where O_DIRECT is refused.

Both engines take the same calls: `submit_read(buffer, path, offset)`, `submit_write(buffer, path, offset)`,
`wait()` (completes everything submitted on this engine; a no-op when nothing is pending). One engine is one
queue: a caller that must wait for some transfers but not others uses several engines.

The aio op's sharp edges are guarded here, because it reports none of them:
- `wait()` with nothing pending, or a read past the end of a file, trips a C assert and aborts the process:
  `wait` is skipped when nothing is pending and every read is checked against the file's size first;
- a misaligned request "succeeds" and transfers nothing: sizes, offsets and buffers are checked for alignment;
- it never looks at the result of a transfer. DeepSpeed 0.19.8 (csrc/aio/common/deepspeed_aio_common.cpp,
  `_do_io_complete`) reaps each request's io_events and drops them: the byte count or -errno in `io_event.res`
  is never read, `async_pwrite` returns 0 once the file opens, and `wait()` returns the number of requests that
  completed, failed or not. A write refused or cut short (a file-size limit, a full disk, an I/O error) passes
  silently, and a size check cannot see it either, because page files are preallocated to their full size. So
  `AioEngine.wait()` reads back the last `alignment` bytes of every write it completed, through the same handle,
  and compares them with the bytes it meant to write. That catches a write that lands nothing or stops early:
  a file-size limit fails every block from some offset on, the request's last block among them. What it can
  miss is a failure confined to blocks before a request's last one (an I/O error there, or a disk filling up on
  a filesystem without preallocation, where blocks in flight together are allocated in no fixed order); the
  page's checksum catches that when the page is read.
  The cost is one `alignment`-sized read per write request (a sealed page, or a run of gradient pages).

The buffered engine sees the result of every transfer (`os.pwrite` returns the bytes written, or raises), so
it needs no read-back: a failed or short write raises in `wait()`.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch

from .alignment import aligned_empty

_AIO_MODULE = None


def load_aio() -> ModuleType:
    """DeepSpeed's async_io op, built on first use (JIT, ~3 minutes, cached in ~/.cache/torch_extensions).

    Raises RuntimeError saying why when it cannot be built here (no libaio headers, no compiler).
    """
    global _AIO_MODULE
    if _AIO_MODULE is None:
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            builder = AsyncIOBuilder()
            if not builder.is_compatible(verbose=False):
                raise RuntimeError("AsyncIOBuilder is not compatible here (libaio development files missing? "
                                   "apt-get install libaio-dev)")
            _AIO_MODULE = builder.load(verbose=False)
        except Exception as error:  # a failed JIT build raises many types; keep the reason, one type out
            raise RuntimeError(f"DeepSpeed's async I/O op cannot be loaded: {error}") from error
    return _AIO_MODULE


class PageFileError(OSError):
    """A page file could not be written or read back intact; the message names the file."""


def _check_buffer(buffer: torch.Tensor, alignment: int, what: str) -> None:
    if buffer.device.type != "cpu" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise AssertionError(f"{what}: I/O buffers are contiguous uint8 CPU tensors, got {buffer.dtype} "
                             f"on {buffer.device}")
    if buffer.numel() % alignment or buffer.data_ptr() % 512:
        raise AssertionError(f"{what}: {buffer.numel()} B at address {buffer.data_ptr():#x} is not aligned "
                             f"to {alignment} B")


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise PageFileError(f"page file {path} is missing") from None


def check_readable(path: str, offset: int, nbytes: int) -> None:
    """Raise PageFileError unless bytes [offset, offset + nbytes) exist in `path` (a truncated page file)."""
    size = _file_size(path)
    if offset + nbytes > size:
        raise PageFileError(f"page file {path} is truncated: {size} B, a page read needs bytes "
                            f"[{offset}, {offset + nbytes})")


class _Engine:
    kind = "?"

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    def _check(self, buffer: torch.Tensor, path: str, offset: int, what: str) -> None:
        _check_buffer(buffer, self.alignment, f"{what} {path}")
        if offset % self.alignment:
            raise AssertionError(f"{what} {path}: offset {offset} not aligned to {self.alignment} B")


class AioEngine(_Engine):
    """One DeepSpeed aio handle (a queue with `intra_op_parallelism` worker threads)."""

    kind = "aio"

    def __init__(self, aio_module: ModuleType, aio_config: Any, alignment: int) -> None:
        super().__init__(alignment)
        self._handle = aio_module.aio_handle(aio_config.block_size, aio_config.queue_depth, aio_config.single_submit,
                                             aio_config.overlap_events, aio_config.intra_op_parallelism)
        self._writes = []  # (buffer, path, offset) submitted since the last wait: verified after it

    def submit_read(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._check(buffer, path, offset, "read")
        check_readable(path, offset, buffer.numel())  # the op asserts (aborts) on a read past the end
        if self._handle.async_pread(buffer, path, offset) != 0:
            raise PageFileError(f"could not open page file {path} for reading")
        self._pending += 1

    def submit_write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._check(buffer, path, offset, "write")
        if self._handle.async_pwrite(buffer, path, offset) != 0:
            raise PageFileError(f"could not open page file {path} for writing")
        self._pending += 1
        self._writes.append((buffer, path, offset))

    def wait(self) -> None:
        if self._pending == 0:  # the op asserts (aborts) on a wait with nothing pending
            return
        self._handle.wait()
        self._pending = 0
        writes, self._writes = self._writes, []
        if writes:
            self._verify_writes(writes)

    def _verify_writes(self, writes: list[tuple[torch.Tensor, str, int]]) -> None:
        """Read back the last `alignment` bytes of each completed write and compare them with what was written
        (the op reports no per-request result: see the module docstring). Raises PageFileError naming the file."""
        tail = self.alignment
        # A later write to the same bytes replaces an earlier one: check the last.
        writes = list({(path, offset + buffer.numel()): (buffer, path, offset)
                       for buffer, path, offset in writes}.values())
        landed = aligned_empty(len(writes) * tail, 4096)
        submitted = 0
        try:
            for row, (buffer, path, offset) in enumerate(writes):
                end = offset + buffer.numel()
                size = _file_size(path)
                if size < end:  # not preallocated (or truncated since): the write stopped before `end`
                    raise PageFileError(f"write to page file {path} did not land: bytes [{offset}, {end}) were "
                                        f"written, the file holds {size} B (disk full or I/O error?)")
                if self._handle.async_pread(landed[row * tail: (row + 1) * tail], path, end - tail) != 0:
                    raise PageFileError(f"could not open page file {path} to verify a write")
                submitted += 1
        finally:
            if submitted:
                self._handle.wait()
        for row, (buffer, path, offset) in enumerate(writes):
            if not torch.equal(landed[row * tail: (row + 1) * tail], buffer[-tail:]):
                raise PageFileError(f"write to page file {path} did not land: bytes [{offset}, "
                                    f"{offset + buffer.numel()}) read back different (a file-size limit, a full disk "
                                    f"or an I/O error refused or cut short the write)")

    def close(self) -> None:
        # The handle's destructor asserts (aborts) when transfers are still pending: drain first.
        self.wait()
        self._handle = None


class BufferedEngine(_Engine):
    """os.pread / os.pwrite on one worker thread (page cache, no O_DIRECT) for filesystems that refuse O_DIRECT."""

    kind = "buffered"

    def __init__(self, alignment: int) -> None:
        super().__init__(alignment)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longstraw-io")
        self._futures = []

    @staticmethod
    def _transfer(read: bool, buffer: torch.Tensor, path: str, offset: int) -> None:
        """Move the whole buffer; every call's byte count is checked (a short transfer is continued, and one
        that moves nothing, or raises, fails naming the file and the byte it stopped at)."""
        view = memoryview(buffer.numpy())
        what = "read from" if read else "write to"
        done = 0
        fd = os.open(path, os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while done < len(view):
                try:
                    if read:
                        n = os.preadv(fd, [view[done:]], offset + done)
                    else:
                        n = os.pwrite(fd, view[done:], offset + done)
                except OSError as error:
                    raise PageFileError(f"{what} page file {path} failed at byte {offset + done} of "
                                        f"[{offset}, {offset + len(view)}): {error}") from None
                if n <= 0:
                    raise PageFileError(f"{what} page file {path} stopped at byte {offset + done} of "
                                        f"[{offset}, {offset + len(view)})")
                done += n
        finally:
            os.close(fd)

    def _submit(self, read: bool, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._futures.append((path, self._pool.submit(self._transfer, read, buffer, path, offset)))
        self._pending += 1

    def submit_read(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._check(buffer, path, offset, "read")
        check_readable(path, offset, buffer.numel())
        self._submit(True, buffer, path, offset)

    def submit_write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._check(buffer, path, offset, "write")
        self._submit(False, buffer, path, offset)

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        self._pending = 0
        first = None
        for path, future in futures:  # collect every transfer before raising, so no buffer is still in use
            try:
                future.result()
            except PageFileError as error:
                first = first or error
            except OSError as error:  # opening the file
                first = first or PageFileError(f"I/O on page file {path} failed: {error}")
        if first is not None:
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True)
