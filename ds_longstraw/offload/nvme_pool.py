"""The NVMe tier: pages in files under `offload.nvme_path`, moved with DeepSpeed's async I/O op.

Layout: one file per stream and kind (`L003-k-state.pages`) in a directory of its own
(`<nvme_path>/longstraw-rank<r>-<pid>-<id>/`); page i sits at byte i * slot, where slot is the page's bytes
rounded up to the I/O alignment (alignment.py), so every transfer is aligned and a page never shares a sector
with another. The whole file is preallocated (posix_fallocate) when the stream is reserved: a disk that cannot
hold the state fails there, before any compute, with an error naming the file.

Writes: appended tokens fill a page-sized tail buffer; a full page is sealed (CRC-32 of its bytes recorded in
the page table), written asynchronously, and RESIDENT once the write queue drains. `flush()` seals the partial
last pages. A write that fails or comes up short raises PageFileError naming the file when the queue drains
(in `append` once the queue is full, or in `flush`); io_engine.py says how each engine finds out.

Reads: the pages of a token range land in one aligned buffer (one request per run of resident pages), are
checked against their checksums, and are copied to the compute device as a fresh tensor; a truncated file is
caught before the read (the aio op would abort), a corrupted one by the checksum.
Gradient pages are read, added to and written back synchronously.

The files and the directory are removed by `release()`, by the pool's finalizer if it is dropped unreleased,
and at interpreter exit. After an I/O error the pool refuses further use (its pages may be incomplete).
"""

import errno
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import torch

from .alignment import io_alignment, memory_lock_unlimited, probe_direct_io, round_up
from .buffers import BufferCache
from .io_engine import AioEngine, BufferedEngine, PageFileError, load_aio
from .page_table import PageEntry
from .pinning import locked_allocator
from .states import PageState, advance
from .tiered import ReadTicket, StreamInfo, TieredPagePool

_WRITE_QUEUE_BYTES = 32 << 20  # sealed pages in flight before the writer waits (bounds write buffers)


def _crc(buffer: torch.Tensor) -> int:
    return zlib.crc32(buffer.numpy()) if buffer.numel() else 0


class _Stream:
    def __init__(self, info: StreamInfo, slot_bytes: int, page_bytes: int) -> None:
        self.info = info
        self.slot_bytes = slot_bytes
        self.page_bytes = page_bytes
        self.paths = {}  # kind -> file
        self.tail = None  # buffer of the page being filled (state kind)


class _Resources:
    """Everything the finalizer must clean up, kept apart from the pool so the finalizer does not pin it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.engines = []
        self.buffers = None

    def close(self) -> None:
        errors = []
        for engine in self.engines:  # no transfer may still use a buffer when the buffers are freed
            try:
                engine.wait()
            except Exception as error:  # keep closing the rest; report the first
                errors.append(error)
        try:
            if self.buffers is not None:
                self.buffers.close()  # locked buffers are freed through an engine's handle: before the engines go
            for engine in self.engines:
                engine.close()
            self.engines.clear()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        if errors:
            raise errors[0]


def _check_nvme_path(nvme_path: str | None) -> None:
    if not nvme_path:
        raise ValueError("offload.nvme_path must name a directory when offload.tier = 'nvme'")
    if not os.path.exists(nvme_path):
        raise ValueError(f"offload.nvme_path = {nvme_path!r} does not exist")
    if not os.path.isdir(nvme_path):
        raise ValueError(f"offload.nvme_path = {nvme_path!r} is not a directory")


class NvmePagePool(TieredPagePool):
    tier = "nvme"

    def __init__(self, page_tokens: int, device: torch.device | str | None = None, rank: int = 0,
                 staging_depth: int = 1, *, nvme_path: str, aio_config: Any, host_budget_bytes: int | None = None,
                 direct_io: bool | None = None) -> None:
        _check_nvme_path(nvme_path)
        directory = os.path.join(nvme_path, f"longstraw-rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(directory, 0o700)
        except OSError as error:
            raise ValueError(f"offload.nvme_path = {nvme_path!r} is not writable: {error}") from None
        self._resources = _Resources(directory)
        super().__init__(page_tokens, device, rank, staging_depth)
        try:
            self._setup(directory, aio_config, host_budget_bytes, direct_io)
        except BaseException:
            self._resources.close()
            raise

    def _setup(self, directory: str, aio_config: Any, host_budget_bytes: int | None,
               direct_io: bool | None) -> None:
        self.directory = directory
        self.aio_config = aio_config
        try:
            direct = probe_direct_io(directory) if direct_io is None else direct_io
        except OSError as error:
            raise ValueError(f"offload.nvme_path: cannot write a probe file in {directory}: {error}") from None
        self._aio = None
        if not direct:
            self.io_reason = f"{directory} refuses O_DIRECT: buffered I/O"
        elif not memory_lock_unlimited():
            self.io_reason = "RLIMIT_MEMLOCK is finite (the aio op aborts when its mlock fails): buffered I/O"
        else:
            self._aio = load_aio()
            self.io_reason = "DeepSpeed aio (O_DIRECT)"
        threads = aio_config.intra_op_parallelism if self._aio is not None else 1
        self.alignment = io_alignment(directory, threads)
        self._writer = self._new_engine()
        self._idle_readers = []
        alloc, free = locked_allocator() if self._aio is not None else (None, None)
        self._host_budget = host_budget_bytes
        # Sealed pages in flight before the writer waits (a small stream would otherwise sit in host buffers whole
        # until flush()).
        self._write_queue_bytes = self._within_budget(_WRITE_QUEUE_BYTES)
        self._buffers = BufferCache(self.alignment, alloc, free, max_cached_bytes=self._cache_bound(0))
        self._resources.buffers = self._buffers
        self._nvme_streams = {}
        self._in_flight = []  # (stream, kind, entry, buffer) written but not yet waited for
        self._in_flight_bytes = 0
        self._error = None

    def _within_budget(self, nbytes: int) -> int:
        """nbytes, capped at half the host budget (at least 1 MiB) when there is one."""
        return nbytes if self._host_budget is None else min(nbytes, max(self._host_budget // 2, 1 << 20))

    def _cache_bound(self, read_bytes: int) -> int:
        """Free buffers kept for reuse: the write queue's worth, or two of the largest reads (a walk releases one
        layer as it issues the next), within the host budget."""
        return self._within_budget(max(_WRITE_QUEUE_BYTES, 2 * read_bytes))

    @property
    def engine_kind(self) -> str:
        return self._writer.kind

    def _finalize_state(self) -> _Resources:
        return self._resources

    @staticmethod
    def _finalize(resources: _Resources) -> None:
        try:
            resources.close()
        except Exception:
            pass  # at exit or in garbage collection there is no one to report to; the files are gone either way

    def _new_engine(self) -> AioEngine | BufferedEngine:
        engine = (AioEngine(self._aio, self.aio_config, self.alignment) if self._aio is not None
                  else BufferedEngine(self.alignment))
        self._resources.engines.append(engine)
        return engine

    # -- streams -----------------------------------------------------------------------------------------
    def _create_stream(self, info: StreamInfo, kind: str) -> None:
        key = (info.layer, info.name)
        stream = self._nvme_streams.get(key)
        if stream is None:
            page_bytes = self.page_tokens * info.token_bytes
            stream = _Stream(info, max(round_up(page_bytes, self.alignment), self.alignment), page_bytes)
            self._nvme_streams[key] = stream
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", info.name)
        path = os.path.join(self.directory, f"L{info.layer:03d}-{safe}-{kind}.pages")
        size = -(-info.tokens // self.page_tokens) * stream.slot_bytes
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise PageFileError(f"cannot create page file {path}: {error}") from None
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no preallocation here: checked on write
                os.close(fd)
                os.unlink(path)
                raise PageFileError(f"no space for page file {path} ({size} B): {error}") from None
        os.close(fd)
        stream.paths[kind] = path

    def host_bytes(self) -> int:
        return self._buffers.bytes_held() if not self._released else 0

    # -- writes ------------------------------------------------------------------------------------------
    def _write_state(self, info: StreamInfo, start: int, values_cpu: torch.Tensor) -> None:
        self._check_usable()
        stream = self._nvme_streams[(info.layer, info.name)]
        rows = values_cpu.view(torch.uint8).reshape(values_cpu.shape[0], info.token_bytes)
        tb = info.token_bytes
        done = 0
        while done < rows.shape[0]:
            entry = self.table.lookup(info.layer, info.name, start + done, start + done + 1)[0]
            if entry.state is PageState.FREE:
                stream.tail = self._buffers.take(stream.slot_bytes)
                advance(entry, PageState.FILLING)
            elif entry.state is PageState.RESIDENT:  # appending after flush(): re-open the partial page
                stream.tail = self._load_page(stream, "state", entry)
                advance(entry, PageState.FILLING)
            if entry.state is not PageState.FILLING or stream.tail is None:
                raise AssertionError(f"appending to {entry!r} without a tail buffer")
            take = min(rows.shape[0] - done, entry.end - entry.start - entry.filled)
            offset = entry.filled * tb
            stream.tail[offset: offset + take * tb].copy_(rows[done: done + take].reshape(-1))
            entry.filled += take
            done += take
            if entry.filled == entry.end - entry.start:
                tail, stream.tail = stream.tail, None
                self._seal(stream, "state", entry, tail)

    def _seal(self, stream: _Stream, kind: str, entry: PageEntry, buffer: torch.Tensor) -> None:
        """Checksum a filled page and submit its write; the buffer comes back when the write queue drains."""
        filled = entry.filled * stream.info.token_bytes
        buffer[filled: stream.slot_bytes].zero_()  # deterministic padding
        entry.checksum = _crc(buffer[:filled])
        advance(entry, PageState.IN_FLIGHT)
        self._in_flight.append((stream, kind, entry, buffer))
        self._in_flight_bytes += stream.slot_bytes
        self._submit_write(buffer[: stream.slot_bytes], stream.paths[kind], entry.index * stream.slot_bytes)
        if self._in_flight_bytes >= self._write_queue_bytes:
            self._drain_writes()

    def _submit_write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        try:
            self._writer.submit_write(buffer, path, offset)
        except Exception as error:  # the file could not be opened: its pages are incomplete
            self._error = error
            raise

    def _drain_writes(self) -> None:
        in_flight, self._in_flight, self._in_flight_bytes = self._in_flight, [], 0
        try:
            self._writer.wait()
        except Exception as error:
            self._error = error
            raise
        finally:
            # The transfers have completed (or failed) either way: the buffers are free again. After a failure
            # the pool is marked unusable, so a page marked RESIDENT here is never read.
            for _, _, entry, buffer in in_flight:
                advance(entry, PageState.RESIDENT)
                self._buffers.give(buffer)

    def _flush(self) -> None:
        self._check_usable()
        for stream in self._nvme_streams.values():
            if stream.tail is not None:
                entry = next(e for e in self.table.entries(stream.info.layer, stream.info.name)
                             if e.state is PageState.FILLING)
                tail, stream.tail = stream.tail, None
                self._seal(stream, "state", entry, tail)
        self._drain_writes()

    # -- reads -------------------------------------------------------------------------------------------
    def _fetch(self, stream: _Stream, kind: str, entries: list[PageEntry],
               lend: bool = False) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start reading `entries` (consecutive pages) into one landing buffer; returns (buffer, finish).

        finish() waits, verifies every page read from the file, and returns nothing; it always gives the
        reader engine back. The caller gives the buffer back, unless it was lent (`lend`: it returns to the cache
        by itself once no tensor views it).
        """
        if any(e.state is PageState.IN_FLIGHT for e in entries):
            self._drain_writes()
        slot = stream.slot_bytes
        nbytes = len(entries) * slot
        self._buffers.max_cached_bytes = max(self._buffers.max_cached_bytes, self._cache_bound(nbytes))
        landing = self._buffers.lend(nbytes) if lend else self._buffers.take(nbytes)
        engine = self._idle_readers.pop() if self._idle_readers else self._new_engine()
        path = stream.paths[kind]
        run = []  # consecutive resident pages: one request
        # (row, page, its bytes, its checksum) of every page read from the file, as they were when the read was
        # issued: a page filling then is copied from its tail and may be sealed (RESIDENT, a new checksum) before
        # finish() runs, and a resident one re-opened and grown; finish() checks what was read, as it was
        from_file = []

        def submit_run() -> None:
            if run:
                first = run[0][0]
                engine.submit_read(landing[first * slot: (run[-1][0] + 1) * slot], path, run[0][1].index * slot)
                from_file.extend((row, entry, entry.filled * stream.info.token_bytes, entry.checksum)
                                 for row, entry in run)
                run.clear()

        try:
            for row, entry in enumerate(entries):
                if entry.state is PageState.RESIDENT:
                    run.append((row, entry))
                    continue
                submit_run()
                target = landing[row * slot: (row + 1) * slot]
                if entry.state is PageState.FILLING and kind == "state":
                    target[: entry.filled * stream.info.token_bytes].copy_(
                        stream.tail[: entry.filled * stream.info.token_bytes])
                elif entry.state is PageState.FREE:
                    target.zero_()
                else:
                    raise AssertionError(f"reading {entry!r}")
            submit_run()
        except BaseException:
            self._finish_reader(engine)
            if not lend:
                self._buffers.give(landing)
            raise

        def finish() -> None:
            self._finish_reader(engine)
            for row, entry, nbytes, checksum in from_file:
                if _crc(landing[row * slot: row * slot + nbytes]) != checksum:
                    self._error = PageFileError(
                        f"page file {path} is corrupted: page {entry.index} (tokens [{entry.start}, "
                        f"{entry.start + entry.filled}) of layer {entry.layer} {entry.name!r}) fails its checksum")
                    raise self._error

        return landing, finish

    def _finish_reader(self, engine: AioEngine | BufferedEngine) -> None:
        try:
            engine.wait()
        except Exception as error:
            self._error = error
            raise
        finally:
            self._idle_readers.append(engine)

    def _typed_pages(self, stream: _Stream, landing: torch.Tensor, count: int) -> torch.Tensor:
        """The landing buffer's pages as [count * page_tokens, *shape] (a view when pages need no padding)."""
        info = stream.info
        rows = landing[: count * stream.slot_bytes].view(count, stream.slot_bytes)[:, : stream.page_bytes]
        return rows.view(info.dtype).reshape(count * self.page_tokens, *info.shape)

    def _read(self, info: StreamInfo, kind: str, start: int, end: int) -> ReadTicket:
        self._check_usable()
        stream = self._nvme_streams[(info.layer, info.name)]
        entries = self.table.lookup(info.layer, info.name, start, end, kind)
        # On a CPU compute device the landing buffer itself becomes the result when its pages need no padding:
        # it is lent, and returns to the cache once the caller drops every view of it. Otherwise the pages are
        # copied out (to the accelerator, or gathered from padded slots) and the buffer is reused at once.
        lend = self.device.type == "cpu" and stream.slot_bytes == stream.page_bytes
        landing, finish = self._fetch(stream, kind, entries, lend=lend)
        first = entries[0].start

        def result() -> torch.Tensor:
            try:
                self._check_open()  # a read issued before release() and collected after it is a bug
                finish()
                pages = self._typed_pages(stream, landing, len(entries))[start - first: end - first]
                if lend:
                    return pages
                out = torch.empty((end - start, *info.shape), dtype=info.dtype, device=self.device)
                out.copy_(pages)
                return out
            finally:
                if not lend:
                    self._buffers.give(landing)

        return ReadTicket(f"tokens [{start}, {end}) of ({info.layer}, {info.name!r}, {kind}) from "
                          f"{stream.paths[kind]}", result)

    def _load_page(self, stream: _Stream, kind: str, entry: PageEntry) -> torch.Tensor:
        """One resident page, read synchronously into a buffer the caller owns (re-opening a flushed page)."""
        landing, finish = self._fetch(stream, kind, [entry])
        try:
            finish()
        except BaseException:
            self._buffers.give(landing)
            raise
        return landing

    # -- gradient pages ----------------------------------------------------------------------------------
    def _accumulate_grad(self, info: StreamInfo, start: int, grad_cpu: torch.Tensor) -> None:
        self._check_usable()
        stream = self._nvme_streams[(info.layer, info.name)]
        end = start + grad_cpu.shape[0]
        entries = self.table.lookup(info.layer, info.name, start, end, "grad")
        landing, finish = self._fetch(stream, "grad", entries)
        try:
            finish()
        except BaseException:
            self._buffers.give(landing)
            raise
        slot = stream.slot_bytes
        for row, entry in enumerate(entries):
            page = landing[row * slot: row * slot + stream.page_bytes].view(info.dtype)
            page = page.view(self.page_tokens, *info.shape)
            lo, hi = max(start, entry.start), min(end, entry.end)
            page[lo - entry.start: hi - entry.start].add_(grad_cpu[lo - start: hi - start])
            advance(entry, PageState.FILLING)
            entry.filled = entry.end - entry.start
        # Written back from the landing buffer, so it is given back only after the queue drains.
        for row, entry in enumerate(entries):
            filled = entry.filled * info.token_bytes
            data = landing[row * slot: (row + 1) * slot]
            data[filled:].zero_()
            entry.checksum = _crc(data[:filled])
            advance(entry, PageState.IN_FLIGHT)
        try:
            self._submit_write(landing[: len(entries) * slot], stream.paths["grad"], entries[0].index * slot)
            self._drain_writes()
        finally:
            for entry in entries:
                if entry.state is PageState.IN_FLIGHT:
                    advance(entry, PageState.RESIDENT)
            self._buffers.give(landing)

    # -- teardown ----------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._error is not None:
            raise PageFileError(f"the NVMe page pool in {self.directory} is unusable after an earlier error: "
                                f"{self._error}")

    def _free(self) -> None:
        try:
            if self._in_flight:
                try:
                    self._drain_writes()
                except Exception:
                    pass  # releasing anyway; the error was or will be reported by the operation that hit it
        finally:
            for stream in self._nvme_streams.values():
                stream.tail = None
            self._resources.close()
