"""Replay's peak memory with vocabulary-chunked log-probs against full [block, vocab] logits, side by side.

    python bench/bench_logprobs.py [--vocabs 8192,65536,248320] [--prompt 1024] [--group 2] [--response 1024]
                                   [--head trained|frozen] [--entropy] [--out BENCHMARKS.md]

One detached grpo_backward of the "small" shape (hidden 128) with its vocabulary set to each size, every
configuration in a fresh process (so no peak hides in another's). "chunked" is the default log-prob path
(ds_longstraw.kernels.chunked_logprobs, VOCAB_CHUNK ids at a time); "reference" forces the plain path
(CausalLMAdapter.logprobs_vocab_chunk = None: full logits, log_softmax, gather). Memory is the kernel's
high-water mark (VmHWM, reset at the step and at each phase start) minus the resident memory just before the step:
weights, interpreter and libraries are excluded, the gradients the step creates (the LM head's d(weight) among
them, the same in both paths) are not.

--head frozen: the LM head's weight has no gradient (a LoRA run, or any run that trains the body only); then the
chunked forward also computes d log p / d hidden and its backward recomputes no logits.

--entropy: the step with an entropy bonus (GRPOObjective(entropy_coef=0.01)) beside the step without it, both on the
chunked path (the entropy from the same chunked pass: ds_longstraw.kernels.chunked_logprobs_entropy), and the
entropy through full logits ("reference-entropy").
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MIB = 2 ** 20
MODES = ("chunked", "reference")
# With a frozen head, also the chunked path without the forward's d(hidden) direction (its backward recomputes
# the logits, as with a trained head): the side-by-side figure for what the direction saves.
FROZEN_MODES = MODES + ("recompute",)
ENTROPY_MODES = ("chunked", "chunked-entropy", "reference-entropy")
ENTROPY_COEF = 0.01


def run_one(vocab, mode, prompt, group_size, response, head="trained", replay_block=1024, seed=0):
    import torch

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, require_host_peaks, reset_host_peak
    from ds_longstraw.grpo.transaction import grpo_backward
    from ds_longstraw.kernels import VOCAB_CHUNK
    from ds_longstraw.models.shapes import build_named, synthetic_group
    from ds_longstraw.objective import GRPOObjective

    require_host_peaks("bench_logprobs")
    CausalLMAdapter.logprobs_vocab_chunk = None if mode.startswith("reference") else VOCAB_CHUNK
    objective = GRPOObjective(entropy_coef=ENTROPY_COEF if mode.endswith("-entropy") else 0.0)
    if mode == "recompute":
        from ds_longstraw.kernels.logprobs import chunked as logprobs

        logprobs._frozen_head = lambda *tensors: False
    model = build_named("small", dtype=torch.float32, seed=seed, vocab_size=vocab)
    model.lm_head.weight.requires_grad_(head == "trained")
    group = synthetic_group(prompt, group_size, response, vocab, seed=seed)
    config = {"prefix_grad": "detached", "capture_chunk": 4096, "replay_block": replay_block}
    before = host_current_bytes()
    reset_host_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = grpo_backward(model, group, objective, longstraw=config)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = max([host_peak_bytes()] + [p.peak_bytes for p in result.phases.values()])
    return {"vocab": vocab, "mode": mode, "prompt": prompt, "group": group_size, "response": response,
            "replay_block": replay_block, "head": head, "vocab_chunk": CausalLMAdapter.logprobs_vocab_chunk,
            "seconds": seconds, "cpu_seconds": cpu_seconds, "step_peak_bytes": peak - before,
            "replay_peak_bytes": result.phases["replay"].peak_bytes - before, "loss": result.loss,
            "logprob_sum": float(sum(lp.sum() for lp in result.logprobs))}


def run_fresh(vocab, mode, args):
    command = [sys.executable, os.path.abspath(__file__), "--one", "--vocabs", str(vocab), "--mode", mode,
               "--prompt", str(args.prompt), "--group", str(args.group), "--response", str(args.response),
               "--head", args.head]
    # One intra-op thread: CPU seconds then measure the work whatever else the machine runs; freed blocks of 1 MiB
    # and more go back to the kernel at once, so the high-water mark follows live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows, command):
    first = next(r for r in rows if r["mode"] == "chunked")
    lines = [f"Command: `{command}`", "",
             f"Small shape (hidden 128, 8 layers), detached, prompt {first['prompt']}, G = {first['group']}, "
             f"responses of {first['response'] // 2}..{first['response']} tokens, replay_block "
             f"{first['replay_block']}; chunked = {first['vocab_chunk']} ids per chunk; LM head {first['head']}. One "
             "block's float32 logits: min(replay_block, longest response) x vocab x 4 bytes (the plain path holds "
             "several such tensors at once). Peaks exclude the resident memory before the step"
             + ("; the head's d(weight) (vocab x 128 x 4 bytes) is in both." if first["head"] == "trained" else "."),
             "",
             "| vocab | one block's logits (MiB) | reference step peak (MiB) | chunked step peak (MiB) | "
             "reference replay peak (MiB) | chunked replay peak (MiB) | reference CPU (s) | chunked CPU (s) | "
             + ("chunked, backward recomputing (s) | " if first["head"] == "frozen" else "") + "loss equal |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if first["head"] == "frozen" else "") + "---|"]
    by = {(r["vocab"], r["mode"]): r for r in rows}
    for vocab in sorted({r["vocab"] for r in rows}):
        ref, chk = by[(vocab, "reference")], by[(vocab, "chunked")]
        same = abs(ref["loss"] - chk["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"]))
        block = min(ref["replay_block"], ref["response"])
        cells = [f"{vocab:,}", f"{block * vocab * 4 / MIB:,.0f}"]
        cells += [f"{r[key] / MIB:,.0f}" for key in ("step_peak_bytes", "replay_peak_bytes") for r in (ref, chk)]
        cells += [f"{ref['cpu_seconds']:.1f}", f"{chk['cpu_seconds']:.1f}"]
        if (vocab, "recompute") in by:
            cells.append(f"{by[(vocab, 'recompute')]['cpu_seconds']:.1f}")
        cells.append("yes" if same else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def entropy_table(rows, command):
    first = rows[0]
    lines = [f"Command: `{command}`", "",
             f"Small shape (hidden 128, 8 layers), detached, prompt {first['prompt']}, G = {first['group']}, "
             f"responses of {first['response'] // 2}..{first['response']} tokens, replay_block "
             f"{first['replay_block']}, LM head trained; entropy_coef {ENTROPY_COEF}. Peaks exclude the resident "
             "memory before the step. One thread, fresh process per cell.", "",
             "| vocab | step peak, no entropy (MiB) | step peak, entropy chunked (MiB) | peak ratio | "
             "step peak, entropy through full logits (MiB) | CPU, no entropy (s) | CPU, entropy chunked (s) | "
             "CPU ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["vocab"], r["mode"]): r for r in rows}
    for vocab in sorted({r["vocab"] for r in rows}):
        plain, ent, full = (by[(vocab, m)] for m in ENTROPY_MODES)
        lines.append(f"| {vocab:,} | {plain['step_peak_bytes'] / MIB:,.0f} | {ent['step_peak_bytes'] / MIB:,.0f} | "
                     f"{ent['step_peak_bytes'] / plain['step_peak_bytes']:.2f} | "
                     f"{full['step_peak_bytes'] / MIB:,.0f} | {plain['cpu_seconds']:.1f} | {ent['cpu_seconds']:.1f} | "
                     f"{ent['cpu_seconds'] / plain['cpu_seconds']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench/bench_logprobs.py")
    parser.add_argument("--vocabs", default="8192,65536,248320")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--head", choices=("trained", "frozen"), default="trained",
                        help="whether the LM head's weight takes a gradient")
    parser.add_argument("--entropy", action="store_true", help="the step with an entropy bonus beside it without")
    parser.add_argument("--out", default=None, help="append or refresh the table's section in this markdown file")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=FROZEN_MODES + ENTROPY_MODES[1:], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    if args.one:
        print(json.dumps(run_one(vocabs[0], args.mode, args.prompt, args.group, args.response, args.head)))
        return
    rows = []
    for vocab in vocabs:
        for mode in ENTROPY_MODES if args.entropy else MODES if args.head == "trained" else FROZEN_MODES:
            row = run_fresh(vocab, mode, args)
            print(f"vocab {vocab} {mode}: step peak {row['step_peak_bytes'] / MIB:,.0f} MiB, replay peak "
                  f"{row['replay_peak_bytes'] / MIB:,.0f} MiB, {row['cpu_seconds']:.1f} s CPU", flush=True)
            rows.append(row)
    command = "python bench/bench_logprobs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (entropy_table if args.entropy else table)(rows, command.strip())
    print(text)
    if args.out:
        from ds_longstraw.tools.bench import write_section

        section = "logprobs-entropy" if args.entropy else "logprobs" if args.head == "trained" else \
            "logprobs-frozen-head"
        write_section(args.out, section, text)


if __name__ == "__main__":
    main()
