"""GRPO on the recall task through the engine, with held-out evaluation as it trains.

One run: the run config configs/run/recall_task.yaml (launch/train.py's RunConfig), its policy loaded from the
warm-up checkpoint (model.pretrained), the DeepSpeed config it names with "longstraw".prefix_grad set to the run's
mode, `ds_longstraw.initialize`, then per step `engine.grpo_step(prompts, objective, rollout=...)`: the step's
prompts come from `rollout.prompts` (recall.prompt at the long length), G samples each are drawn from the state
captured once per prompt, rewarded by recall.reward, and trained on in one transaction. Every `eval_every` steps
the policy's greedy exact-match accuracy is measured on held-out prompts (stream recall_warmup.EVAL_SEED, never
trained on) at each evaluation length, through the engine's module (ZeRO-3's hooks gather the weights).

This is launch/train.py's loop (its helpers build the policy and the prompt source) plus the evaluation; it runs on
one rank (world size 1, gloo) in this process. `python -m ds_longstraw.tasks.recall_grpo --help` runs one. Another
task's run config (`run_config`, e.g. configs/run/reread_task.yaml) runs the same loop: the held-out prompts come from
the module its rollout.prompts names (that module's `batch`).

    modes:  detached   the prompt's K/V and recurrent state are constants: only the response's own tokens give
                       gradients (for a one-token answer: the last prompt position's forward, nothing before it)
            exact      gradients flow back through the captured prompt state into every prompt position
"""

import argparse
import contextlib
import importlib
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed

from ds_longstraw.models.modeling import CONFIGS_DIR
from ds_longstraw.tasks.recall_warmup import EVAL_PROMPTS, evaluate, held_out

RUN_CONFIG = CONFIGS_DIR / "run" / "recall_task.yaml"
SHIPPED_PATHS = ("deepspeed_config",)  # run-config keys naming a file under configs/ (as a checkout sees it)
PREFIX_GRADS = ("detached", "exact")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ONE_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def _one_rank():
    """The block runs as a one-rank job: its environment and process group, unless a group exists (the caller's
    then serves). Both are undone on the way out, failed or not, so the process is left as it was found: a
    leftover MASTER_PORT or RANK would be inherited by every process it starts later."""
    if torch.distributed.is_initialized():
        yield
        return
    saved = {key: os.environ.get(key) for key in ONE_RANK_ENV}
    for key, value in zip(ONE_RANK_ENV, ("127.0.0.1", str(_free_port()), "0", "0", "1"), strict=True):
        os.environ.setdefault(key, value)
    try:
        from ds_longstraw.launch.train import init_distributed

        init_distributed()
        yield
    finally:
        if torch.distributed.is_initialized():
            # through DeepSpeed's comm, which also drops the groups DeepSpeed cached from this one (its world and
            # data-parallel groups): torch's call alone leaves them behind, and a second run in this process (a
            # study's next seed, another task's test) then asks a destroyed group for its rank
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shipped_overrides(run_config=RUN_CONFIG):
    """The run config's configs/... paths as the package ships them (it runs from any directory)."""
    from omegaconf import OmegaConf

    run = OmegaConf.load(run_config)
    out = []
    for key in SHIPPED_PATHS:
        first, *rest = OmegaConf.select(run, key).split("/")
        assert first == "configs" and rest, f"{run_config}: {key} is not a file under configs/"
        out.append(f"{key}={CONFIGS_DIR.joinpath(*rest)}")
    return out


def task_of(run):
    """The task module whose prompts the run trains on (the module part of rollout.prompts, 'module:function')."""
    return importlib.import_module(run.rollout["prompts"].split(":")[0])


def train(out_dir, *, warm_dir, prefix_grad, seed, steps, eval_every=10, eval_lengths=(), eval_prompts=EVAL_PROMPTS,
          overrides=(), run_config=RUN_CONFIG, log=print) -> dict:
    """One GRPO run (module docstring); returns {"prefix_grad", "seed", "steps": [...], "evals": [...]} and writes it
    to out_dir/result.json."""
    if prefix_grad not in PREFIX_GRADS:
        raise ValueError(f"prefix_grad must be one of {PREFIX_GRADS}, got {prefix_grad!r}")
    from ds_longstraw.engine.config import load_ds_config, read_block
    from ds_longstraw.engine.run_config import load_run_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = load_run_config(run_config, [*shipped_overrides(run_config), f"model.pretrained={warm_dir}",
                                       f"model.seed={seed}", f"rollout.seed={seed}", f"train.max_steps={steps}",
                                       *overrides])
    ds_config = load_ds_config(run.deepspeed_config)
    ds_config["longstraw"] = {**ds_config["longstraw"], "prefix_grad": prefix_grad}
    read_block(ds_config, world_size=1)
    with _one_rank():
        result = _steps_with_evals(run, ds_config, prefix_grad, seed, steps, eval_every, eval_lengths, eval_prompts,
                                   log)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _steps_with_evals(run, ds_config, prefix_grad, seed, steps, eval_every, eval_lengths, eval_prompts, log) -> dict:
    """The engine, its steps and the held-out evaluations of `train`, inside its process group."""
    import ds_longstraw
    from ds_longstraw import GRPOObjective
    from ds_longstraw.launch.train import Prompts, build_policy, step_metrics

    objective = GRPOObjective(**run.objective)
    source = Prompts(run, None)
    # the step's prompts: a stream of its own per seed (recall.prompt(seed, index)); rollout.seed also seeds the
    # samples. Evaluation prompts are stream EVAL_SEED.
    model = build_policy(run, ds_config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=run.optim.lr, betas=tuple(run.optim.betas), eps=run.optim.eps,
                                  weight_decay=run.optim.weight_decay)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=optimizer, config=ds_config)
    lengths = list(eval_lengths) or [run.rollout["prompt_args"]["prompt_tokens"]]
    sets = held_out(dict(run.rollout["prompt_args"]), lengths, eval_prompts, task_of(run))
    result = {"prefix_grad": prefix_grad, "seed": seed, "warm_dir": str(run.model.pretrained), "lr": run.optim.lr,
              "groups_per_step": run.data.groups_per_rank, "G": run.rollout["num_samples"],
              "prompt_args": dict(run.rollout["prompt_args"]), "steps": [], "evals": []}

    def record_eval(step):
        acc = {n: round(a, 4) for n, a in evaluate(engine.module, sets).items()}
        result["evals"].append({"step": step, "accuracy": acc})
        log(f"[{task_of(run).__name__.split('.')[-1]} {prefix_grad} seed {seed}] step {step}: held-out accuracy "
            + " ".join(f"@{n} {a:.3f}" for n, a in acc.items()))

    record_eval(0)
    for step in range(steps):
        items = source.for_step(step, 0, 1, run.data.groups_per_rank)
        res = engine.grpo_step(items, objective, rollout=source.rollout)
        rec = step_metrics(step + 1, res, 1)
        result["steps"].append({k: rec[k] for k in ("step", "mean_reward", "seconds", "grad_norm",
                                                    "rollout_seconds_rank0")})
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            record_eval(step + 1)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", required=True, help="the warm-up checkpoint directory (recall_warmup.cached)")
    parser.add_argument("--prefix-grad", choices=PREFIX_GRADS, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-lengths", default="", help="comma-separated prompt lengths (default: the run's)")
    parser.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-config", default=str(RUN_CONFIG), help="the run config (default: the recall task's)")
    parser.add_argument("overrides", nargs="*", help="run-config dotlist overrides, e.g. optim.lr=1e-3")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    train(args.out, warm_dir=args.warm, prefix_grad=args.prefix_grad, seed=args.seed, steps=args.steps,
          eval_every=args.eval_every, eval_lengths=lengths, eval_prompts=args.eval_prompts,
          overrides=args.overrides, run_config=args.run_config)


if __name__ == "__main__":
    main()
