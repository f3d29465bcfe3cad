"""Benchmark: what the prompt's attention costs backward against forward, on one CPU thread.

One query segment of the exact-mode prefix pass (256 queries, the small model's 4 query / 2 KV heads of 32 dims)
over a long run of earlier keys: the fused CPU flash forward, its fused backward, and the blockwise torch
backward (kernels/attention/partial.py's fallback, at a few key blocks). CPU seconds per call, the best of --repeat.

    python bench/bench_attention_backward.py [--queries 256] [--keys 32768] [--repeat 3]
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _cpu_seconds(call, repeat):
    call()  # warm-up: first-call allocations
    best = None
    for _ in range(repeat):
        start = time.process_time()
        call()
        seconds = time.process_time() - start
        best = seconds if best is None else min(best, seconds)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from ds_longstraw.kernels.attention import partial as attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.heads, args.queries, args.dim, generator=gen)
    k = torch.randn(args.kv_heads, args.keys, args.dim, generator=gen)
    v = torch.randn(args.kv_heads, args.keys, args.dim, generator=gen)
    dout = torch.randn(args.heads, args.queries, args.dim, generator=gen)
    scale = args.dim ** -0.5
    out, lse = attention._forward(q, k, v, scale, None, attention.KEY_BLOCK)
    rows = [("fused forward", _cpu_seconds(lambda: attention._forward(q, k, v, scale, None, attention.KEY_BLOCK),
                                           args.repeat)),
            ("fused backward", _cpu_seconds(lambda: attention._fused_cpu_backward(q, k, v, out, lse, dout, scale, None),
                                            args.repeat))]
    for block in (512, 2048):
        rows.append((f"blockwise backward, key block {block}", _cpu_seconds(
            lambda block=block: attention._blockwise_backward(q, k, v, out, lse, dout, None, scale, None, block, True),
            args.repeat)))
    forward = rows[0][1]
    print(f"`python bench/bench_attention_backward.py {' '.join(argv or sys.argv[1:])}`".replace(" `", "`")
          + f" ({args.queries} queries over {args.keys} keys, {args.heads} query / {args.kv_heads} KV heads of "
          f"{args.dim}, float32, one thread; best of {args.repeat})\n")
    print("| kernel | CPU s | / fused forward |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / forward:.2f}x |")


if __name__ == "__main__":
    main()
