"""GRPO training with ds_longstraw, for the `deepspeed` launcher.

    deepspeed --num_gpus 2 launch/train.py --config configs/run/quickstart.yaml [key=value ...]
    deepspeed --hostfile launch/hostfile.example launch/train.py --config configs/run/qwen3_6_27b_h20.yaml

Reads GRPO groups (a shared prompt, G responses, rewards) from JSONL, one optimizer step per `grpo_step` (each
data-parallel rank brings `data.groups_per_rank` groups; DeepSpeed averages the ranks' gradients). With a
`rollout:` block (ds_longstraw.rollout.step) each step samples its groups from the policy instead: the step's
prompts come from data.path (their responses unread) or from the `rollout.prompts` generator, and the rewards from
`rollout.reward`; the step line then shows the mean reward, and train.samples (JSONL) records what rank 0 sampled.
Rank 0 prints
a short line per step (step, loss, grad norm, seconds, tokens/s, peak) and the checkpoint path at the end, and logs
the full per-step metrics as JSONL (train.metrics). It saves DeepSpeed checkpoints (tags "step<N>", with the step in
the client state, and the run record `longstraw export` reads), resumes from them (`train.resume=latest` or a tag),
and with train.export_dir exports the last one. The run config is engine/run_config.py's RunConfig (YAML + dotlist
overrides); the DeepSpeed JSON it names carries the "longstraw" block.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML (ds_longstraw.engine.run_config.RunConfig)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.max_steps=5 optim.lr=1e-4")
    args = parser.parse_args(argv)
    bad = [item for item in args.overrides if "=" not in item]
    if bad:
        parser.error(f"overrides must look like key=value, got {bad}")
    return args


def _tokenizer(run):
    path = run.data.tokenizer or run.model.pretrained
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if run.data.tokenizer:  # asked for explicitly: say so
            raise
        return None  # a checkpoint without tokenizer files: fine as long as the data holds token ids


def build_policy(run, ds_config):
    from ds_longstraw.models.lora import apply_lora
    from ds_longstraw.models.modeling import build_model

    model = build_model(shape=run.model.shape, pretrained=run.model.pretrained, dtype=run.model.dtype,
                        seed=run.model.seed, ds_config=ds_config, zero_init=run.model.zero_init,
                        attn_implementation=run.model.attn_implementation, four_bit=run.lora.qlora)
    if run.lora.enabled:
        model = apply_lora(model, r=run.lora.r, alpha=run.lora.alpha, dropout=run.lora.dropout,
                           target_modules=run.lora.target_modules, seed=run.lora.seed)
    return model


def _reference(run, ds_config):
    """The frozen reference policy for the KL term of a full fine-tune: the starting weights, in a ZeRO engine of
    its own (no optimizer) so that under ZeRO-3 its weights are partitioned too."""
    import deepspeed

    from ds_longstraw.models.modeling import build_model

    model = build_model(shape=run.model.shape, pretrained=run.model.pretrained, dtype=run.model.dtype,
                        seed=run.model.seed, ds_config=ds_config, zero_init=run.model.zero_init,
                        attn_implementation=run.model.attn_implementation)
    model.requires_grad_(False).eval()
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler", "longstraw")}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def step_metrics(step, result, world):
    """One line per step. On-policy without old log-probs the loss VALUE is -mean(advantage) whatever the weights
    (the ratio is 1); the mean response log-prob (and the KL to the reference) show the policy moving."""
    phases = {}
    for group in result.groups:
        for name, stats in group.phases.items():
            phases[name] = phases.get(name, 0.0) + stats.seconds
    logps = torch.cat([lp for group in result.groups for lp in group.logprobs])
    kl = None
    if all(group.ref_logprobs is not None for group in result.groups):
        delta = torch.cat([r for group in result.groups for r in group.ref_logprobs]) - logps
        kl = float((delta.exp() - delta - 1).mean())  # the k3 estimator the objective uses
    return {
        "step": step, "loss": result.loss, "mean_loss": result.mean_loss, "lr": result.lr,
        "mean_logprob_rank0": float(logps.mean()), "kl_rank0": kl,
        "grad_norm": result.grad_norm, "seconds": round(result.seconds, 4), "tokens_rank0": result.tokens,
        "tokens_per_s_rank0": round(result.tokens / max(result.seconds, 1e-9), 2),
        "groups_per_rank": len(result.groups), "responses_rank0": sum(len(g.logprobs) for g in result.groups),
        "dp_world": world, "peak_bytes_rank0": max(g.peak_bytes for g in result.groups),
        "phase_seconds_rank0": {k: round(v, 4) for k, v in phases.items()}, "skipped": result.skipped,
        "members_in_steps_rank0": sum(g.extras.get("members_in_steps", 0) for g in result.groups),
        **({"mean_reward": result.extras["mean_reward"], "rollout_seconds_rank0":
            round(result.extras["rollout_seconds"], 4),
            "capture_reused_rank0": all(g.extras.get("capture_reused") for g in result.groups),
            "zero3_weights_rank0": result.extras["zero3_weights"]}
           if "mean_reward" in result.extras else {}),
    }


def _log_file(path, resume):
    """A JSONL log opened for writing (None without a path); a resumed run appends to it."""
    if not path:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "a" if resume else "w")


def _sample_records(step, result, tokenizer):
    """train.samples: one record per group rank 0 sampled at `step` (its prompt's length and last ids, each
    response's ids, text where a tokenizer is known, reward and whether it ended with eos)."""
    for index, (group, finished) in enumerate(zip(result.extras["groups"], result.extras["finished"], strict=True)):
        responses = [ids.tolist() for ids in group.response_ids]
        record = {"step": step, "group": index, "prompt_tokens": group.prompt_ids.numel(),
                  "prompt_tail": group.prompt_ids[-16:].tolist(), "response_ids": responses,
                  "rewards": group.rewards.tolist(), "finished": finished}
        if tokenizer is not None:
            record["responses"] = [tokenizer.decode(ids) for ids in responses]
        yield record


class Groups:
    """Each step's groups from data.path (JSONL with responses and rewards)."""

    rollout = None

    def __init__(self, run, tokenizer):
        from ds_longstraw.tools.data import GroupSource

        self.data = GroupSource(run.data.path, tokenizer=tokenizer, shuffle_seed=run.data.shuffle_seed)
        self.path = run.data.path

    def describe(self):
        return f"{len(self.data)} groups from {self.path}"

    def for_step(self, step, rank, world, per_rank):
        return self.data.for_step(step, rank, world, per_rank)


class Prompts:
    """Each step's prompts for rollouts inside training: data.path's prompts (JSONL order, as groups), or prompt
    index (step W + r) k + j of the `rollout.prompts` generator, called generator(rollout.seed, index, **args)."""

    def __init__(self, run, tokenizer):
        from omegaconf import OmegaConf

        from ds_longstraw.rollout.step import parse_rollout

        self.rollout = parse_rollout(OmegaConf.to_container(run.rollout, resolve=True))
        self.generator = self.rollout.prompt_function()
        self.data = None
        if self.generator is None:
            from ds_longstraw.tools.data import GroupSource

            self.data = GroupSource(run.data.path, tokenizer=tokenizer, shuffle_seed=run.data.shuffle_seed)
            self.data.prompt(0)  # a record without a prompt fails here, before any work
        else:
            try:  # bad prompt_args fail here too
                self.generator(self.rollout.seed, 0, **self.rollout.prompt_args)
            except (TypeError, ValueError) as error:
                raise ValueError(f"'rollout.prompt_args' = {self.rollout.prompt_args!r} for {self.rollout.prompts}: "
                                 f"{error}") from None
        self.where = run.data.path or self.rollout.prompts

    def describe(self):
        count = f"{len(self.data)} prompts" if self.data is not None else "prompts"
        return (f"rollouts: {count} from {self.where}, G = {self.rollout.num_samples}, up to "
                f"{self.rollout.max_new_tokens} new tokens, reward {self.rollout.reward}")

    def for_step(self, step, rank, world, per_rank):
        if self.data is not None:
            return self.data.prompts_for_step(step, rank, world, per_rank)
        first = (step * world + rank) * per_rank
        return [self.generator(self.rollout.seed, first + j, **self.rollout.prompt_args) for j in range(per_rank)]


def _source(run, tokenizer):
    return Groups(run, tokenizer) if run.rollout is None else Prompts(run, tokenizer)


def dump_trainable(engine, path, rank):
    """Full copies of the trainable parameters (gathered one at a time under ZeRO-3), saved by rank 0."""
    import deepspeed

    out = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            if rank == 0:
                out[name] = param.detach().clone().cpu()
    if rank == 0:
        torch.save(out, path)


def step_line(record, max_steps) -> str:
    """What the user reads per step (the full record goes to train.metrics)."""
    grad = "-" if record["grad_norm"] is None else f"{record['grad_norm']:.4f}"
    reward = f"  reward {record['mean_reward']:.3f}" if "mean_reward" in record else ""
    return (f"[longstraw] step {record['step']}/{max_steps}{reward}  loss {record['mean_loss']:+.4f}  "
            f"grad norm {grad}  "
            f"{record['seconds']:.2f} s  {record['tokens_per_s_rank0']:,.0f} tok/s  "
            f"peak {record['peak_bytes_rank0'] / 2**20:,.0f} MiB" + ("  (skipped)" if record["skipped"] else ""))


def _settle_accelerator():
    """DS_ACCELERATOR=cpu where this machine shows no device, before deepspeed is imported: importing ds_longstraw
    settles it first thing (ds_longstraw/accelerator.py)."""
    import ds_longstraw  # noqa: F401


def init_distributed():
    """deepspeed.init_distributed, without the line each rank prints when it loads DeepSpeed's shared-memory
    all-reduce op ("... deepspeed_shm_comm_op built successfully"); anything else it prints is passed on."""
    import contextlib
    import io

    import deepspeed

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        deepspeed.init_distributed()
    for line in captured.getvalue().splitlines():
        if not line.endswith("built successfully"):
            print(line, flush=True)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _settle_accelerator()
    from ds_longstraw.tools.console import hide_third_party_notices

    hide_third_party_notices()
    from ds_longstraw.engine.run_config import load_run_config

    run = load_run_config(args.config, args.overrides)

    # Everything that can be checked without a process group is checked first.
    from ds_longstraw.engine.config import load_ds_config, read_block

    ds_config = load_ds_config(run.deepspeed_config)
    read_block(ds_config, world_size=int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    from ds_longstraw import GRPOObjective

    objective = GRPOObjective(**run.objective)
    tokenizer = _tokenizer(run)
    source = _source(run, tokenizer)
    if run.train.resume and not run.train.save_dir:
        raise ValueError("train.resume needs train.save_dir (where the checkpoints are)")
    if run.train.export_dir and os.path.lexists(run.train.export_dir) and not run.train.resume:
        raise ValueError(f"train.export_dir = {run.train.export_dir!r} exists: remove it or choose another "
                         "(only a resumed run replaces its earlier export)")

    from deepspeed import comm as dist

    import ds_longstraw
    from ds_longstraw.engine.checkpoint_files import save_record
    from ds_longstraw.kernels.dispatch import describe_paths

    init_distributed()
    rank = dist.get_rank()
    model = build_policy(run, ds_config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(trainable, lr=run.optim.lr, betas=tuple(run.optim.betas), eps=run.optim.eps,
                                      weight_decay=run.optim.weight_decay)
    engine, _, _, _ = ds_longstraw.initialize(model=model, optimizer=optimizer,
                                              model_parameters=trainable if optimizer is None else None,
                                              config=ds_config)
    reference = _reference(run, ds_config) if objective.kl_coef > 0 and not run.lora.enabled else None
    # DeepSpeed's data-parallel group is every rank; with cp_size N the N consecutive ranks of a context-parallel
    # group are one data replica and must bring the same groups (parallel/parallelism.py).
    dp_rank, dp_world = engine.longstraw_parallelism.replica, engine.longstraw_parallelism.replicas

    start = 0
    if run.train.resume:
        tag = None if run.train.resume == "latest" else run.train.resume
        path, client = engine.load_checkpoint(run.train.save_dir, tag=tag, trust_pickle=run.train.trust_pickle)
        if path is None:
            raise ValueError(f"train.resume = {run.train.resume!r}: no checkpoint in {run.train.save_dir!r}")
        start = int(client["step"])
    if rank == 0:
        import psutil

        from ds_longstraw.models.lora import trainable_summary

        ready = time.time() - psutil.Process().create_time()
        counts = trainable_summary(engine.module)
        print(f"[longstraw] {source.describe()}; {dp_world} data-parallel replica(s); steps "
              f"{start + 1}..{run.train.max_steps}; {counts['trainable_params']:,} of {counts['total_params']:,} "
              f"parameters train; ready {ready:.1f} s after start", flush=True)

    metrics_file = _log_file(run.train.metrics, run.train.resume) if rank == 0 else None
    samples_file = _log_file(run.train.samples, run.train.resume) if rank == 0 else None
    bar = None
    if rank == 0 and run.train.progress:
        from tqdm import tqdm

        # disable=None: no bar where stderr is not a terminal (logs); the per-step metric lines remain.
        bar = tqdm(total=run.train.max_steps, initial=start, desc="grpo steps", unit="step", disable=None)
    say = bar.write if bar is not None else print
    started, saved = time.perf_counter(), None
    for step in range(start, run.train.max_steps):
        items = source.for_step(step, dp_rank, dp_world, run.data.groups_per_rank)
        result = engine.grpo_step(items, objective, ref_model=reference, rollout=source.rollout)
        done = step + 1
        if rank == 0:
            record = step_metrics(done, result, dp_world)
            say(step_line(record, run.train.max_steps))
            if done == start + 1:  # which kernel paths the first step took on this rank (never silently)
                say(f"[longstraw] {describe_paths()}")
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if samples_file is not None:
                for line in _sample_records(done, result, tokenizer):
                    samples_file.write(json.dumps(line) + "\n")
                samples_file.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{result.mean_loss:.4f}")
        last = done == run.train.max_steps
        every = run.train.save_every
        if run.train.save_dir and ((every and done % every == 0) or last):
            engine.save_checkpoint(run.train.save_dir, tag=f"step{done}", client_state={"step": done})
            saved = os.path.join(run.train.save_dir, f"step{done}")
            if rank == 0:  # what `longstraw export` needs beside the shards
                save_record(os.path.join(run.train.save_dir, f"step{done}"), run, engine.module, tokenizer)
    if bar is not None:
        bar.close()
    for handle in (metrics_file, samples_file):
        if handle is not None:
            handle.close()
    if run.train.dump_params:
        dump_trainable(engine, run.train.dump_params, rank)
    if rank == 0:
        where = [f"checkpoint {saved}" if saved else "no checkpoint (train.save_dir is not set)"]
        if run.train.metrics:
            where.append(f"metrics {run.train.metrics}")
        print(f"[longstraw] done: steps {start + 1}..{run.train.max_steps} in {time.perf_counter() - started:.1f} s; "
              + "; ".join(where), flush=True)
    dist.barrier()  # every rank's shards are written
    dist.destroy_process_group()
    if run.train.export_dir and rank == 0:
        # After the process group is gone: the export takes one process and may take a while for a big model,
        # longer than the other ranks should wait in a collective.
        from ds_longstraw.engine.export import describe, export_checkpoint

        result = export_checkpoint(run.train.save_dir, run.train.export_dir, merge=run.train.export_merge,
                                   overwrite=bool(run.train.resume), trust_pickle=run.train.trust_pickle)
        print("[longstraw] " + describe(result), flush=True)


if __name__ == "__main__":
    main()
    # The engine's objects hold reference cycles that only the collector frees; freed at interpreter
    # finalization, what they hold of the (destroyed) process groups can abort a rank on its way out ("terminate
    # called without an active exception", seen once in CI on a rank that exited while rank 0 exported). Collected
    # here, they go while the interpreter is whole.
    gc.collect()
