"""Benchmark: the DSA selection over a prompt's pages, each page its own key block against pages joined into blocks.

`dsa_select` merges a query block's running top-k with one block of keys at a time (a top-k over topk + the block's
keys, then a sort of topk). Its keys come as pieces (a kept capture graph's segments, a tree node's ancestors then
its own pages, a long member's earlier replay blocks), which used to be cut each on its own: a merge per piece
however short. `selection.key_blocks` joins consecutive pieces into blocks of KEY_BLOCK rows, so pieces cost the
merges of one tensor. Here the pieces are --page tokens each. This times both over the same keys side by side in
one process, on one CPU thread, the forms in turn each round, and the keys as one tensor beside them; every
selection is checked equal. CPU seconds, the median of --repeat rounds; rows land in bench/results/key-blocks.json.

    python bench/bench_key_blocks.py [--prompts 8192 32768] [--queries 256 4096] [--page 1024] [--repeat 5]
        [--heads 4 --dim 32 --topk 512] [--out bench/results/key-blocks.json]
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


def per_piece_blocks(keys, key_block, offset=0):
    """The former blocking: each piece cut on its own, so a page shorter than key_block is a block of its own."""
    for piece in keys:
        for lo in range(0, piece.shape[0], key_block):
            yield offset + lo, piece[lo:lo + key_block]
        offset += piece.shape[0]


def measure(prompt, queries, page, heads, dim, topk, repeat):
    from ds_longstraw.kernels.dsa import selection

    gen = torch.Generator().manual_seed(prompt + queries)
    keys = torch.randn(prompt + queries, dim, generator=gen)
    q, weights = torch.randn(queries, heads, dim, generator=gen), torch.rand(queries, heads, generator=gen)
    pages = [*keys[:prompt].split(page), keys[prompt:]]  # the prompt's pages, then the segment's own keys
    forms = {"pages, per piece": (pages, per_piece_blocks), "pages, joined": (pages, selection.key_blocks),
             "one tensor": ([keys], selection.key_blocks)}
    joined = selection.key_blocks
    times = {name: [] for name in forms}
    picked = {}
    try:
        for _ in range(repeat):
            for name, (pieces, blocking) in forms.items():
                selection.key_blocks = blocking
                started = time.process_time()
                picked[name] = selection.dsa_select(q, weights, pieces, prompt, topk, 0.1)
                times[name].append(time.process_time() - started)
    finally:
        selection.key_blocks = joined
    first = picked["one tensor"]
    for name, out in picked.items():  # the same selection whatever the blocking
        assert torch.equal(out[0], first[0]) and torch.equal(out[1], first[1]), name
    row = {"prompt": prompt, "queries": queries, "page": page, "heads": heads, "dim": dim, "topk": topk,
           "repeat": repeat, "threads": torch.get_num_threads(),
           "seconds": {name: statistics.median(values) for name, values in times.items()}, "all": times}
    row["joined_over_per_piece"] = row["seconds"]["pages, joined"] / row["seconds"]["pages, per piece"]
    print(f"prompt {prompt}, {queries} queries: " + ", ".join(f"{n} {s:.3f} s" for n, s in row["seconds"].items())
          + f"; joined / per piece {row['joined_over_per_piece']:.2f}x", flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--queries", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--page", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4, help="indexer heads (the small GLM shape's 4)")
    parser.add_argument("--dim", type=int, default=32, help="indexer head dim (the small GLM shape's 32)")
    parser.add_argument("--topk", type=int, default=512, help="index_topk (the small GLM shape's 512)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "key-blocks.json"))
    args = parser.parse_args(argv)
    rows = [measure(p, t, args.page, args.heads, args.dim, args.topk, args.repeat)
            for p in args.prompts for t in args.queries]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
