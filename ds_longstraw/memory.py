"""Per-phase peak memory and wall time.

On an accelerator the peak is the allocator's high-water mark (reset at each phase start). On CPU it is the
kernel's high-water mark of resident memory (VmHWM), reset by writing "5" to /proc/self/clear_refs: sampling
RSS at a call misses peaks. The CPU figure is process-wide (weights included); compare phases and runs, each in
a fresh process, rather than reading it as state bytes.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class PhaseStats:
    seconds: float = 0.0
    peak_bytes: int = 0


def _read_status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_host_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def host_peak_bytes() -> int:
    return _read_status_kib("VmHWM") * 1024


def host_current_bytes() -> int:
    return _read_status_kib("VmRSS") * 1024


def _load_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None


_MALLOC_TRIM = _load_malloc_trim()


def return_freed_host_memory(device) -> None:
    """After a unit of work whose temporaries are freed (a member's graph, a prefix segment, a capture chunk) on a
    CPU device: hand the heap pages glibc keeps back to the kernel. Freed small blocks scattered among live ones
    otherwise stay resident, and the resident peak grows with every member replayed (measured: +13 MiB from G=2
    to G=8 at 8K tokens) although nothing is retained. A no-op on accelerators and without glibc."""
    if _MALLOC_TRIM is not None and torch.device(device).type == "cpu":
        _MALLOC_TRIM(0)


class PhaseMeter:
    """Records seconds and peak bytes of named phases; a phase entered twice accumulates time, keeps the max."""

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.phases: dict[str, PhaseStats] = {}

    @contextmanager
    def phase(self, name):
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_host_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            if on_cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = host_peak_bytes()
            stats = self.phases.setdefault(name, PhaseStats())
            stats.seconds += time.perf_counter() - start
            stats.peak_bytes = max(stats.peak_bytes, peak)

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)
