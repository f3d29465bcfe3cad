"""The NVMe tier's failure modes end in a clear error that names the file or the config key, never in wrong
numbers, a hang or an aborted process; page files are removed on error as on success.

Covered: nvme_path unset, missing, not a directory, unwritable; a disk that cannot hold the state (at reserve
time, through RLIMIT_FSIZE, and on a real full tmpfs where this process may mount one); writes refused or cut
short inside a preallocated file, and writes that do not land on a filesystem without preallocation (both
raise when the write queue drains, naming the file); a page file that cannot be opened for writing; truncated,
corrupted and deleted page files; use after release; a pool dropped without release(); the host tier's memory
budget. Each runs with aio and with buffered I/O, and asserts that the engine it names is the one in use (the
pool falls back to buffered I/O silently where aio cannot run).
"""

import contextlib
import errno
import gc
import os
import re
import resource
import signal
import subprocess

import pytest
import torch

from ds_longstraw.config import AioConfig, OffloadConfig, parse_config
from ds_longstraw.offload import NvmePagePool, PageFileError, make_pool
from ds_longstraw.offload.alignment import memory_lock_unlimited
from ds_longstraw.offload.io_engine import AioEngine, BufferedEngine, load_aio

ENGINES = ["aio", "buffered"]


def _pool(path, engine, page_tokens=4, threads=1):
    """An NVMe pool on `engine` ("aio" or "buffered"), checked to really use it: the pool picks buffered I/O by
    itself where aio cannot run, and an aio test that ran buffered would prove nothing about aio."""
    if engine == "aio":
        try:
            load_aio()
        except RuntimeError as error:
            pytest.skip(f"libaio or DeepSpeed's aio op is unavailable here: {error}")
        if not memory_lock_unlimited():
            pytest.skip("RLIMIT_MEMLOCK is finite and CAP_IPC_LOCK missing: the NVMe pool uses buffered I/O "
                        "there by design (the aio op aborts the process when its mlock fails)")
    pool = NvmePagePool(page_tokens, nvme_path=str(path), aio_config=AioConfig(intra_op_parallelism=threads),
                        direct_io=engine == "aio")
    assert pool.engine_kind == engine, pool.io_reason
    assert isinstance(pool._writer, AioEngine if engine == "aio" else BufferedEngine)
    return pool


def _filled(path, engine, tokens=10):
    pool = _pool(path, engine)
    pool.reserve(0, "k", tokens, (2, 3), torch.float64)
    pool.append(0, "k", torch.randn(tokens, 2, 3, dtype=torch.float64))
    pool.flush()
    (directory,) = path.iterdir()
    return pool, directory / "L000-k-state.pages"


@contextlib.contextmanager
def file_size_limit(nbytes):
    """RLIMIT_FSIZE for this process: writes past it fail with EFBIG (SIGXFSZ ignored, so nothing dies)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@contextlib.contextmanager
def tmpfs(path, options):
    """A small tmpfs mounted at `path` (root only); skips where mounting is not allowed."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_nvme_path_unset_missing_or_not_a_directory(tmp_path):
    aio = AioConfig()
    with pytest.raises(ValueError, match="'longstraw.offload' .* nvme_path must name a directory"):
        parse_config({"offload": {"tier": "nvme"}})  # at the door, before any work
    with pytest.raises(ValueError, match="offload.nvme_path must name a directory"):
        NvmePagePool(4, nvme_path=None, aio_config=aio)
    missing = tmp_path / "no" / "such"
    with pytest.raises(ValueError, match=f"offload.nvme_path = '{missing}' does not exist"):
        NvmePagePool(4, nvme_path=str(missing), aio_config=aio)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        NvmePagePool(4, nvme_path=str(afile), aio_config=aio)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_nvme_path_unwritable(tmp_path):
    if os.geteuid() != 0:
        target = tmp_path / "readonly"
        target.mkdir(mode=0o500)
        context = contextlib.nullcontext(target)
    else:  # permission bits do not stop root: a read-only filesystem does
        context = tmpfs(tmp_path / "readonly", "ro,size=64k")
    with context as target:
        with pytest.raises(ValueError, match=f"offload.nvme_path = '{target}' is not writable"):
            NvmePagePool(4, nvme_path=str(target), aio_config=AioConfig())
        assert list(target.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_disk_too_small_fails_at_reserve_naming_the_file(engine, tmp_path):
    pool = _pool(tmp_path, engine)
    pool.reserve(0, "k", 8, (4,), torch.float32)
    with file_size_limit(1 << 16):
        with pytest.raises(PageFileError, match=r"no space for page file .*L005-v-state\.pages"):
            pool.reserve(5, "v", 100_000, (4,), torch.float32)  # 1.6 MB: over the limit
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("limit", [1 << 15, (1 << 15) + 100], ids=["refused", "short"])
@pytest.mark.parametrize("engine,threads", [("aio", 1), ("aio", 2), ("buffered", 1)],
                         ids=["aio", "aio-2threads", "buffered"])
def test_failed_write_inside_a_preallocated_file_raises_at_flush(engine, threads, limit, tmp_path):
    """Page files are preallocated, so a file's size cannot tell whether a write landed. RLIMIT_FSIZE refuses
    writes past the limit even inside the allocated size, and cuts short the one it falls inside ("short"): the
    buffered engine gets the error or the short count from pwrite; the aio op drops both (it never reads a
    request's result), so the aio engine reads back each write's last block. Either way flush(), which drains
    the write queue, raises naming the file and the first page that did not land, not a later read."""
    pool = _pool(tmp_path, engine, threads=threads)
    pool.reserve(0, "k", 4000, (8,), torch.float32)  # 1000 pages of 128 B, one aligned slot each
    (directory,) = tmp_path.iterdir()
    page_file = directory / "L000-k-state.pages"
    size = os.stat(page_file).st_size
    assert size == 1000 * pool.alignment > limit  # preallocated: every write ends inside the file
    first = limit // pool.alignment * pool.alignment  # the slot the limit falls in: the first write refused
    with file_size_limit(limit):
        pool.append(0, "k", torch.randn(4000, 8))  # writes submitted; the queue (32 MiB) is not full: no wait
        with pytest.raises(PageFileError, match=rf"write to page file {re.escape(str(page_file))} "
                                                rf"(did not land: bytes \[{first}, {first + pool.alignment}\)"
                                                rf"|failed at byte {limit} )"):
            pool.flush()
    assert os.stat(page_file).st_size == size  # what a size check would have seen: nothing wrong
    with pytest.raises(PageFileError, match="unusable after an earlier error"):
        pool.read(0, "k", 0, 4)  # never wrong numbers from a pool whose writes failed
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_page_file_that_cannot_be_opened_fails_at_write(engine, tmp_path):
    """A page file replaced (here by a directory) fails the write that opens it: at submission for aio (the op
    returns -1), when the queue drains for buffered I/O; the pool refuses further use either way."""
    pool = _pool(tmp_path, engine)
    pool.reserve(0, "k", 10, (2, 3), torch.float64)
    (directory,) = tmp_path.iterdir()
    page_file = directory / "L000-k-state.pages"
    page_file.unlink()
    page_file.mkdir()
    with pytest.raises(PageFileError, match=f"page file {re.escape(str(page_file))}"):
        pool.append(0, "k", torch.randn(10, 2, 3, dtype=torch.float64))
        pool.flush()
    with pytest.raises(PageFileError, match="unusable after an earlier error"):
        pool.flush()
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_writes_that_do_not_land_are_caught(engine, tmp_path, monkeypatch):
    """Without preallocation (a filesystem that does not support it) a full disk shows up when the writes
    complete: the buffered engine gets EFBIG from pwrite; the aio op ignores the result of a transfer, and the
    aio engine finds the file shorter than the write's end when it verifies the write."""
    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    pool = _pool(tmp_path, engine)
    pool.reserve(0, "k", 4000, (8,), torch.float32)  # 128 KB of pages
    with file_size_limit(1 << 15):
        with pytest.raises(PageFileError, match=r"page file .*L000-k-state\.pages"):
            pool.append(0, "k", torch.randn(4000, 8))
            pool.flush()
    with pytest.raises(PageFileError, match="unusable after an earlier error"):
        pool.read(0, "k", 0, 4)  # never wrong numbers from a pool whose writes failed
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_real_full_disk(engine, tmp_path):
    with tmpfs(tmp_path / "small", "size=256k") as small:
        pool = _pool(small, engine)
        pool.reserve(0, "k", 16, (8,), torch.float32)
        with pytest.raises(PageFileError, match=r"no space for page file .*L001-k-state\.pages.*No space left"):
            pool.reserve(1, "k", 1 << 16, (8,), torch.float32)  # 2 MiB into 256 KiB
        pool.release()
        assert list(small.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_truncated_page_file(engine, tmp_path):
    pool, page_file = _filled(tmp_path, engine)
    os.truncate(page_file, pool.alignment)  # keeps page 0, loses pages 1 and 2
    assert pool.read(0, "k", 0, 4).shape == (4, 2, 3)
    with pytest.raises(PageFileError, match=f"page file {page_file} is truncated"):
        pool.read(0, "k", 0, 10)  # would be a read past the end: the aio op aborts the process on those
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_corrupted_page_file(engine, tmp_path):
    pool, page_file = _filled(tmp_path, engine)
    with open(page_file, "r+b") as handle:  # flip one byte inside page 1's data
        handle.seek(pool.alignment + 17)
        byte = handle.read(1)
        handle.seek(pool.alignment + 17)
        handle.write(bytes([byte[0] ^ 0x40]))
    assert pool.read(0, "k", 0, 4).shape == (4, 2, 3)  # page 0 is intact
    with pytest.raises(PageFileError, match=rf"page file {page_file} is corrupted: page 1 .*checksum"):
        pool.read(0, "k", 2, 7)
    with pytest.raises(PageFileError, match="unusable"):
        pool.read(0, "k", 0, 4)
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_deleted_page_file(engine, tmp_path):
    pool, page_file = _filled(tmp_path, engine)
    page_file.unlink()
    with pytest.raises(PageFileError, match=f"page file {page_file} is missing"):
        pool.read(0, "k")
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_dropped_pool_removes_its_files(engine, tmp_path):
    pool, _ = _filled(tmp_path, engine)
    pool.read(0, "k")
    del pool
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_use_after_release_is_a_bug(tmp_path):
    pool, _ = _filled(tmp_path, "buffered")
    pool.release()
    with pytest.raises(AssertionError, match="after release"):
        pool.read(0, "k")


def test_host_budget(tmp_path):
    config = OffloadConfig(tier="cpu", host_memory_budget_gb=1e-6)  # ~1 KiB
    pool = make_pool(config, 4)
    pool.reserve(0, "k", 8, (4,), torch.float32)  # 128 B
    with pytest.raises(ValueError, match="offload.host_memory_budget_gb"):
        pool.reserve(1, "k", 1000, (4,), torch.float32)
    pool.release()
