import glob
import os
import sys

# Tiny models gain nothing from intra-op threads, and tests that start several ranks on a 2-core machine
# oversubscribe it (OpenMP spin-waits then slow torch down 10-30x): one thread per process, subprocesses included.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under the interpreter where no GPU is present (CI, CPU machines); set before triton is
# imported. On a CUDA machine they compile for the device.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Tests import their helpers (tiny models, references) as plain modules from this folder.
sys.path.insert(0, os.path.dirname(__file__))


def _mapped_by_a_live_process(path):
    """True when some process still maps `path` (a rank of another session's job, say)."""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as handle:
                if path in handle.read():
                    return True
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return False


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """DeepSpeed's CPU all-reduce keeps its buffers in /dev/shm files that no rank removes; the engine and
    launcher tests start many such process groups, and repeated runs filled a 24 GiB tmpfs (memory that
    the next run then lacked). Remove the ones this session created once every rank has exited, but none that
    a live process still maps: another session's job running at the same time keeps its buffers."""
    pattern = "/dev/shm/deepspeed_allreduce_buffer_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        if _mapped_by_a_live_process(path):
            continue
        try:
            os.remove(path)
        except OSError:
            pass


# Tests live in folders by kind; each folder is a marker, and the two whose tests start several ranks (forked gloo
# processes, or the real `deepspeed` launcher), the suite's cost, are slow as well: `pytest -m "not slow"` is the
# single-process suite, `pytest tests/unit` the fast one.
KINDS = {"unit": False, "equivalence": False, "distributed": True, "launcher": True}  # folder -> slow


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = item.path.parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
            if KINDS[kind]:
                item.add_marker(pytest.mark.slow)
