"""Benchmark: rollouts under ZeRO-3 on 2 CPU ranks, the weights served per call against gathered whole.

    python bench/bench_rollout_zero3.py [--prompt 1024] [--samples 4] [--new 32] [--hidden 512] [--repeat 2]
                                        [--write BENCHMARKS.md]

For each `rollout.zero3_weights` setting ("per_call", "whole", and "auto", the default) it starts the real `deepspeed`
launcher (`--num_gpus 2`: 2 CPU ranks on gloo, one intra-op thread each) on this file as the rank script, so each
setting runs in fresh processes. Every rank builds the same random qwen3_5 (the "small" shape widened to
--hidden, float32) under ZeRO-3 with stage3_param_persistence_threshold 0 and stage3_max_reuse_distance 0 (every
module call gathers its weights, as a model too large to keep them resident would), and samples --samples
responses of --new tokens (no eos: every step is a real one) to its own prompt: --prompt tokens on rank 0, 3/4 of
that on rank 1, so the ranks decode in lockstep with padded captures. The rollout is `rollout_step.engine_rollouts`,
the call engine.grpo_step(prompts, rollout=...) makes before training, timed alone: --repeat calls, the last
reported (the first also records ZeRO-3's module trace). Per rank:

  seconds    wall and CPU seconds of the rollout (the slower rank's are reported);
  gathered   bytes ZeRO-3 all-gathers during it (bench_ep.GatherCounter: every partitioned parameter's gather entry
             points, counting the parameters brought in while not available);
  peak       the process's high-water mark (VmHWM, reset before the call) less the resident set before it: the
             whole weights live on every rank with "whole", one submodule's with "per_call".
"""

import argparse
import json
import os
import shlex
import sys
import time

from two_ranks import add_rank_script_arguments, launch_two_ranks  # bench/ is the script's folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SECTION = "rollout-zero3"
SETTINGS = ("per_call", "whole", "auto")
MIB = 2 ** 20


def response_length(prompt_ids, response_ids):
    """The rollout's reward here (any prompt): the sample's length. Rewards do not enter the timing."""
    return float(len(response_ids))


def rank_main(args):
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from bench_ep import GatherCounter
    from deepspeed import comm as dist

    import ds_longstraw
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak, return_freed_host_memory
    from ds_longstraw.models.shapes import build_named
    from ds_longstraw.rollout.step import engine_rollouts

    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = build_named("small", dtype=torch.float32, seed=0, hidden_size=args.hidden,
                        intermediate_size=3 * args.hidden)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
              "longstraw": {"enabled": True, "prefix_grad": "detached", "capture_chunk": 256, "page_tokens": 64}}
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                         config=config)
    counter = GatherCounter(engine.module, lambda param: "other")
    length = args.prompt if rank == 0 else args.prompt * 3 // 4
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(rank))
    rollout = {"source": "internal", "num_samples": args.samples, "max_new_tokens": args.new,
               "reward": "bench_rollout_zero3:response_length", "seed": 0, "zero3_weights": args.setting}
    calls = []
    for _ in range(args.repeat):
        counter.reset()
        return_freed_host_memory("cpu")
        dist.barrier()
        before = host_current_bytes()
        reset_host_peak()
        cpu = time.process_time()
        groups, extras, captures = engine_rollouts(engine, [prompt], rollout)
        cpu = time.process_time() - cpu
        peak = host_peak_bytes() - before
        for kept in captures:
            if kept is not None:
                kept.release()
        calls.append({"seconds": extras["rollout_seconds"], "cpu_seconds": cpu, "peak_bytes": peak,
                      "took": extras["zero3_weights"],
                      "gathered_bytes": counter.bytes["other"],
                      "tokens": sum(len(ids) for ids in groups[0].response_ids)})
    out = {"rank": rank, "setting": args.setting, "weight_bytes": weight_bytes, "prompt": length, "calls": calls}
    with open(os.path.join(args.result, f"rank{rank}.json"), "w") as handle:
        json.dump(out, handle)
    dist.barrier()
    dist.destroy_process_group()


# -- driver -----------------------------------------------------------------------------------------------------

def launch(args, setting):
    """One 2-rank job (fresh processes) for one setting; returns the two ranks' results."""
    return launch_two_ranks(__file__, ["--setting", setting, "--prompt", str(args.prompt), "--samples",
                                       str(args.samples), "--new", str(args.new), "--hidden", str(args.hidden),
                                       "--repeat", str(args.repeat)], f"bench_rollout_zero3_{setting}")


def summarise(ranks):
    """The last call: the slower rank's seconds, the larger peak, the mean gathered bytes."""
    last = [r["calls"][-1] for r in ranks]
    return {"seconds": max(c["seconds"] for c in last), "cpu": max(c["cpu_seconds"] for c in last),
            "peak": max(c["peak_bytes"] for c in last), "gathered": sum(c["gathered_bytes"] for c in last) / 2,
            "tokens": [c["tokens"] for c in last], "weights": ranks[0]["weight_bytes"], "took": last[0]["took"]}


def report(args, rows, command):
    def mib(n):
        return f"{n / MIB:,.1f}"

    lines = [f"Command: `{command}`", "",
             f"qwen3_5 \"small\" shape widened to hidden {args.hidden} (8 layers, vocabulary 1,024; "
             f"{mib(rows['per_call']['weights'])} MiB of float32 weights), ZeRO-3 on 2 CPU ranks (`deepspeed "
             f"--num_gpus 2`, gloo, 1 thread each; every module call gathers its weights), one prompt per rank "
             f"({args.prompt:,} and {args.prompt * 3 // 4:,} tokens), G = {args.samples}, {args.new} new tokens "
             f"each (no eos); call {args.repeat} of {args.repeat} reported, the slower rank's time, the larger "
             "peak, the mean gathered bytes.", "",
             "| `rollout.zero3_weights` | rollout wall s | CPU s | ZeRO-3 gathered per rank (MiB) | "
             "peak above resident (MiB) |", "|---|---:|---:|---:|---:|"]
    for setting in SETTINGS:
        r = rows[setting]
        label = f"auto (the default: took {r['took']})" if setting == "auto" else setting
        lines.append(f"| {label} | {r['seconds']:.2f} | {r['cpu']:.2f} | {mib(r['gathered'])} | {mib(r['peak'])} |")
    per_call, whole = rows["per_call"], rows["whole"]
    lines += ["", f"\"whole\" against \"per_call\": {whole['seconds'] / per_call['seconds']:.2f}x the wall time "
              f"({per_call['seconds'] / whole['seconds']:.1f}x faster), {whole['cpu'] / per_call['cpu']:.2f}x the "
              f"CPU time, {whole['gathered'] / per_call['gathered']:.3f}x the gathered bytes, and a peak "
              f"{(whole['peak'] - per_call['peak']) / MIB:,.1f} MiB higher (the weights held whole: "
              f"{mib(whole['weights'])} MiB)."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1024, help="rank 0's prompt tokens (rank 1: 3/4 of them)")
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt (G)")
    parser.add_argument("--new", type=int, default=32, help="tokens per response")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (intermediate: 3x)")
    parser.add_argument("--repeat", type=int, default=2, help="rollout calls per setting; the last is reported")
    parser.add_argument("--write", default=None, help="markdown file whose bench:rollout-zero3 section to rewrite")
    # the rank script's arguments
    add_rank_script_arguments(parser)
    parser.add_argument("--setting", default="per_call", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_script:
        rank_main(args)
        return 0
    command = "python bench/bench_rollout_zero3.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows = {}
    for setting in SETTINGS:
        started = time.perf_counter()
        rows[setting] = summarise(launch(args, setting))
        print(f"{setting}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    text = report(args, rows, command.strip())
    print(text)
    if args.write:
        from ds_longstraw.tools.bench import write_section

        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
