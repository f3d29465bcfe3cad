"""A small cache of aligned host I/O buffers (page-locked when the aio op is in use).

Page-locking a buffer faults in and mlocks every page, which costs more than the transfer it serves; the NVMe
tier therefore reuses its buffers. Two ways out:
- `take` / `give`: a base tensor of at least the asked size, for the caller to slice and hand back (write
  buffers, tail pages, landing buffers that are copied to the accelerator);
- `lend`: a tensor over a cached block with a storage of its own. The caller may hand it (or views of it) to
  anyone: when the last tensor on that storage is gone, a finalizer on the storage returns the block. This is
  how staged pages reach a CPU compute device without a copy.
Cached (free) bytes beyond `max_cached_bytes` are freed. Buffers in use are bounded by the callers: one tail page
per stream being filled, the write queue's depth, and the landing buffers of the reads the stager keeps.
A lent block still viewed when the cache closes is freed when its last view goes, not before.
"""

import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from .alignment import aligned_empty, round_up


class BufferCache:
    def __init__(self, alignment: int, alloc: Callable[[int], torch.Tensor] | None = None,
                 free: Callable[[torch.Tensor], None] | None = None, max_cached_bytes: int = 64 << 20) -> None:
        self.alignment = alignment
        self._alloc = alloc  # nbytes -> page-aligned uint8 tensor (locked), or None for pageable aligned memory
        self._free = free
        self.max_cached_bytes = max_cached_bytes
        self.locked = alloc is not None
        self._lock = threading.Lock()
        # Lent blocks come back through finalizers, which run wherever the last view dies: in another thread, or
        # in this one in the middle of a method here (garbage collection). They only queue the block; the methods
        # take the queue in under the lock.
        self._returns = deque()
        self._cached = []  # bases not in use
        self._in_use = {}  # id(base) -> base
        self._lent = set()  # ids of in-use bases handed out by lend()
        self._closed = False

    def take(self, nbytes: int) -> torch.Tensor:
        nbytes = max(round_up(nbytes, self.alignment), self.alignment)
        with self._lock:
            if self._closed:
                raise AssertionError("buffer taken from a closed cache")
            self._drain()  # blocks whose last view died since the last call are free again
            # Smallest cached buffer that fits and wastes at most half of itself.
            fits = [b for b in self._cached if nbytes <= b.numel() <= 2 * nbytes]
            base = min(fits, key=lambda b: b.numel()) if fits else None
            if base is not None:
                self._cached = [b for b in self._cached if b is not base]
                self._in_use[id(base)] = base
            self._drain()
        if base is None:
            base = self._alloc(nbytes) if self._alloc is not None else aligned_empty(nbytes, max(self.alignment, 4096))
            with self._lock:
                self._in_use[id(base)] = base
                self._drain()
        return base

    def give(self, base: torch.Tensor) -> None:
        with self._lock:
            self._give(id(base))
            self._drain()

    def lend(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least `nbytes` whose block returns to the cache once no tensor views it."""
        base = self.take(nbytes)
        block = (ctypes.c_uint8 * base.numel()).from_address(base.data_ptr())
        loan = torch.frombuffer(block, dtype=torch.uint8)  # same memory, a storage of its own
        with self._lock:
            self._lent.add(id(base))
        weakref.finalize(loan.untyped_storage(), self._returned, id(base))
        return loan

    def _returned(self, key: int) -> None:
        self._returns.append(key)
        if self._closed and self._lock.acquire(blocking=False):  # nobody else will take the queue in any more
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._returns:
            self._give(self._returns.popleft())

    def _give(self, key: int) -> None:  # with the lock held
        base = self._in_use.pop(key, None)
        self._lent.discard(key)
        if base is None:
            raise AssertionError("a buffer given back twice, or not taken from this cache")
        if self._closed:  # a lent block outlived the cache
            self._release(base)
            return
        self._cached.append(base)
        while self._cached and sum(b.numel() for b in self._cached) > self.max_cached_bytes:
            self._release(self._cached.pop(0))

    def bytes_held(self) -> int:
        with self._lock:
            self._drain()
            return sum(b.numel() for b in self._cached) + sum(b.numel() for b in self._in_use.values())

    def close(self) -> None:
        """Free every cached buffer and every buffer taken but not lent (their transfers have been drained by the
        owner); lent blocks still viewed are freed when their last view goes."""
        with self._lock:
            self._drain()
            self._closed = True
            taken = [key for key in list(self._in_use) if key not in self._lent]
            for base in self._cached + [self._in_use.pop(key) for key in taken]:
                self._release(base)
            self._cached.clear()
            self._drain()

    def _release(self, base: torch.Tensor) -> None:
        if self._free is not None:
            self._free(base)
