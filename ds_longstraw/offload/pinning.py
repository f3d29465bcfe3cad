"""Host memory for page arenas: pinned where the accelerator can pin, plain otherwise.

DeepSpeed's accelerator decides how to pin (`get_accelerator().pin_empty`): cudaHostAlloc on CUDA; on the CPU
accelerator nothing (torch cannot pin without a device) unless DS_PIN_MEMORY_BACKEND=native, which page-locks
with mlock through DeepSpeed's pin_memory op. That op aborts the process when mlock fails, so the native path is
only taken when this process may lock the bytes (alignment.can_lock_memory); otherwise memory stays pageable.
"""

import os
from collections.abc import Callable, Sequence

import torch

from .alignment import can_lock_memory


def _native_backend() -> bool:
    return os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() == "native"


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """An uninitialised host tensor and whether it is pinned (page-locked)."""
    shape = tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), False
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    native = _native_backend()
    if native and not can_lock_memory(2 * nbytes):
        return torch.empty(shape, dtype=dtype), False
    if accelerator.device_name() == "cpu" and not native:
        return torch.empty(shape, dtype=dtype), False  # the CPU accelerator's pinning is a no-op
    try:
        tensor = accelerator.pin_empty(shape, dtype=dtype)
    except (RuntimeError, ValueError):  # out of pinnable memory: pageable memory still works, only slower
        return torch.empty(shape, dtype=dtype), False
    return tensor, bool(accelerator.is_pinned(tensor))


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    tensor, pinned = host_empty(shape, dtype)
    tensor.zero_()
    return tensor, pinned


_PIN_HANDLE = None


def locked_allocator() -> tuple[Callable[[int], torch.Tensor], Callable[[torch.Tensor], None]]:
    """(alloc, free) of page-aligned, page-locked uint8 buffers from DeepSpeed's pin_memory op, the allocator the
    aio op recognises (it transfers such buffers without a bounce copy). Only for processes that may lock
    without limit (alignment.memory_lock_unlimited): the op aborts the process when mlock fails."""
    global _PIN_HANDLE
    if _PIN_HANDLE is None:
        from deepspeed.ops.op_builder import PinMemoryBuilder

        _PIN_HANDLE = PinMemoryBuilder().load(verbose=False).pin_handle()
    handle, example = _PIN_HANDLE, torch.empty(0, dtype=torch.uint8)

    def alloc(nbytes: int) -> torch.Tensor:
        return handle.new_cpu_locked_tensor(nbytes, example)

    def free(buffer: torch.Tensor) -> None:
        handle.free_cpu_locked_tensor_by_ptr(buffer.data_ptr())

    return alloc, free
