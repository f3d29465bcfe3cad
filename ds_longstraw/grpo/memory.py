"""Per-phase peak memory and wall time.

On an accelerator the peak is the allocator's high-water mark (reset at each phase start). On CPU it is the
kernel's high-water mark of resident memory (VmHWM), reset by writing "5" to /proc/self/clear_refs: sampling
RSS at a call misses peaks. The CPU figure is process-wide (weights included); compare phases and runs, each in
a fresh process, rather than reading it as state bytes.

Without the reset VmHWM is the peak since some earlier point of the process, not the phase's: a wrong number
that looks right. So a reset that fails raises HostPeakUnavailable (reset_host_peak, and PhaseMeter on CPU).
Where the reset cannot work (no /proc: macOS, Windows; a sandbox that refuses clear_refs, such as gVisor) a run
that does not need host peaks says so explicitly: DS_LONGSTRAW_HOST_PEAK=off makes PhaseMeter skip them (each CPU
phase then reports peak_bytes 0 with peak_measured False). reset_host_peak itself ignores that switch, and the
benchmarks refuse it (require_host_peaks): a benchmark exists to measure the peak.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

CLEAR_REFS = "/proc/self/clear_refs"
# PhaseMeter's host-peak decision on CPU: "measure" (default; fails loudly where it cannot) or "off" (not measured).
HOST_PEAK_ENV = "DS_LONGSTRAW_HOST_PEAK"
HOST_PEAK_CHOICES = ("measure", "off")


class HostPeakUnavailable(RuntimeError):
    """The host high-water mark could not be reset, so a peak read now would be stale."""


@dataclass
class PhaseStats:
    seconds: float = 0.0
    peak_bytes: int = 0
    cpu_seconds: float = 0.0  # this process's CPU time (all its threads) in the phase
    peak_measured: bool = True  # False: the peak was not measured (DS_LONGSTRAW_HOST_PEAK=off), peak_bytes is 0


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_host_peak() -> None:
    """Reset the kernel's resident high-water mark (VmHWM) to the current resident size (Linux 4.0+).

    Raises HostPeakUnavailable when /proc/self/clear_refs cannot be written: a peak read after a failed reset
    would be the process's earlier maximum, reported as this measurement's."""
    try:
        with open(CLEAR_REFS, "w") as refs:
            refs.write("5")
    except OSError as error:
        raise HostPeakUnavailable(
            f"cannot reset the host memory high-water mark: writing '5' to {CLEAR_REFS} failed ({error}). "
            f"Without that reset VmHWM is an earlier peak of this process, not this measurement's. Measure on "
            f"Linux 4.0+ with a writable /proc (not a sandbox that refuses clear_refs, such as gVisor); to run "
            f"without per-phase host peaks, set {HOST_PEAK_ENV}=off (phases then report peak_bytes 0, "
            f"peak_measured False)."
        ) from error


def host_peak_bytes() -> int:
    return _read_status_kib("VmHWM") * 1024


def free_device_bytes(device: torch.device | str | int) -> int:
    """Memory this rank may still take: on CUDA the device's free memory plus what torch's allocator holds unused;
    on CPU the host's available memory over the node's ranks (LOCAL_WORLD_SIZE, set by the launcher)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil

    return psutil.virtual_memory().available // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def host_current_bytes() -> int:
    return _read_status_kib("VmRSS") * 1024


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None


_MALLOC_TRIM = _load_malloc_trim()


def return_freed_host_memory(device: torch.device | str) -> None:
    """After a unit of work whose temporaries are freed (a member's graph, a prefix segment, a capture chunk) on a
    CPU device: hand the heap pages glibc keeps back to the kernel. Freed small blocks scattered among live ones
    otherwise stay resident, and the resident peak grows with every member replayed (measured: +13 MiB from G=2
    to G=8 at 8K tokens) although nothing is retained. A no-op on accelerators and without glibc."""
    if _MALLOC_TRIM is not None and torch.device(device).type == "cpu":
        _MALLOC_TRIM(0)


def host_peak_choice(value: str | None = None) -> str:
    """PhaseMeter's host-peak decision: `value`, else $DS_LONGSTRAW_HOST_PEAK, else "measure"."""
    choice = value if value is not None else os.environ.get(HOST_PEAK_ENV, "measure")
    if choice not in HOST_PEAK_CHOICES:
        source = "host_peak" if value is not None else f"${HOST_PEAK_ENV}"
        raise ValueError(f"{source} must be one of {HOST_PEAK_CHOICES}, got {choice!r}")
    return choice


def require_host_peaks(what: str) -> None:
    """For callers whose job is the peak (benchmarks): refuse DS_LONGSTRAW_HOST_PEAK=off, under which PhaseMeter
    would report their phases unmeasured."""
    if host_peak_choice() == "off":
        raise ValueError(f"{what} measures host memory peaks: unset {HOST_PEAK_ENV} (it is 'off')")


class PhaseMeter:
    """Records seconds and peak bytes of named phases; a phase entered twice accumulates time, keeps the max.

    host_peak (CPU devices): "measure" resets VmHWM at each phase start and raises HostPeakUnavailable before the
    phase runs where it cannot; "off" records time only. None: $DS_LONGSTRAW_HOST_PEAK, default "measure"."""

    def __init__(self, device: torch.device | str | None = None, host_peak: str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.phases: dict[str, PhaseStats] = {}
        self.host_peak = host_peak_choice(host_peak)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        on_cuda = self.device.type == "cuda"
        measured = on_cuda or self.host_peak == "measure"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif measured:
            reset_host_peak()
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            if on_cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = host_peak_bytes() if measured else 0
            stats = self.phases.setdefault(name, PhaseStats())
            stats.seconds += time.perf_counter() - start
            stats.cpu_seconds += time.process_time() - cpu_start
            stats.peak_bytes = max(stats.peak_bytes, peak)
            stats.peak_measured = stats.peak_measured and measured

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)
