"""Benchmark: a prompt's capture with its last layer whole against its rows alone (forward_segment's need_hidden).

No token reads a captured segment's hidden states, so a one-rank capture (and exact mode's prefix pass, and a kept
capture graph) runs the last layer for its rows and carry only (grpo/state.PrefixState.last_layer_whole). This times
the capture's forwards both ways side by side in one process, on one CPU thread: the prompt in capture chunks, each
chunk over the earlier chunks' rows, without autograd (the capture) and with it (a kept capture graph, forward only),
the two forms in turn each round; the rows are checked equal. CPU seconds, the median of --repeat rounds; rows land
in bench/results/last-layer-rows.json.

    python bench/bench_last_layer_rows.py [--shapes small small-glm] [--prompt 8192] [--chunk 4096] [--repeat 5]
        [--out bench/results/last-layer-rows.json]
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


def _capture(adapter, ids, chunk, need_hidden, grad):
    """The capture's forwards: every chunk over the earlier chunks' rows; returns the rows of every layer."""
    past, carry = {}, {}
    with torch.enable_grad() if grad else torch.no_grad():
        for start in range(0, ids.numel(), chunk):
            out = adapter.forward_segment(ids[start:start + chunk], start, carry, past, need_hidden=need_hidden)
            carry = {layer: tuple(t.detach() for t in parts) for layer, parts in out.carry.items()}
            for layer, rows in out.rows.items():
                past.setdefault(layer, []).append(tuple(t.detach() for t in rows))
            del out
    return past


def measure(shape, prompt, chunk, repeat):
    from ds_longstraw.arch import adapter_for
    from ds_longstraw.models.shapes import build_named

    model = build_named(shape, dtype=torch.float32, seed=0)
    adapter = adapter_for(model)
    ids = torch.randint(0, model.config.vocab_size, (prompt - 1,), generator=torch.Generator().manual_seed(0))
    row = {"shape": shape, "prompt": prompt, "chunk": chunk, "layers": len(adapter.specs), "repeat": repeat,
           "threads": torch.get_num_threads()}
    for grad in (False, True):
        whole, alone = _capture(adapter, ids, chunk, True, grad), _capture(adapter, ids, chunk, False, grad)
        for layer, pieces in whole.items():  # the same rows either way (the warm-up runs)
            for a, b in zip(pieces, alone[layer], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (shape, layer)
        del whole, alone
        times = {"whole": [], "rows": []}
        for _ in range(repeat):
            for name, need_hidden in (("whole", True), ("rows", False)):
                started = time.process_time()
                _capture(adapter, ids, chunk, need_hidden, grad)
                times[name].append(time.process_time() - started)
        mode = "graph" if grad else "no_grad"
        row[mode] = {name: statistics.median(values) for name, values in times.items()}
        row[mode]["ratio"] = row[mode]["rows"] / row[mode]["whole"]
        row[mode]["all"] = times
        print(f"{shape} {mode}: whole {row[mode]['whole']:.2f} s, rows alone {row[mode]['rows']:.2f} s, "
              f"{row[mode]['ratio']:.3f}x", flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["small", "small-glm"])
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "last-layer-rows.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = [measure(shape, args.prompt, args.chunk, args.repeat) for shape in args.shapes]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
