"""Peak memory is flat in G: replaying one member at a time keeps only one response's graph alive.

Each configuration runs in a fresh process; the peak is the kernel's high-water mark (VmHWM) of that process over
the whole step. 2% of the ~0.5 GiB peak is ~10 MiB: far below what one extra response graph per member would add
(G = 8 vs 2 keeps six more graphs alive in a conventional step) and above the allocator's warm-up drift.
"""

import pytest

from ds_longstraw.bench import run_fresh


@pytest.mark.slow
def test_peak_memory_flat_in_group_size():
    small = run_fresh("longstraw-detached", 16384, 2, 48)
    large = run_fresh("longstraw-detached", 16384, 8, 48)
    growth = (large["process_peak_bytes"] - small["process_peak_bytes"]) / small["process_peak_bytes"]
    assert growth <= 0.02, f"peak grew {100 * growth:.2f}% from G=2 to G=8"
    # The retained state does not depend on G at all.
    assert large["retained_bytes"] == small["retained_bytes"]
