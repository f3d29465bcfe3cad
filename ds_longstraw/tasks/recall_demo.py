"""`bin/main --task recall` (`longstraw demo --task recall`): a policy that learns to read its long prompt.

1. The supervised warm-up (ds_longstraw.tasks.recall_warmup, plain PyTorch) at SHORT prompts, built once into
   runs/recall/warmup (a save_pretrained directory; rebuilt only when WARMUP changes; nothing is downloaded).
2. GRPO through the engine (ds_longstraw.tasks.recall_grpo: configs/run/recall_task.yaml, rollouts inside
   training, `engine.grpo_step`) at the LONG length, where the warm-up's accuracy has dropped, with the held-out
   exact-match accuracy at the long length measured every few steps; a plot of it against step.

bench/recall_study.py runs the long version (3 seeds, detached and exact); BENCHMARKS.md has its figure.
"""

import json
import time
from pathlib import Path

from ds_longstraw.tasks.recall_warmup import SHAPE

# The warm-up: the task's sizes at the short length, and its optimizer settings (recall_warmup.warm_up).
SHORT = {"prompt_tokens": 32, "records": 4, "keys": 8, "values": 8, "fillers": 8}
WARMUP = {"steps": 600, "lr": 2e-3, "batch_size": 64, "seed": 0}
EVAL_LENGTHS = (32, 256)  # the warm-up's own length and the run config's long length


def warm_checkpoint(directory, log=print, *, short=None, recipe=None, eval_lengths=EVAL_LENGTHS, task=None):
    """(path, info) of the warm-up checkpoint, built on first use; info: its accuracies at the short and the long
    length (held-out prompts), the short length, and the seconds it took to build (0 when reused). Another task's
    warm-up (tasks/reread.py's) passes its module, its sizes at the short length and its recipe (WARMUP's keys)."""
    from ds_longstraw.tasks import recall, recall_warmup

    short, recipe, task = short or SHORT, recipe or WARMUP, task or recall
    start = time.perf_counter()
    path = recall_warmup.cached(directory, SHAPE, short, **recipe, eval_lengths=tuple(eval_lengths), log=log,
                                **({} if task is recall else {"task": task}))
    history = json.loads((Path(path) / "recipe.json").read_text())["history"]
    last = history[-1]["accuracy"]
    return path, {"short_length": short["prompt_tokens"], "accuracy_short": last[str(short["prompt_tokens"])],
                  "accuracy_by_length": last, "build_seconds": round(time.perf_counter() - start, 1),
                  "recipe": {"shape": SHAPE.name, "sizes": short, **recipe}}


def plot(result, info, long_len, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in result["evals"]]
    acc = [e["accuracy"][long_len] for e in result["evals"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, acc, "o-", color="tab:red" if result["prefix_grad"] == "exact" else "tab:blue",
            label=f"GRPO ({result['prefix_grad']}), held-out accuracy at {long_len} tokens")
    ax.axhline(1 / result["prompt_args"]["records"], color="gray", ls="--", lw=0.8, label="random record")
    ax.axhline(1 / result["prompt_args"]["values"], color="gray", ls=":", lw=0.8, label="chance")
    ax.axhline(info["accuracy_short"], color="green", lw=0.8,
               label=f"warm-up at its own length ({info['short_length']} tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    """The demo's body: warm-up (cached), GRPO with held-out evaluation, the summary and the plot."""
    from ds_longstraw.tasks import recall_grpo

    out = Path(args.out)
    start = time.perf_counter()
    warm, info = warm_checkpoint(out / "warmup")
    built = f"built in {info['build_seconds']:.0f} s" if info["build_seconds"] > 5 else "reused"
    print(f"recall: warm-up checkpoint {warm} ({built}); held-out accuracy "
          + ", ".join(f"{a:.3f} at {n} tokens" for n, a in info["accuracy_by_length"].items()))
    result = recall_grpo.train(out / f"grpo_{args.prefix_grad}", warm_dir=warm, prefix_grad=args.prefix_grad, seed=0,
                               steps=args.steps, eval_every=args.eval_every)
    long_len = result["prompt_args"]["prompt_tokens"]
    first, last = result["evals"][0]["accuracy"][long_len], result["evals"][-1]["accuracy"][long_len]
    seconds = time.perf_counter() - start
    plot(result, info, long_len, args.plot, f"recall, GRPO at {long_len} tokens after a {info['short_length']}-token "
         f"warm-up ({result['prefix_grad']}, {len(result['steps'])} steps)")
    print(f"\nrecall: held-out exact match at {long_len} tokens {first:.3f} (warm-up) -> {last:.3f} after "
          f"{len(result['steps'])} GRPO steps ({result['prefix_grad']}); "
          f"chance {1 / result['prompt_args']['values']:.3f}, "
          f"random record {1 / result['prompt_args']['records']:.2f}; {seconds:.0f} s in all; plot {args.plot}")
