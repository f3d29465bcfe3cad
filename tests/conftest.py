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


# Tests that start several ranks (forked gloo processes, or the real `deepspeed` launcher) are the suite's cost: a
# file whose source starts them is marked slow as a whole, so `pytest -m "not slow"` is the single-process suite.
_STARTS_RANKS = ("run_cp(", "run_masks(", "fork_ranks(", "mp.get_context(", "init_process_group(", "start([",
                 "launching import REPO, finish, free_port, start", "from cp_scripts.")
_starts_ranks = {}


def _file_starts_ranks(path) -> bool:
    if path not in _starts_ranks:
        with open(path) as handle:
            source = handle.read()
        _starts_ranks[path] = any(marker in source for marker in _STARTS_RANKS)
    return _starts_ranks[path]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _file_starts_ranks(str(item.path)):
            item.add_marker(pytest.mark.slow)
