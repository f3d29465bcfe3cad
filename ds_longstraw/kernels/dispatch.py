"""Which path a kernel takes: its plain reference, or a fast path where the device and the installed libraries
allow one.

Every fast path stands beside a reference with the same signature and is taken only when `fast_path` says so:
    mode "auto"       (the default) the fast path where its tensors live on CUDA and its library imports
    mode "reference"  the plain torch path everywhere (the "kernels" key of the longstraw block; for debugging a
                      fast path against its reference on the same data, and for machines whose libraries misbehave)
CPU tensors always take the project's own kernels, whatever is installed: some libraries (flash-linear-attention)
import fine on a CPU machine and then fail on CPU tensors.
"""

import importlib.util
from contextlib import contextmanager
from functools import cache

MODES = ("auto", "reference")
_mode = "auto"

# Which library serves attention on CUDA in mode "auto" (kernels/attention/flash.py or cudnn.py); both return the
# lse and take its gradient. cuDNN by default: on the H200 a 1,024-token replay block's forward + backward took
# 0.55-0.65x flash's time over 8K-262K keys, and less memory (BENCHMARKS.md, "On one H200": bench/gpu_check.py times
# both side by side). Flash serves the masks cuDNN does not express (causal offsets other than a block's own keys).
ATTENTION_LIBRARIES = ("flash", "cudnn")
_attention_library = "cudnn"


def set_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {MODES}")
    global _mode
    _mode = mode


def current_mode() -> str:
    return _mode


def attention_library() -> str:
    return _attention_library


def set_attention_library(library: str) -> None:
    if library not in ATTENTION_LIBRARIES:
        raise ValueError(f"attention library {library!r}: expected one of {ATTENTION_LIBRARIES}")
    global _attention_library
    _attention_library = library


@contextmanager
def use_attention_library(library: str):
    """Run a block with `library` serving CUDA attention, restoring the previous choice after (on error too)."""
    previous = _attention_library
    set_attention_library(library)
    try:
        yield
    finally:
        set_attention_library(previous)


@contextmanager
def kernel_mode(mode: str):
    """Run a block with the kernels in `mode`, restoring the previous mode after (on error too)."""
    previous = _mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


@cache
def available(module: str) -> bool:
    """Whether `module` can be imported (checked once, without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fast_path(tensor, library: str | None = None) -> bool:
    """Whether a fast path may run on `tensor`: mode "auto", a CUDA tensor, and `library` (a module name) importable
    where the path needs one."""
    if _mode != "auto" or tensor.device.type != "cuda":
        return False
    return library is None or available(library)


# ---- which paths ran ---------------------------------------------------------------------------------------------
# A fast path never replaces its reference silently: every dispatch site records the path it took, and
# `paths_taken` says which ran and how often (the launcher prints it after the first step).
_taken: dict[str, dict[str, int]] = {}


def record(kernel: str, path: str) -> None:
    """Counts one call of `kernel` on `path` ("flash", "fla", "triton", "torch_chunked", ...)."""
    paths = _taken.setdefault(kernel, {})
    paths[path] = paths.get(path, 0) + 1


def paths_taken() -> dict[str, dict[str, int]]:
    """{kernel: {path: calls}} in this process since it started or since `reset_paths_taken`."""
    return {kernel: dict(paths) for kernel, paths in _taken.items()}


def reset_paths_taken() -> None:
    _taken.clear()


def format_paths(taken: dict[str, dict[str, int]]) -> str:
    """"attention forward: flash x 96; gated delta rule: fla x 144, ...": kernels in the order they first ran,
    each path with its calls."""
    return "; ".join(f"{kernel}: " + ", ".join(f"{path} x {calls:,}" for path, calls in paths.items())
                     for kernel, paths in taken.items())


def describe_paths() -> str:
    """One line: "kernels (mode auto): " and `format_paths` of what ran in this process."""
    return f"kernels (mode {_mode}): {format_paths(paths_taken()) or 'none ran'}"
