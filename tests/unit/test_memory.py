"""Peak memory is flat in G: replaying one member at a time keeps only one response's graph alive.

Each configuration runs in a fresh process; the peak is the kernel's high-water mark (VmHWM) of that process over
the whole step. 2% of the ~0.5 GiB peak is ~10 MiB: far below what one extra response graph per member would add
(G = 8 vs 2 keeps six more graphs alive in a conventional step) and above the allocator's warm-up drift.

A host peak is a measurement only after the high-water mark was reset: where /proc/self/clear_refs cannot be
written (the tests below make the write fail), reset_host_peak, PhaseMeter on CPU, the transaction that uses it and
the benchmarks raise HostPeakUnavailable instead of reporting an earlier peak of the process. DS_LONGSTRAW_HOST_PEAK
=off is the explicit decision to run without host peaks: phases then say they were not measured.
"""

import builtins
import errno

import pytest
import torch
from models import tiny_qwen3_5

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.grpo import memory
from ds_longstraw.grpo.memory import (
    CLEAR_REFS,
    HOST_PEAK_ENV,
    HostPeakUnavailable,
    PhaseMeter,
    host_current_bytes,
    host_peak_bytes,
    reset_host_peak,
    return_freed_host_memory,
)
from ds_longstraw.tools.bench import run_fresh, run_one

MIB = 2**20


@pytest.mark.slow
def test_peak_memory_flat_in_group_size():
    small = run_fresh("longstraw-detached", 16384, 2, 48)
    large = run_fresh("longstraw-detached", 16384, 8, 48)
    growth = (large["process_peak_bytes"] - small["process_peak_bytes"]) / small["process_peak_bytes"]
    assert growth <= 0.02, f"peak grew {100 * growth:.2f}% from G=2 to G=8"
    # The retained state does not depend on G at all.
    assert large["retained_bytes"] == small["retained_bytes"]


def test_reset_lowers_the_high_water_mark():
    """The reset is real on this machine (so the failures below are the only way a stale peak could be read): after
    a freed 128 MiB tensor, VmHWM stays 100+ MiB above the resident set until reset_host_peak brings it down."""
    buffer = torch.ones(128 * MIB // 4)  # written, so resident
    del buffer
    return_freed_host_memory("cpu")
    assert host_peak_bytes() - host_current_bytes() > 100 * MIB, "test setup: the tensor must have raised VmHWM"
    reset_host_peak()
    assert host_peak_bytes() - host_current_bytes() < 100 * MIB


class _RefusingFile:
    """A clear_refs that opens but refuses the "5" (EINVAL: a kernel before 4.0)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text):
        raise OSError(errno.EINVAL, "Invalid argument")


@pytest.fixture(params=["open-denied", "write-refused"])
def failing_clear_refs(request, monkeypatch):
    """memory's writes to /proc/self/clear_refs fail (other files open normally); yields the attempted paths."""
    attempts = []

    def fake_open(path, *args, **kwargs):
        if path == CLEAR_REFS:
            attempts.append(path)
            if request.param == "open-denied":
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return _RefusingFile()
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(memory, "open", fake_open, raising=False)  # module global: shadows the builtin in memory
    monkeypatch.delenv(HOST_PEAK_ENV, raising=False)
    yield attempts


def _assert_names_the_cause(error):
    message = str(error.value)
    assert CLEAR_REFS in message and f"{HOST_PEAK_ENV}=off" in message, message
    assert isinstance(error.value, RuntimeError) and isinstance(error.value.__cause__, OSError)


def test_failed_reset_raises_naming_clear_refs(failing_clear_refs):
    with pytest.raises(HostPeakUnavailable) as error:
        reset_host_peak()
    _assert_names_the_cause(error)
    assert failing_clear_refs == [CLEAR_REFS]


def test_phase_meter_on_cpu_raises_before_the_phase_runs(failing_clear_refs):
    meter = PhaseMeter("cpu")
    ran = []
    with pytest.raises(HostPeakUnavailable) as error:
        with meter.phase("capture"):
            ran.append(True)
    _assert_names_the_cause(error)
    assert ran == [] and meter.phases == {}


def _tiny_group():
    gen = torch.Generator().manual_seed(0)
    return GRPOGroup(torch.randint(0, 97, (12,), generator=gen),
                     [torch.randint(0, 97, (3,), generator=gen) for _ in range(2)], rewards=[0.0, 1.0])


def test_transaction_on_cpu_fails_loudly(failing_clear_refs):
    """grpo_backward's phases are metered: a CPU run where the reset fails raises instead of reporting peaks."""
    with pytest.raises(HostPeakUnavailable) as error:
        grpo_backward(tiny_qwen3_5(), _tiny_group(), GRPOObjective(), longstraw={"capture_chunk": 5})
    _assert_names_the_cause(error)


def test_explicitly_unmeasured_host_peaks(failing_clear_refs, monkeypatch):
    """DS_LONGSTRAW_HOST_PEAK=off: the transaction runs without touching clear_refs, and every phase says its peak
    was not measured (0 bytes, peak_measured False) rather than reporting one."""
    monkeypatch.setenv(HOST_PEAK_ENV, "off")
    result = grpo_backward(tiny_qwen3_5(), _tiny_group(), GRPOObjective(), longstraw={"capture_chunk": 5})
    assert result.phases and failing_clear_refs == []
    for name, stats in result.phases.items():
        assert stats.peak_bytes == 0 and not stats.peak_measured, name
        assert stats.seconds > 0
    with pytest.raises(HostPeakUnavailable):  # the switch is PhaseMeter's: a direct reset still fails loudly
        reset_host_peak()


def test_measured_phases_say_so():
    meter = PhaseMeter("cpu", host_peak="measure")
    with meter.phase("work"):
        torch.ones(MIB)
    assert meter.phases["work"].peak_measured and meter.phases["work"].peak_bytes >= host_current_bytes() // 2


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_host_peak_switch_is_validated(monkeypatch, via):
    monkeypatch.setenv(HOST_PEAK_ENV, "no" if via == "environment" else "measure")
    source = "host_peak" if via == "argument" else rf"\${HOST_PEAK_ENV}"
    with pytest.raises(ValueError, match=f"{source} must be one of .* got 'no'"):
        PhaseMeter("cpu", host_peak="no" if via == "argument" else None)


def test_benchmark_fails_loudly(failing_clear_refs):
    """The benchmark's own step peak rests on the same reset."""
    with pytest.raises(HostPeakUnavailable) as error:
        run_one("longstraw-detached", 16, 2, 4)
    _assert_names_the_cause(error)


def test_benchmark_refuses_unmeasured_host_peaks(monkeypatch):
    """A benchmark reports per-phase peaks: it refuses the switch that turns them off (before any work)."""
    monkeypatch.setenv(HOST_PEAK_ENV, "off")
    with pytest.raises(ValueError, match=f"unset {HOST_PEAK_ENV}"):
        run_one("longstraw-detached", 16, 2, 4)
