"""Benchmark: the matrix products of one GRPO step, counted op by op for each method (not timed).

CPU seconds on this machine vary by 10-30% between rounds of the same step, which hides a difference of a few
percent between two schedules. The work itself does not vary: torch's FlopCounterMode counts every matrix product
(mm, bmm, convolutions, their backward) the step runs, so two schedules through the same layer kernels can be held
side by side exactly. What it leaves out: the DSA selection's top-k and sort, gathers and scatters, elementwise ops
and memory traffic (the selection is gradient-free and the same in every exact schedule: once per prompt token and
selecting layer, its selections kept for the prefix pass).

Methods as `ds_longstraw.tools.bench one` names them: conventional (tools/baselines: one prompt forward with
autograd shared by the members, one backward), longstraw-exact-graph (prefix_keep_graph "fits"), longstraw-exact
(the default), longstraw-detached. Rows land in --out (JSON), with each method's total over conventional's.

    python bench/bench_step_products.py [--shape small-glm] [--prompt 8192] [--group 8] [--response 256]
        [--out bench/results/step-products.json]
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

METHODS = ("conventional", "longstraw-exact-graph", "longstraw-exact", "longstraw-detached")


def step_of(method, model, group, config):
    from ds_longstraw.grpo.transaction import grpo_backward
    from ds_longstraw.objective import GRPOObjective
    from ds_longstraw.tools.baselines import conventional

    if method == "conventional":
        return lambda: conventional(model, group, GRPOObjective(), longstraw=config)
    settings = {**config, "prefix_grad": method.split("-")[1]}
    if method == "longstraw-exact-graph":
        settings["prefix_keep_graph"] = "fits"
    return lambda: grpo_backward(model, group, GRPOObjective(), longstraw=settings)


def count(step, model):
    from torch.utils.flop_counter import FlopCounterMode

    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        result = step()
    model.zero_grad(set_to_none=True)
    return {str(op): int(flops) for op, flops in counter.get_flop_counts()["Global"].items()}, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small-glm")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "step-products.json"))
    args = parser.parse_args()

    from ds_longstraw.models.shapes import build_named, synthetic_group

    model = build_named(args.shape, dtype=torch.float32, seed=0)
    group = synthetic_group(args.prompt, args.group, args.response, model.config.vocab_size, seed=0)
    # as ds_longstraw.tools.bench one runs them
    config = {"capture_chunk": 4096, "replay_block": 1024}
    rows = []
    for method in args.methods.split(","):
        print(f"{method}: counting ...", file=sys.stderr, flush=True)
        products, result = count(step_of(method, model, group, config), model)
        rows.append({"method": method, "shape": args.shape, "prompt": args.prompt, "group": args.group,
                     "response": args.response, "products": products, "total": sum(products.values()),
                     "kept_graph_tokens": result.extras.get("kept_graph_tokens")})
    full = next((row["total"] for row in rows if row["method"] == "conventional"), None)
    for row in rows:
        row["over_conventional"] = None if full is None else row["total"] / full
        print(json.dumps(row))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    existing = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            existing = [row for row in json.load(f)
                        if (row["shape"], row["prompt"], row["group"], row["response"])
                        != (args.shape, args.prompt, args.group, args.response)]
    with open(args.out, "w") as f:
        json.dump(existing + rows, f, indent=1)


if __name__ == "__main__":
    main()
