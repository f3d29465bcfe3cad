"""TRL's GRPOTrainer against LongStrawGRPOTrainer: one optimizer step's host memory peak at a long prompt, G = 2 and 8.

    python bench/bench_trl_memory.py                       # 16,384-token prompt, G = 2 and 8, the table below
    python bench/bench_trl_memory.py --prompt 4096 --groups 2,4

Each configuration runs in a fresh process (one thread, freed blocks of 1 MiB and more handed back to the kernel):
a tiny random qwen3_5 (tests/models.py, float32), one prompt of --prompt tokens and G completions of 64 tokens from
a seeded rollout_func (tests/trl_runs.py), one optimizer step (gradient_accumulation_steps 1, beta 0; CPU seconds
of trainer.train(), the generation by rollout_func included and negligible). "step peak" is
the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs just before trainer.train()) minus the
resident set at that moment: what the step itself held at its worst. TRL's own trainer concatenates the prompt and
each completion and keeps every member's graph through its loss; the transaction captures the prompt once and
replays one member at a time (exact: gradients through the prompt, as TRL's; detached: the block's default).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = (("TRL GRPOTrainer", None), ("LongStrawGRPOTrainer, exact", "exact"),
        ("LongStrawGRPOTrainer, detached (the block's default)", "detached"))


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    import torch
    from trl import GRPOTrainer

    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak
    from ds_longstraw.integrations.trl import LongStrawGRPOTrainer
    from tests import trl_runs
    from tests.models import tiny_qwen3_5

    torch.set_num_threads(1)
    vocab = 64
    model = tiny_qwen3_5(dtype=torch.float32, seed=0, vocab_size=vocab, max_position_embeddings=args.prompt + 128)
    model.config.pad_token_id, model.config.eos_token_id = trl_runs.PAD, trl_runs.EOS
    with tempfile.TemporaryDirectory() as output_dir:
        config = trl_runs.grpo_config(output_dir, per_device_train_batch_size=args.group, num_generations=args.group,
                                      gradient_accumulation_steps=1, max_completion_length=64, logging_steps=1000,
                                      disable_tqdm=True)
        trainer_class = GRPOTrainer if args.mode is None else LongStrawGRPOTrainer
        kwargs = {} if args.mode is None else {"longstraw": {"prefix_grad": args.mode}}
        trainer = trainer_class(model=model, reward_funcs=[trl_runs.reward_even_words], args=config,
                                train_dataset=trl_runs.prompts_dataset(1, args.prompt, vocab),
                                processing_class=trl_runs.tokenizer(vocab),
                                rollout_func=trl_runs.rollout_func(64, vocab), **kwargs)
        before = host_current_bytes()
        reset_host_peak()
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        peak = host_peak_bytes() - before
    print(json.dumps({"step_peak_mib": peak / 2**20, "seconds": seconds, "cpu_seconds": cpu_seconds}))


def run(mode: str | None, group: int, prompt: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--group", str(group), "--prompt", str(prompt)]
    if mode is not None:
        command += ["--mode", mode]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576",
               PYTHONWARNINGS="ignore", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--groups", default="2,8")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    groups = [int(g) for g in args.groups.split(",")]
    print(f"one optimizer step, prompt {args.prompt:,} tokens, 64-token completions, tiny qwen3_5 float32, 1 thread")
    print("| trainer | " + " | ".join(f"G = {g}: step peak MiB | CPU s | wall s" for g in groups)
          + f" | peak G = {groups[-1]} / G = {groups[0]} |")
    print("|---|" + "---:|---:|---:|" * len(groups) + "---:|")
    for label, mode in RUNS:
        rows = [run(mode, g, args.prompt) for g in groups]
        cells = " | ".join(f"{r['step_peak_mib']:,.0f} | {r['cpu_seconds']:.1f} | {r['seconds']:.1f}" for r in rows)
        ratio = rows[-1]["step_peak_mib"] / rows[0]["step_peak_mib"]
        print(f"| {label} | {cells} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
