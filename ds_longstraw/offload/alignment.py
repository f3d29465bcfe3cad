"""I/O alignment, aligned host buffers, and what a page-file directory allows (O_DIRECT, mlock).

DeepSpeed's aio op opens every file O_DIRECT and splits each request evenly over its `intra_op_parallelism`
threads. A request whose size per thread is not a multiple of 512 B, or whose buffer or file offset is not
aligned, "succeeds" and transfers nothing; so every page slot, offset and buffer here is aligned to
`io_alignment(...)`: a multiple of 512 B per thread, of DeepSpeed's 1 KiB swap-file padding, and of the
filesystem's block size.
"""

import errno
import math
import mmap
import os
import uuid

import torch

_MIN_ALIGN = 1024  # DeepSpeed pads swap files to 1 KiB (AIO_ALIGNED_BYTES, deepspeed/runtime/swap_tensor/utils.py)
_PER_THREAD = 512  # O_DIRECT sector size the aio op assumes per thread
_CAP_IPC_LOCK = 14


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def io_alignment(directory: str, intra_op_parallelism: int = 1) -> int:
    """Byte alignment of sizes and offsets of page I/O in `directory`."""
    try:
        block = os.statvfs(directory).f_bsize
    except OSError:
        block = 4096
    if block <= 0 or block & (block - 1) or block > 1 << 20:  # not a sane power of two: assume 4 KiB sectors
        block = 4096
    return math.lcm(_MIN_ALIGN, _PER_THREAD * intra_op_parallelism, block)


def aligned_empty(nbytes: int, alignment: int = 4096) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte is `alignment`-aligned (over-allocates one alignment)."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip: skip + nbytes]


def probe_direct_io(directory: str) -> bool:
    """True when `directory` accepts O_DIRECT reads and writes of one aligned block.

    Filesystems that refuse O_DIRECT (some tmpfs, overlay and network mounts) answer EINVAL at open or at the
    first transfer; they get buffered I/O. Other errors (permission, no space) are the caller's to report.
    """
    path = os.path.join(directory, f".longstraw-odirect-probe-{uuid.uuid4().hex}")
    block = mmap.mmap(-1, 4096)  # anonymous mappings are page aligned, as O_DIRECT buffers must be
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as error:
            if error.errno == errno.EINVAL:
                return False
            raise
        try:
            block.write(b"\x5a" * 4096)
            if os.pwrite(fd, block, 0) != 4096:
                return False
            back = mmap.mmap(-1, 4096)
            try:
                return os.preadv(fd, [back], 0) == 4096 and back[:] == block[:]
            finally:
                back.close()
        except OSError as error:
            if error.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.close(fd)
    finally:
        block.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def can_lock_memory(nbytes: int) -> bool:
    """True when this process may mlock `nbytes` more bytes (CAP_IPC_LOCK or a large enough RLIMIT_MEMLOCK).

    DeepSpeed's pin_memory and aio ops assert (and the process aborts) when an mlock fails: check first.
    """
    if _has_cap_ipc_lock():
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= nbytes


def memory_lock_unlimited() -> bool:
    """True when mlock cannot fail for lack of allowance (CAP_IPC_LOCK, or RLIMIT_MEMLOCK unlimited).

    The aio op copies every transfer whose buffer is not page-locked through a bounce buffer it mlocks itself, so
    with a finite allowance a large enough transfer aborts the process: the NVMe tier uses aio only without one.
    """
    if _has_cap_ipc_lock():
        return True
    import resource

    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False
