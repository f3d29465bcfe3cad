"""Round trips through every tier, bit for bit: device, host, NVMe through DeepSpeed's aio op (one and two I/O
threads), and NVMe through the buffered fallback. Real files under tmp_path, real aio.

Equivalence chain: for random page sizes (non-aligned ones included), random append chunks and random reads
(before and after flush, inside partly filled pages), read(tier) == the appended tokens exactly; gradient pages
accumulated through add_grad == the same additions on a plain tensor, exactly. Buffers the tiers should
overwrite are poisoned first, and no file is left behind.
"""

import gc
import random

import pytest
import torch

from ds_longstraw.config import AioConfig
from ds_longstraw.kernels.attention import partial_attention
from ds_longstraw.offload import HostPagePool, NvmePagePool, PagePool, PageState, StagedPast, Stager, staged_saves
from ds_longstraw.offload import buffers as buffers_module
from ds_longstraw.offload import host_pool as host_pool_module
from ds_longstraw.offload.alignment import memory_lock_unlimited
from ds_longstraw.offload.io_engine import load_aio

TIERS = ["device", "cpu", "nvme-aio", "nvme-aio-2threads", "nvme-buffered"]


def _need_aio():
    try:
        load_aio()
    except RuntimeError as error:
        pytest.skip(f"libaio or DeepSpeed's aio op is unavailable here: {error}")
    if not memory_lock_unlimited():
        pytest.skip("RLIMIT_MEMLOCK is finite and CAP_IPC_LOCK missing: the NVMe pool uses buffered I/O there by "
                    "design (the aio op aborts the process when its mlock fails)")


def make_pool(tier, path, page_tokens, depth=1):
    if tier == "device":
        return PagePool(page_tokens, staging_depth=depth)
    if tier == "cpu":
        return HostPagePool(page_tokens, staging_depth=depth)
    if tier.startswith("nvme-aio"):
        _need_aio()
        threads = 2 if tier.endswith("2threads") else 1
        aio = AioConfig(block_size=4096, queue_depth=4, intra_op_parallelism=threads)
        pool = NvmePagePool(page_tokens, staging_depth=depth, nvme_path=str(path), aio_config=aio, direct_io=True)
        assert pool.engine_kind == "aio", pool.io_reason  # no silent buffered fallback in an aio test
        return pool
    pool = NvmePagePool(page_tokens, staging_depth=depth, nvme_path=str(path), aio_config=AioConfig(), direct_io=False)
    assert pool.engine_kind == "buffered"
    return pool


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Hand out I/O buffers and host arenas full of garbage: nothing may depend on their initial contents."""
    take = buffers_module.BufferCache.take

    def poisoned_take(self, nbytes):
        base = take(self, nbytes)
        base.fill_(0xA5)
        return base

    monkeypatch.setattr(buffers_module.BufferCache, "take", poisoned_take)
    host_empty = host_pool_module.host_empty

    def poisoned_host_empty(shape, dtype):
        tensor, pinned = host_empty(shape, dtype)
        tensor.view(torch.uint8).fill_(0xA5) if tensor.numel() else None
        return tensor, pinned

    monkeypatch.setattr(host_pool_module, "host_empty", poisoned_host_empty)


def _bits(t):
    """Bit patterns, so that equality is bitwise (NaN payloads and -0.0 included)."""
    return t.contiguous().view(torch.uint8)


CASES = {  # name: (page_tokens, tokens, token shape, dtype)
    "page-1": (1, 9, (2, 3), torch.float64),
    "page-5-bf16-odd": (5, 63, (3, 5), torch.bfloat16),
    "page-7-f32": (7, 111, (2, 4), torch.float32),
    "page-64-aligned": (64, 130, (2, 8), torch.float64),
    "empty-stream": (4, 0, (2, 2), torch.float64),
    "one-token": (3, 1, (1, 3), torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tier", TIERS)
def test_state_round_trip(tier, case, tmp_path):
    page, tokens, shape, dtype = CASES[case]
    rng = random.Random(f"{tier}-{case}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    data = {(layer, name): torch.randn((tokens, *shape), generator=gen).to(dtype)
            for layer in (3, 7) for name in ("k", "v")}
    pool = make_pool(tier, tmp_path, page)
    for layer, name in data:
        pool.reserve(layer, name, tokens, shape, dtype)
    done = 0
    while done < tokens:  # random chunks, several streams interleaved, reads of partly filled pages between
        step = min(tokens - done, rng.randint(1, 2 * page + 1))
        for (layer, name), values in data.items():
            pool.append(layer, name, values[done:done + step])
        done += step
        a = rng.randint(0, done)
        b = rng.randint(a, done)
        assert torch.equal(_bits(pool.read(3, "v", a, b)), _bits(data[(3, "v")][a:b]))
    pool.flush()
    for (layer, name), values in data.items():
        assert torch.equal(_bits(pool.read(layer, name)), _bits(values))
        assert pool.length(layer, name) == tokens
        for _ in range(3):
            a = rng.randint(0, tokens)
            b = rng.randint(a, tokens)
            ticket = pool.begin_read(layer, name, a, b)
            assert torch.equal(_bits(ticket.result()), _bits(values[a:b]))
    if tier != "device":
        assert all(e.state is PageState.RESIDENT for e in pool.table.all_entries())
        assert pool.state_bytes() == 4 * tokens * data[(3, "k")][:1].numel() * data[(3, "k")].element_size()
    pool.release()
    pool.release()  # twice is fine
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", TIERS)
def test_gradient_pages_accumulate_exactly(tier, tmp_path):
    rng = random.Random(tier)
    page, tokens, shape = 6, 40, (2, 3)
    pool = make_pool(tier, tmp_path, page)
    pool.reserve(1, "k", tokens, shape, torch.float64)
    pool.append(1, "k", torch.zeros(tokens, *shape, dtype=torch.float64))
    assert torch.equal(pool.read_grad(1, "k", 5, 9), torch.zeros(4, *shape, dtype=torch.float64))
    reference = torch.zeros(tokens, *shape, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        a = rng.randint(0, tokens - 1)
        b = rng.randint(a + 1, tokens)
        grad = torch.randn(b - a, *shape, generator=gen, dtype=torch.float64)
        pool.add_grad(1, "k", a, grad)
        reference[a:b].add_(grad)
        c = rng.randint(0, tokens)
        d = rng.randint(c, tokens)
        assert torch.equal(_bits(pool.read_grad(1, "k", c, d)), _bits(reference[c:d]))
    assert torch.equal(_bits(pool.read_grad(1, "k")), _bits(reference))
    assert pool.grad_bytes() == reference.numel() * 8
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", TIERS)
def test_gradient_rows_touch_only_their_pages(tier, tmp_path):
    """add_grad_rows (a sparse attention's selected rows, offload/staged_past.py's row sink), mixed with dense
    add_grad: the gradient pages equal the same additions on a plain tensor, exactly; on the host and NVMe tiers a
    page that no row lies in is never opened (it stays FREE: neither read nor written); bad rows are refused by
    name before anything is added."""
    page, tokens, shape = 6, 40, (2, 3)
    pool = make_pool(tier, tmp_path, page)
    pool.reserve(1, "k", tokens, shape, torch.float64)
    pool.append(1, "k", torch.zeros(tokens, *shape, dtype=torch.float64))
    reference = torch.zeros(tokens, *shape, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    # rows in pages 0, 1 (adjacent: one run), 3 and 6 (the last, partial page); pages 2, 4 and 5 untouched
    for start, rows in [(0, [1, 5, 7]), (18, [0, 3, 5]), (36, [0, 3]), (7, [0, 11])]:
        rows = torch.tensor(rows)
        grad = torch.randn(rows.numel(), *shape, generator=gen, dtype=torch.float64)
        pool.add_grad_rows(1, "k", start, rows, grad)
        reference[start + rows] += grad
        assert torch.equal(_bits(pool.read_grad(1, "k")), _bits(reference))
    if tier != "device":
        states = [entry.state for entry in pool.table.lookup(1, "k", 0, tokens, "grad")]
        assert [state is PageState.FREE for state in states] == [False, False, True, False, True, True, False]
    grad = torch.randn(5, *shape, generator=gen, dtype=torch.float64)
    pool.add_grad(1, "k", 20, grad)  # dense, over the touched page 3 and the untouched page 4
    reference[20:25] += grad
    for start, rows, count, message in [(30, [4, 10], 2, r"\[34, 40\] outside stream \(1, 'k'\)"),
                                        (0, [3, 3], 2, "ascend without repeats"),
                                        (0, [5, 2], 2, "ascend without repeats"),
                                        (0, [1, 2], 3, "2 rows for a gradient of shape")]:
        with pytest.raises(ValueError, match=message):
            pool.add_grad_rows(1, "k", start, torch.tensor(rows), torch.ones(count, *shape, dtype=torch.float64))
    pool.add_grad_rows(1, "k", 0, torch.zeros(0, dtype=torch.long), torch.zeros(0, *shape, dtype=torch.float64))
    assert torch.equal(_bits(pool.read_grad(1, "k")), _bits(reference))
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme-aio", "nvme-buffered"])
def test_append_after_flush_reopens_the_partial_page(tier, tmp_path):
    pool = make_pool(tier, tmp_path, 4)
    pool.reserve(0, "k", 11, (3,), torch.float32)
    values = torch.arange(33, dtype=torch.float32).reshape(11, 3)
    pool.append(0, "k", values[:6])
    pool.flush()  # page 1 holds 2 of its 4 tokens and goes to its tier
    pool.append(0, "k", values[6:9])
    assert torch.equal(pool.read(0, "k"), values[:9])
    pool.append(0, "k", values[9:])
    pool.flush()
    assert torch.equal(pool.read(0, "k"), values)
    with pytest.raises(ValueError, match="overflows"):
        pool.append(0, "k", values[:1])
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme-aio", "nvme-buffered"])
def test_a_read_returns_the_pages_as_they_were_at_its_issue(tier, tmp_path):
    """A read issued while a page fills (a stager's read-ahead that the walk never takes) and collected after the
    page was sealed and written, or after a flushed page was re-opened and grown: it returns the tokens as they
    were when it was issued, and the tier's checksums (of what it read from the file, as it was) hold."""
    pool = make_pool(tier, tmp_path, 4)
    pool.reserve(0, "k", 12, (3,), torch.float32)
    values = torch.arange(36, dtype=torch.float32).reshape(12, 3)
    pool.append(0, "k", values[:6])  # page 0 sealed, page 1 filling with 2 of its 4 tokens
    filling = pool.begin_read(0, "k", 0, 6)
    pool.append(0, "k", values[6:9])  # page 1 sealed and written, page 2 filling
    pool.flush()  # page 2 (1 token) goes to its tier
    flushed = pool.begin_read(0, "k", 0, 9)
    pool.append(0, "k", values[9:])  # page 2 re-opened, grown and sealed
    pool.flush()
    assert torch.equal(filling.result(), values[:6])
    assert torch.equal(flushed.result(), values[:9])
    filling.release()
    flushed.release()
    assert torch.equal(pool.read(0, "k"), values)
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", ["nvme-aio", "nvme-buffered"])
def test_page_files_are_aligned_and_hold_the_pages(tier, tmp_path):
    """The state really lives in files: one per stream, every page slot padded to the I/O alignment."""
    pool = make_pool(tier, tmp_path, 5)
    pool.reserve(2, "v", 12, (3,), torch.float64)  # 120 B pages: padded to one alignment unit each
    pool.append(2, "v", torch.randn(12, 3, dtype=torch.float64))
    pool.flush()
    (directory,) = tmp_path.iterdir()
    (page_file,) = directory.iterdir()
    assert page_file.name == "L002-v-state.pages"
    assert page_file.stat().st_size == 3 * pool.alignment and pool.alignment % 1024 == 0
    assert pool.host_bytes() <= 4 * pool.alignment  # a few cached buffers, not the state
    pool.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("depth", [1, 2])
def test_staged_attention_keeps_no_page_copies_in_the_graph(tier, depth, tmp_path):
    """Attention of queries over 4 layers' staged pages, with autograd (exact mode's gradient pages):
    d(query) and the gradient pages equal the device tier's bit for bit, and between forward and backward only
    the stager's window (depth + 1 layers) of staged copies is alive; the graph holds handles."""
    layers, tokens, page = [0, 2, 5, 6], 23, 4
    gen = torch.Generator().manual_seed(3)
    kv = {(layer, n): torch.randn(tokens, 2, 8, generator=gen, dtype=torch.float64) for layer in layers for n in "kv"}
    q0 = torch.randn(4, 3, 8, generator=gen, dtype=torch.float64)

    def run(pool_tier, path):
        pool = make_pool(pool_tier, path, page, depth)
        for (layer, name), values in kv.items():
            pool.reserve(layer, name, tokens, (2, 8), torch.float64)
            pool.append(layer, name, values)
        pool.flush()
        stager = Stager(pool, layers, names=("k", "v"))
        past = StagedPast(stager, 0, tokens, grads_to_pages=True)
        q = q0.clone().requires_grad_(True)
        loss = 0
        with staged_saves(stager):
            for layer in layers:
                (k, v), = past[layer]
                out, lse = partial_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0.3)
                loss = loss + (out * out).sum() + lse.sum()
        alive = sum(ref() is not None for ref, _, _ in stager._owned.values())
        loss.backward()
        grads = {key: pool.read_grad(*key) for key in kv}
        stager.close()
        pool.release()
        return q.grad, grads, alive

    ref_q, ref_grads, _ = run("device", None)
    q_grad, grads, alive = run(tier, tmp_path)
    assert torch.equal(_bits(q_grad), _bits(ref_q))
    for key in kv:
        assert torch.equal(_bits(grads[key]), _bits(ref_grads[key])), key
    if tier != "device":
        assert alive <= 2 * (depth + 1)  # k and v of the window's layers, never all four layers
    assert list(tmp_path.iterdir()) == []


def test_lent_pages_outlive_the_pool_and_are_recycled(tmp_path):
    """On a CPU compute device, unpadded pages are handed over without a copy: the block returns to the cache
    when the caller drops the tensor (reads in a loop hold no more memory than one), and a tensor still held
    when the pool is released stays valid."""
    pool = make_pool("nvme-aio", tmp_path, 64)  # 64 tokens x 128 B: 8 KiB pages, no padding
    values = torch.randn(256, 2, 8, dtype=torch.float64)
    pool.reserve(0, "k", 256, (2, 8), torch.float64)
    pool.append(0, "k", values)
    pool.flush()
    first = pool.read(0, "k")
    assert torch.equal(pool.read(0, "k", 3, 200), values[3:200])
    # A dropped read's block returns through its storage's finalizer. A loaded clean-clone run once counted one
    # 32 KiB block more after the loop (not seen in five runs here): a block reachable only from a reference
    # cycle returns at the next garbage collection, whose moment depends on allocations elsewhere. Collect
    # before each count, so that what is compared is the blocks still viewed, not when the collector last ran.
    gc.collect()
    held = pool.host_bytes()  # `first`'s block, one recycled landing block, cached write buffers
    for _ in range(5):
        assert torch.equal(pool.read(0, "k", 3, 200), values[3:200])
    gc.collect()
    assert pool.host_bytes() == held
    kept = pool.read(0, "k", 10, 20)
    pool.release()
    assert torch.equal(first, values) and torch.equal(kept, values[10:20])
    del first, kept
    assert list(tmp_path.iterdir()) == []
