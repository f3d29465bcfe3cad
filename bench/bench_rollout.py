"""Rollouts: decode peak in G, and the on-policy step with generate's capture reused against a separate prefill.

    python bench/bench_rollout.py [--decode-prompt 16384] [--samples 8] [--decode-new 32]
                                  [--step-prompt 65536] [--step-samples 4] [--step-new 16] [--prefix-grad detached]
                                  [--out BENCHMARKS.md]

(a) decode: generate() of G samples against G = 1 from one prompt (batched decode, the default), the "small" shape
    (hidden 128, 8 layers) in float32; no eos, so every sample runs to max_new_tokens.
(b) on-policy step: generate(keep_capture=True) then grpo_backward(capture=rollouts) ("reused"), against generate()
    then grpo_backward() with its own capture ("separate prefill"); same prompt, samples and rewards.
Every configuration runs in a fresh process (so no peak hides in another's), one intra-op thread, freed blocks of
1 MiB and more handed back to the kernel (MALLOC_MMAP_THRESHOLD_). Memory is the kernel's high-water mark (VmHWM)
over the measured call(s) minus the resident set before them: generate and grpo_backward reset VmHWM at each of
their phases (memory.PhaseMeter), so the call's peak is the largest of the phases' peaks and the reading at the end.
Seconds are wall and CPU (process_time).
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MIB = 2 ** 20
CONFIG = {"capture_chunk": 1024, "page_tokens": 256, "replay_block": 256}


def _prompt(tokens, vocab):
    import torch

    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))


def _measure(fn, phases):
    """(result, figures) of fn() in this process; `phases`: a callable -> the PhaseStats fn's calls recorded (their
    peaks are absolute VmHWM readings, each since its phase began)."""
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak, return_freed_host_memory

    return_freed_host_memory("cpu")
    before = host_current_bytes()
    reset_host_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = max([host_peak_bytes()] + [stats.peak_bytes for stats in phases(result)])
    return result, {"peak_bytes": peak - before, "seconds": seconds, "cpu_seconds": cpu_seconds, "before": before}


def run_decode(prompt, samples, new_tokens):
    from ds_longstraw.grpo.memory import require_host_peaks
    from ds_longstraw.models.shapes import build_named
    from ds_longstraw.rollout.generate import generate

    require_host_peaks("bench_rollout")
    model = build_named("small")
    ids = _prompt(prompt, model.config.vocab_size)
    result, figures = _measure(lambda: generate(model, ids, samples, new_tokens, seed=0, longstraw=CONFIG),
                               lambda result: result.phases.values())
    return dict(figures, kind="decode", prompt=prompt, samples=samples, new_tokens=new_tokens,
                capture_seconds=result.phases["capture"].seconds, decode_seconds=result.phases["decode"].seconds,
                capture_peak_bytes=result.phases["capture"].peak_bytes - figures["before"],
                decode_peak_bytes=result.phases["decode"].peak_bytes - figures["before"],
                tokens=sum(r.numel() for r in result.response_ids))


def run_step(prompt, samples, new_tokens, mode, reuse):
    import torch

    from ds_longstraw.grpo.memory import require_host_peaks
    from ds_longstraw.grpo.transaction import grpo_backward
    from ds_longstraw.models.shapes import build_named
    from ds_longstraw.objective import GRPOObjective
    from ds_longstraw.rollout.generate import generate

    require_host_peaks("bench_rollout")
    model = build_named("small")
    ids = _prompt(prompt, model.config.vocab_size)
    config = dict(CONFIG, prefix_grad=mode)
    phases = {}

    def step():
        rollouts = generate(model, ids, samples, new_tokens, seed=0, longstraw=config, keep_capture=reuse)
        phases["generate"] = rollouts.phases
        rewards = torch.linspace(0.0, 1.0, samples)  # any rewards with a spread: the step's cost does not read them
        result = grpo_backward(model, rollouts.group(rewards), GRPOObjective(), longstraw=config,
                               capture=rollouts if reuse else None)
        phases["train"] = result.phases
        return result

    result, figures = _measure(step, lambda result: [stats for by_name in phases.values()
                                                     for stats in by_name.values()])
    seconds = {f"{part}_{name}": stats.seconds for part, stats_by in phases.items() for name, stats in stats_by.items()}
    return dict(figures, kind="step", prompt=prompt, samples=samples, new_tokens=new_tokens, mode=mode, reuse=reuse,
                loss=result.loss, capture_reused=result.extras["capture_reused"], phase_seconds=seconds)


def run_fresh(arguments):
    from ds_longstraw.tools.bench import fresh_json

    return fresh_json(__file__, arguments, timeout=1800)


def table(decode, step, command):
    one = decode[0]
    lines = [f"Command: `{command}`", "",
             f"(a) Decode: small shape (hidden 128, 8 layers, float32), prompt {one['prompt']:,} tokens, "
             f"{one['new_tokens']} new tokens per sample (no eos), batched decode, device tier, capture_chunk "
             f"{CONFIG['capture_chunk']}, page_tokens {CONFIG['page_tokens']}. Peak: VmHWM over the generate call "
             "minus the resident set before it (the whole call: the larger of capture's and decode's); the decode "
             "phase's own peak beside it (the captured pages, ~constant, included).", "",
             "| G | call peak (MiB) | vs G = 1 | capture peak (MiB) | decode peak (MiB) | decode vs G = 1 | "
             "capture (s) | decode (s) | CPU (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in decode:
        lines.append(f"| {row['samples']} | {row['peak_bytes'] / MIB:,.1f} | "
                     f"{row['peak_bytes'] / decode[0]['peak_bytes']:.3f} | {row['capture_peak_bytes'] / MIB:,.1f} | "
                     f"{row['decode_peak_bytes'] / MIB:,.1f} | "
                     f"{row['decode_peak_bytes'] / decode[0]['decode_peak_bytes']:.3f} | "
                     f"{row['capture_seconds']:.1f} | {row['decode_seconds']:.1f} | {row['cpu_seconds']:.1f} |")
    first = step[0]
    lines += ["", f"(b) On-policy step (generate, then grpo_backward), {first['mode']} mode: prompt "
              f"{first['prompt']:,} tokens, G = {first['samples']}, {first['new_tokens']} new tokens per sample, "
              f"replay_block {CONFIG['replay_block']}. Peak: VmHWM over the whole step minus the resident set "
              "before it.", "",
              "| training capture | step (s) | step CPU (s) | captures (s) | decode (s) | replay (s) | step peak (MiB) "
              "| vs separate | loss |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    separate = next(r for r in step if not r["reuse"])
    for row in step:
        phases = row["phase_seconds"]
        captures = phases.get("generate_capture", 0.0) + phases.get("train_capture", 0.0)
        label = "reused from generate" if row["reuse"] else "separate prefill"
        lines.append(f"| {label} | {row['seconds']:.1f} | {row['cpu_seconds']:.1f} | {captures:.1f} | "
                     f"{phases.get('generate_decode', 0.0):.1f} | {phases.get('train_replay', 0.0):.1f} | "
                     f"{row['peak_bytes'] / MIB:,.1f} | {row['cpu_seconds'] / separate['cpu_seconds']:.2f}x CPU, "
                     f"{row['seconds'] / separate['seconds']:.2f}x wall | {row['loss']:.6f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench/bench_rollout.py")
    parser.add_argument("--decode-prompt", type=int, default=16384)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--decode-new", type=int, default=32)
    parser.add_argument("--step-prompt", type=int, default=65536)
    parser.add_argument("--step-samples", type=int, default=4)
    parser.add_argument("--step-new", type=int, default=16)
    parser.add_argument("--prefix-grad", choices=("detached", "exact"), default="detached")
    parser.add_argument("--out", default=None, help="append or refresh the table's section in this markdown file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        spec = json.loads(args.one)
        kind = spec.pop("kind")
        print(json.dumps(run_decode(**spec) if kind == "decode" else run_step(**spec)))
        return
    decode = []
    for samples in (1, args.samples):
        row = run_fresh({"kind": "decode", "prompt": args.decode_prompt, "samples": samples,
                         "new_tokens": args.decode_new})
        print(f"decode G={samples}: peak {row['peak_bytes'] / MIB:,.1f} MiB, {row['seconds']:.1f} s", flush=True)
        decode.append(row)
    step = []
    for reuse in (True, False):
        row = run_fresh({"kind": "step", "prompt": args.step_prompt, "samples": args.step_samples,
                         "new_tokens": args.step_new, "mode": args.prefix_grad, "reuse": reuse})
        print(f"step reuse={reuse}: {row['seconds']:.1f} s ({row['cpu_seconds']:.1f} s CPU), peak "
              f"{row['peak_bytes'] / MIB:,.1f} MiB", flush=True)
        step.append(row)
    command = "python bench/bench_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(decode, step, command.strip())
    print(text)
    if args.out:
        from ds_longstraw.tools.bench import write_section

        write_section(args.out, "rollout", text)


if __name__ == "__main__":
    main()
