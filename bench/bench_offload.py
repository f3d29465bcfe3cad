"""Benchmark: the offload tiers against plain I/O and plain memory copies, and what the NVMe tier saves.

1. NVMe tier: write (append + flush of K/V streams shaped like Qwen3.6-27B's, 2 KiB per token per stream) and
   read (every layer staged through the stager, depth 2), side by side with a plain sequential write (+ fsync)
   and read (page cache dropped with posix_fadvise) of the same bytes in the same directory.
   The tier's figures include everything it does: tail-buffer copies, CRC-32 per page, aio, checksum checks on
   read and the copy to a fresh tensor.
2. Host tier: append and staged read of the same streams, side by side with a plain memcpy into a preallocated
   tensor and into a fresh one.
3. Peak host memory (kernel VmHWM, fresh process per run, MALLOC_MMAP_THRESHOLD_ set so freed memory returns)
   of a whole GRPO group (capture, replay, backward) with a long prompt, tier nvme vs tier none.

    python bench/bench_offload.py [--nvme-path DIR] [--gib 1.0] [--prompt 8192] [--skip-peak]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GiB = 2**30
TOKEN_SHAPE = (4, 256)  # Qwen3.6-27B: 4 KV heads x head_dim 256, bf16: 2 KiB per token per stream
CHUNK = 4096  # tokens per append, as one capture chunk


def _streams(total_bytes, layers=16):
    token_bytes = TOKEN_SHAPE[0] * TOKEN_SHAPE[1] * 2
    tokens = max(CHUNK, int(total_bytes // (2 * layers * token_bytes)) // CHUNK * CHUNK)
    gen = torch.Generator().manual_seed(0)
    data = torch.randn((tokens, *TOKEN_SHAPE), generator=gen).to(torch.bfloat16)
    return [(layer, name) for layer in range(layers) for name in ("k", "v")], tokens, data


def _tier_round(pool, keys, tokens, data):
    """Append every stream chunk by chunk (as capture does), flush; then stage every layer (as replay does)."""
    from ds_longstraw.offload import Stager

    for layer, name in keys:
        pool.reserve(layer, name, tokens, TOKEN_SHAPE, torch.bfloat16)
    start = time.perf_counter()
    for a in range(0, tokens, CHUNK):
        for layer, name in keys:
            pool.append(layer, name, data[a:a + CHUNK])
    pool.flush()
    write = time.perf_counter() - start
    layers = sorted({layer for layer, _ in keys})
    stager = Stager(pool, {layer: [name for other, name in keys if other == layer] for layer in layers}, depth=2)
    start = time.perf_counter()
    checksum = 0.0
    for layer in layers:
        staged = stager.get(layer, 0, tokens)
        checksum += float(staged["k"][-1, 0, 0]) + float(staged["v"][0, -1, -1])
    stager.close()
    read = time.perf_counter() - start
    expected = sum(float(data[-1, 0, 0]) + float(data[0, -1, -1]) for _ in layers)
    assert checksum == expected, "staged pages differ from the written ones"
    return write, read


def _plain_files(directory, keys, data):
    """Plain sequential write (+ fsync) of every stream to its own file, then a cold read of each."""
    raw = data.view(torch.uint8).reshape(-1).numpy()
    block = 8 << 20
    paths = [os.path.join(directory, f"plain-{layer}-{name}.bin") for layer, name in keys]
    start = time.perf_counter()
    for path in paths:
        with open(path, "wb", buffering=0) as handle:
            for a in range(0, len(raw), block):
                handle.write(memoryview(raw[a:a + block]))
            os.fsync(handle.fileno())
    write = time.perf_counter() - start
    for path in paths:  # drop the page cache of these files so the read goes to the disk
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    out = torch.empty(len(raw), dtype=torch.uint8).numpy()
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            view = memoryview(out)
            done = 0
            while done < len(out):
                n = handle.readinto(view[done:done + block])
                if not n:
                    break
                done += n
    read = time.perf_counter() - start
    for path in paths:
        os.unlink(path)
    return write, read


def bench_nvme(path, total_bytes):
    from ds_longstraw.config import AioConfig
    from ds_longstraw.offload import NvmePagePool

    keys, tokens, data = _streams(total_bytes)
    nbytes = len(keys) * data.numel() * data.element_size()
    rows = []
    plain_w, plain_r = _plain_files(path, keys, data)
    rows.append(("plain sequential file I/O (write+fsync / cold read)", nbytes, plain_w, plain_r))
    pool = NvmePagePool(1024, nvme_path=path, aio_config=AioConfig(), staging_depth=2)
    engine = pool.engine_kind
    tier_w, tier_r = _tier_round(pool, keys, tokens, data)
    pool.release()
    rows.append((f"NVMe tier ({engine}, 1024-token pages, CRC-32 per page)", nbytes, tier_w, tier_r))
    return rows, (tier_w, tier_r, plain_w, plain_r)


def bench_host(total_bytes):
    from ds_longstraw.offload import HostPagePool

    keys, tokens, data = _streams(total_bytes)
    nbytes = len(keys) * data.numel() * data.element_size()
    pool = HostPagePool(1024)
    tier_w, tier_r = _tier_round(pool, keys, tokens, data)
    pinned = pool.pinned
    pool.release()
    dest = [torch.zeros_like(data) for _ in keys]  # touched: the copy below measures memcpy, not page faults
    start = time.perf_counter()
    for d in dest:
        d.copy_(data)
    reused = time.perf_counter() - start
    del dest
    start = time.perf_counter()
    for _ in keys:
        fresh = torch.empty_like(data)
        fresh.copy_(data)
        del fresh
    fresh_time = time.perf_counter() - start
    return [(f"host tier ({'pinned' if pinned else 'pageable'}; append / staged read)", nbytes, tier_w, tier_r),
            ("plain memcpy (into preallocated / into fresh tensors)", nbytes, reused, fresh_time)]


def _peak_child(args):
    """One GRPO group in this (fresh) process; prints JSON with VmHWM and the retained bytes."""
    from ds_longstraw import GRPOGroup, grpo_backward
    from ds_longstraw.grpo.memory import host_peak_bytes, require_host_peaks, reset_host_peak
    from ds_longstraw.models.shapes import build_named

    require_host_peaks("bench_offload's peak run")  # reset_host_peak below raises where clear_refs is not writable

    # The "small" shape with 6 of 8 layers full attention and wide heads: K/V pages dominate what is retained.
    types = ["linear_attention" if i in (0, 4) else "full_attention" for i in range(8)]
    model = build_named("small", seed=0, vocab_size=512, layer_types=types, num_attention_heads=2, head_dim=256,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.25, "mrope_section": [8, 12, 12]})
    gen = torch.Generator().manual_seed(1)
    group = GRPOGroup(torch.randint(0, 512, (args.prompt,), generator=gen),
                      [torch.randint(0, 512, (32,), generator=gen) for _ in range(2)], rewards=[0.0, 1.0])
    offload = {"tier": args.tier, "staging_depth": 1}
    if args.tier == "nvme":
        offload["nvme_path"] = args.nvme_path
    config = {"prefix_grad": "detached", "capture_chunk": 1024, "replay_block": 32, "page_tokens": 1024,
              "offload": offload}
    reset_host_peak()
    start = time.perf_counter()
    result = grpo_backward(model, group, longstraw=config)
    seconds = time.perf_counter() - start
    print(json.dumps({"tier": args.tier, "peak": host_peak_bytes(), "seconds": seconds,
                      "state": result.retained_bytes["attention_kv_pages"],
                      "phases": {k: v.peak_bytes for k, v in result.phases.items()}}))


def bench_peak(path, prompt):
    out = {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    for tier in ("none", "nvme"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tier", tier, "--prompt", str(prompt),
               "--nvme-path", path]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out[tier] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _gbs(nbytes, seconds):
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", default=None, help="directory on the disk under test (default: the temp dir)")
    parser.add_argument("--gib", type=float, default=1.0, help="bytes of K/V streams per measurement, GiB")
    parser.add_argument("--prompt", type=int, default=8192, help="prompt tokens of the peak-memory group")
    parser.add_argument("--skip-peak", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tier", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _peak_child(args)
    with tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="bench-offload-") as path:
        total = int(args.gib * GiB)
        rows, (tier_w, tier_r, plain_w, plain_r) = bench_nvme(path, total)
        rows += bench_host(total)
        print(f"`python bench/bench_offload.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
              .replace(" `", "`"))
        print()
        print("| what | bytes | write / first | read / second |")
        print("|---|---:|---:|---:|")
        for what, nbytes, write, read in rows:
            print(f"| {what} | {nbytes / GiB:.2f} GiB | {_gbs(nbytes, write)} | {_gbs(nbytes, read)} |")
        print()
        print(f"NVMe tier vs plain file I/O on the same disk: write {plain_w / tier_w:.0%}, "
              f"read {plain_r / tier_r:.0%} of the plain bandwidth.")
        if not args.skip_peak:
            peak = bench_peak(path, args.prompt)
            print()
            print(f"Peak host memory of one GRPO group (detached, prompt {args.prompt:,} tokens, G=2, "
                  f"32-token responses, 6 attention layers of 2x256 K/V heads, float32), fresh process per tier:")
            print()
            print("| tier | retained K/V pages | peak host memory (VmHWM) | seconds |")
            print("|---|---:|---:|---:|")
            for tier, r in peak.items():
                print(f"| {tier} | {r['state'] / 2**20:.0f} MiB | {r['peak'] / 2**20:.0f} MiB | {r['seconds']:.1f} |")
            saved = peak["none"]["peak"] - peak["nvme"]["peak"]
            print()
            print(f"tier nvme keeps {saved / 2**20:.0f} MiB less at peak "
                  f"({saved / peak['none']['state']:.0%} of the retained pages).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
