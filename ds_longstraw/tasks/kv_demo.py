"""`bin/main --task kv` (`longstraw demo --task kv`): GRPO with rollouts inside training on the kv task, then a plot.

It runs launch/train.py (ds_longstraw.launch.train) in this process as a one-rank DeepSpeed job (ZeRO-3 on CPU,
gloo) with configs/run/kv_task.yaml, both as the package ships them, so that it runs from any directory and from an
installed wheel: every step samples G answers per prompt from the policy, rewards them with
ds_longstraw.tasks.kv:reward_partial and takes one optimizer step. Afterwards it prints the mean reward over the
first and the last steps and writes reward and loss against step as a PNG (matplotlib).

The loss is the GRPO objective's value on the step's own samples: on-policy the ratio is 1, so its value is
-mean(advantage), which group normalisation makes 0 (up to the token weighting); it is plotted as asked, but the
reward is the curve that shows learning.
"""

import json
import os
import socket
from pathlib import Path

from ds_longstraw.models.modeling import CONFIGS_DIR

RUN_CONFIG = CONFIGS_DIR / "run" / "kv_task.yaml"
# The run config's keys that name a file under configs/ (as a checkout's root sees it)
SHIPPED_PATHS = ("deepspeed_config", "model.shape")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train_module():
    """launch/train.py, shipped in the package as ds_longstraw.launch.train."""
    from ds_longstraw.launch import train as script

    return script


def train_arguments(steps, metrics, overrides=()) -> list:
    """launch/train.py's command line for the demo. kv_task.yaml names its DeepSpeed config and model shape by
    their paths in a checkout (configs/...), which resolve only from the checkout's root: they are given again here
    as the files the package ships, so that the demo runs from any directory."""
    from omegaconf import OmegaConf

    run = OmegaConf.load(RUN_CONFIG)
    shipped = []
    for key in SHIPPED_PATHS:
        first, *rest = OmegaConf.select(run, key).split("/")
        assert first == "configs" and rest, f"{RUN_CONFIG}: {key} is not a file under configs/"
        shipped.append(f"{key}={CONFIGS_DIR.joinpath(*rest)}")
    return ["--config", str(RUN_CONFIG), *shipped, f"train.max_steps={steps}", f"train.metrics={metrics}",
            *overrides]


def train(out_dir, steps, overrides=()) -> list:
    """Run configs/run/kv_task.yaml for `steps` steps on one rank in this process; the per-step metric records."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = out_dir / "metrics.jsonl"
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    _train_module().main(train_arguments(steps, metrics, overrides))
    with open(metrics) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def window_means(records, width) -> tuple:
    """(mean reward of the first `width` steps, of the last `width` steps)."""
    rewards = [r["mean_reward"] for r in records]
    width = max(1, min(width, len(rewards) // 2))
    return sum(rewards[:width]) / width, sum(rewards[-width:]) / width


def plot(records, path, title):
    """Reward (and its running mean over 10 steps) and loss against step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["mean_reward"] for r in records]
    smooth = [sum(rewards[max(0, i - 9): i + 1]) / len(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    top.plot(steps, rewards, ".", color="tab:blue", alpha=0.5, label="mean reward of the step")
    top.plot(steps, smooth, "-", color="tab:blue", label="running mean, 10 steps")
    top.set_ylabel("reward")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="upper left")
    top.set_title(title)
    bottom.plot(steps, [r["mean_loss"] for r in records], "-", color="tab:red")
    bottom.set_ylabel("GRPO loss (on-policy: ~0)")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    """The demo's body: train, then print the summary and write the plot."""
    import time

    start = time.perf_counter()
    records = train(args.out, args.steps)
    seconds = time.perf_counter() - start
    first, last = window_means(records, 10)
    width = max(1, min(10, len(records) // 2))
    plot(records, args.plot, f"kv task, rollouts inside training: {len(records)} steps, {seconds:.0f} s")
    print(f"\nkv task: mean reward {first:.3f} over the first {width} steps, {last:.3f} over the last {width} "
          f"({len(records)} steps, {seconds:.1f} s); plot {args.plot}; metrics {args.out}/metrics.jsonl")
