"""The recall study: GRPO at the long length from the warm-up checkpoint, detached against exact, several seeds.

    python bench/recall_study.py                      # 3 seeds x {detached, exact}; JSON + PNG under bench/
    python bench/recall_study.py --steps 40 --seeds 0 # shorter

Builds (or reuses) the warm-up checkpoint (ds_longstraw.tasks.recall_warmup.cached with recall_demo.WARMUP), then
runs ds_longstraw.tasks.recall_grpo once per (prefix_grad, seed), each in its own process (one rank, gloo, ZeRO-3 on
CPU), two at a time: the detached and the exact run of one seed side by side, so that their seconds per step are
measured under the same load. Every run starts from the same checkpoint and sees the same prompts and sampling
seeds; only prefix_grad differs. Writes bench/results/recall_study.json (every run's per-step rewards and seconds,
held-out accuracies, the levels) and bench/recall_study.png: held-out exact-match accuracy at the long length
against step, both modes, every seed, with chance, random-record and warm-up levels; seconds per step beside it.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pair(jobs, threads):
    """Run the (argv, log path) jobs side by side; raise if any fails."""
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for argv, log in jobs:
        handle = open(log, "w")
        procs.append((subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env), handle, log))
    for proc, handle, log in procs:
        proc.wait()
        handle.close()
        if proc.returncode:
            raise RuntimeError(f"{' '.join(map(str, proc.args))} failed ({proc.returncode}); see {log}")


def plot(study, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long_len = str(study["long_length"])
    colors = {"detached": "tab:blue", "exact": "tab:red"}
    styles = ["-", "--", ":", "-."]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [2.2, 1]})
    for run in study["runs"]:
        steps = [e["step"] for e in run["evals"]]
        acc = [e["accuracy"][long_len] for e in run["evals"]]
        left.plot(steps, acc, styles[run["seed"] % len(styles)], color=colors[run["prefix_grad"]], marker=".",
                  label=f"{run['prefix_grad']}, seed {run['seed']}")
    levels = study["levels"]
    left.axhline(levels["chance"], color="gray", lw=0.8, ls=":")
    left.text(0, levels["chance"] + 0.01, f"chance 1/values = {levels['chance']:.3f}", fontsize=8, color="gray")
    left.axhline(levels["random_record"], color="gray", lw=0.8, ls="--")
    left.text(0, levels["random_record"] + 0.01, f"random record 1/records = {levels['random_record']:.2f}",
              fontsize=8, color="gray")
    left.axhline(levels["warmup_long"], color="black", lw=0.8)
    left.text(0, levels["warmup_long"] + 0.01, f"warm-up at {long_len} tokens = {levels['warmup_long']:.3f}",
              fontsize=8)
    left.axhline(levels["warmup_short"], color="green", lw=0.8)
    left.text(0, levels["warmup_short"] - 0.04, f"warm-up at its own length {study['short_length']} = "
              f"{levels['warmup_short']:.3f}", fontsize=8, color="green")
    left.set_ylim(0, 1.02)
    left.set_xlabel("GRPO step (engine.grpo_step, rollouts inside training)")
    left.set_ylabel(f"held-out exact match at {long_len} tokens")
    left.set_title("recall: GRPO at the long length after a short warm-up")
    left.legend(fontsize=7, loc="lower right", ncol=2)
    modes = sorted({r["prefix_grad"] for r in study["runs"]})
    for i, prefix_grad in enumerate(modes):
        runs = [r for r in study["runs"] if r["prefix_grad"] == prefix_grad]
        values = [r["seconds_per_step"] for r in runs]
        right.bar([i + 0.25 * (k - (len(runs) - 1) / 2) for k in range(len(runs))], values, width=0.22,
                  color=colors[prefix_grad], alpha=0.8)
    right.set_xticks(range(len(modes)), modes)
    right.set_ylabel("seconds per step (median; bars: seeds)")
    right.set_title("s/step (2 runs at a time, shared CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (two runs at a time)")
    parser.add_argument("--warm", default=str(ROOT / "runs" / "recall" / "warmup"))
    parser.add_argument("--work", default=str(ROOT / "runs" / "recall" / "study"))
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "recall_study.json"))
    parser.add_argument("--plot", default=str(ROOT / "bench" / "recall_study.png"))
    parser.add_argument("overrides", nargs="*", help="run-config overrides for every run, e.g. optim.lr=2e-3")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from ds_longstraw.tasks import recall_demo

    warm, warm_info = recall_demo.warm_checkpoint(args.warm)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for seed in seeds:
        jobs = []
        for prefix_grad in modes:
            out = work / f"{prefix_grad}_seed{seed}"
            jobs.append(([sys.executable, "-m", "ds_longstraw.tasks.recall_grpo", "--warm", str(warm),
                          "--prefix-grad", prefix_grad, "--seed", str(seed), "--steps", str(args.steps),
                          "--eval-every", str(args.eval_every),
                          "--eval-prompts", str(args.eval_prompts), "--threads", str(args.threads),
                          "--out", str(out), *args.overrides], work / f"{prefix_grad}_seed{seed}.log"))
        run_pair(jobs, args.threads)
        print(f"seed {seed} done ({time.perf_counter() - started:.0f} s)", flush=True)
    runs = []
    for seed in seeds:
        for prefix_grad in modes:
            result = json.loads((work / f"{prefix_grad}_seed{seed}" / "result.json").read_text())
            seconds = sorted(s["seconds"] for s in result["steps"])
            result["seconds_per_step"] = seconds[len(seconds) // 2]
            runs.append(result)
    sizes = runs[0]["prompt_args"]
    long_len = sizes["prompt_tokens"]
    study = {"long_length": long_len, "short_length": warm_info["short_length"], "warmup": warm_info,
             "levels": {"chance": 1 / sizes["values"], "random_record": 1 / sizes["records"],
                        "warmup_long": runs[0]["evals"][0]["accuracy"][str(long_len)],
                        "warmup_short": warm_info["accuracy_short"]},
             "steps": args.steps, "overrides": args.overrides, "wall_seconds": round(time.perf_counter() - started),
             "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(study, indent=1))
    plot(study, args.plot)
    for run in runs:
        acc = [e["accuracy"][str(long_len)] for e in run["evals"]]
        print(f"{run['prefix_grad']:8s} seed {run['seed']}: accuracy@{long_len} {acc[0]:.3f} -> {acc[-1]:.3f} "
              f"(best {max(acc):.3f}); {run['seconds_per_step']:.2f} s/step")
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
