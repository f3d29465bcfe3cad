"""Benchmark: a replayed block's sparse attention backward and its prompt-page gradients, dense against by rows.

One layer of GLM's sparse absorbed MLA for one replay block (T queries, K selected rows each, anywhere in a prompt of
N rows and the block's own rows), its backward and the prompt pages' gradient added to host gradient pages
(HostPagePool: GLM's pages live in host memory), two ways side by side in one process, on one CPU thread:
- dense (the form before the row sink): every row laid out in a table [N + T, R + E], a dense gradient table of the
  same size, split per piece, and the prompt piece's whole gradient added to its gradient pages (pool.add_grad);
- rows (the default now): only the U rows some query selected (kernels/sparse_mla/selected_rows.py; every row where
  more than three quarters are), the prompt piece's share handed to its row sink, which adds just those rows
  (pool.add_grad_rows).
Both give the same gradient pages (checked, 1e-5 relative in float32: the same sums in different orders).
CPU seconds per backward, the median of --repeat rounds that run both in turn; rows land in
bench/results/sparse-row-grads.json.

    python bench/bench_sparse_row_grads.py [--prompts 8192 32768 131072 524288 2097152] [--queries 256]
        [--topk 512] [--heads 4] [--rank 64] [--rope 16] [--repeat 7] [--out bench/results/sparse-row-grads.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _cpu_seconds(calls, repeat):
    """{name: median CPU seconds} of each call, the calls interleaved round by round (this machine's timings drift
    by 10-20% over a minute: side by side, not one after the other)."""
    for call in calls.values():
        call()  # warm-up: first-call allocations
    times = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.process_time()
            call()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _inputs(prompt, queries, topk, heads, rank, rope, gen):
    """A replay block after `prompt` rows: its own rows, queries, a causal selection of topk rows each (distinct
    per query, anywhere before it), d_out."""
    latents = [torch.randn(prompt, rank, generator=gen), torch.randn(queries, rank, generator=gen)]
    ropes = [torch.randn(prompt, rope, generator=gen), torch.randn(queries, rope, generator=gen)]
    positions = torch.stack([torch.randperm(prompt + t + 1, generator=gen)[:topk] for t in range(queries)])
    valid = torch.ones_like(positions, dtype=torch.bool)
    q_lat = torch.randn(queries, heads, rank, generator=gen)
    q_rope = torch.randn(queries, heads, rope, generator=gen)
    d_out = torch.randn(queries, heads, rank, generator=gen)
    return q_lat, q_rope, latents, ropes, positions, valid, d_out


def _pool(prompt, rank, rope):
    from ds_longstraw.offload import HostPagePool

    pool = HostPagePool(1024)
    for name, width in (("latent", rank), ("rope_key", rope)):
        pool.reserve(0, name, prompt, (width,), torch.float32)
        pool.append(0, name, torch.zeros(prompt, width))
    return pool


def _measure(prompt, args):
    """One prompt length: both backwards side by side, their gradient pages checked equal; the result row."""
    from ds_longstraw.kernels.sparse_mla import attention as sparse_mla

    gen = torch.Generator().manual_seed(prompt)
    q_lat, q_rope, latents, ropes, positions, valid, d_out = _inputs(prompt, args.queries, args.topk, args.heads,
                                                                     args.rank, args.rope, gen)
    scale = (args.rank + args.rope) ** -0.5
    with torch.no_grad():
        out, lse = sparse_mla._SparseLatentAttention.apply(q_lat, q_rope, positions, valid, scale, 2, None,
                                                           *latents, *ropes)
    block = sparse_mla._query_block(args.topk * (args.rank + args.rope), args.queries)
    pools = {"dense": _pool(prompt, args.rank, args.rope), "rows": _pool(prompt, args.rank, args.rope)}
    lengths = [piece.shape[0] for piece in latents]

    def dense():
        table = sparse_mla._row_table(latents, ropes, torch.float32)
        _, _, d_table = sparse_mla._backward_blocks(q_lat, q_rope, table, positions, valid, out, lse, d_out, None,
                                                    scale, block, True)
        for name, cols in (("latent", d_table[:, :args.rank]), ("rope_key", d_table[:, args.rank:])):
            prompt_grad, _own_grad = (part.contiguous() for part in torch.split(cols, lengths))
            pools["dense"].add_grad(0, name, 0, prompt_grad)

    def sink(rows, d_latent, d_rope):
        pools["rows"].add_grad_rows(0, "latent", 0, rows, d_latent)
        pools["rows"].add_grad_rows(0, "rope_key", 0, rows, d_rope)

    leaves = [t.detach().requires_grad_() for t in (*latents, *ropes)]
    o_lat = sparse_mla._SparseLatentAttention.apply(q_lat, q_rope, positions, valid, scale, 2, [sink, None],
                                                    *leaves)[0]

    def rows():  # the backward alone, as dense() (the graph is kept between calls); the block's own rows dense
        torch.autograd.grad(o_lat, leaves[1::2], d_out, retain_graph=True)

    def forward():
        sparse_mla._SparseLatentAttention.apply(q_lat, q_rope, positions, valid, scale, 2, None, *latents, *ropes)

    seconds = _cpu_seconds({"dense": dense, "rows": rows}, args.repeat)
    seconds["forward"] = _cpu_seconds({"forward": forward}, args.repeat)["forward"]
    for name in ("latent", "rope_key"):
        mine, ref = pools["rows"].read_grad(0, name), pools["dense"].read_grad(0, name)
        error = float((mine - ref).norm() / ref.norm())
        assert error < 1e-5, (name, error)
    for pool in pools.values():
        pool.release()
    selected = int(torch.unique(positions).numel())
    return {"prompt": prompt, "queries": args.queries, "topk": args.topk, "heads": args.heads, "rank": args.rank,
            "rope": args.rope, "selected_rows": selected, "forward_seconds": seconds["forward"],
            "dense_seconds": seconds["dense"], "rows_seconds": seconds["rows"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768, 131072, 524288, 2097152])
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rope", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "sparse-row-grads.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for prompt in args.prompts:
        row = _measure(prompt, args)
        results.append(row)
        selected, dense, rows = row["selected_rows"], row["dense_seconds"], row["rows_seconds"]
        print(f"N {prompt:>8}  U {selected:>7} ({selected / (prompt + args.queries):.2f} N)  forward "
              f"{row['forward_seconds']:.3f} s  backward: dense {dense:.3f} s, rows {rows:.3f} s "
              f"({rows / dense:.2f}x)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
