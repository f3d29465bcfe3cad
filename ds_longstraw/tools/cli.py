"""The `longstraw` command.

    longstraw demo   one GRPO step on the embedded default (a small random qwen3_5 model, a 64K-token synthetic
                     prompt, G = 4 responses; --model glm: a small random glm_moe_dsa, 8K tokens) with per-phase
                     figures and the conventional baseline beside it; --task recall: a policy that learns to read its
                     long prompt, GRPO with rollouts inside training after a short supervised warm-up
                     (ds_longstraw/tasks/recall_demo.py)
    longstraw plan   the tier planner (retained bytes per rank, what fits where)
    longstraw bench  side-by-side benchmark of ds_longstraw and the baselines (fresh process per configuration)
    longstraw export a training checkpoint as a transformers model or peft adapter directory
"""

import argparse
import contextlib
import itertools
import os
import sys

import numpy as np
import psutil

MiB = 2**20


def _fmt(value):
    return f"{value / MiB:,.1f} MiB"


# --model -> (shape, default prompt tokens). GLM's DSA selection and sparse attention run as plain torch on CPU:
# its default prompt is shorter so the demo (and its conventional baseline) stays within minutes.
MODELS = {"qwen": ("small", 65536), "glm": ("small-glm", 8192)}
TASK_DEFAULTS = {"recall": {"steps": 40, "plot": "bench/recall_task.png", "out": "runs/recall"}}


def _demo_parser(parser):
    parser.add_argument("--task", choices=["grpo", "recall"], default="grpo",
                        help="grpo: one GRPO step on synthetic groups (the default); recall: a supervised warm-up "
                             "at short prompts (built once), then GRPO at long prompts with held-out accuracy "
                             "(configs/run/recall_task.yaml, --prefix-grad picks it)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"--task recall: GRPO steps (default {TASK_DEFAULTS['recall']['steps']})")
    parser.add_argument("--eval-every", type=int, default=5, help="--task recall: steps between evaluations")
    parser.add_argument("--plot", default=None, help="--task recall: the PNG to write (default bench/recall_task.png)")
    parser.add_argument("--out", default=None, help="--task recall: where the warm-up checkpoint and the run's "
                        "results go (default runs/recall)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen",
                        help="qwen: small qwen3_5 (Gated DeltaNet + attention); "
                             "glm: small glm_moe_dsa (MLA + DSA + MoE)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 65536; 8192 for glm)")
    parser.add_argument("--group", type=int, default=4, help="G, responses in the group (default 4)")
    parser.add_argument("--response", type=int, default=256, help="longest response (default 256 tokens)")
    parser.add_argument("--prefix-grad", choices=["detached", "exact"], default="detached")
    parser.add_argument("--shape", default=None, help="a named shape of models/shapes.py (default: --model's)")
    parser.add_argument("--chunk", type=int, default=4096, help="capture_chunk")
    parser.add_argument("--baseline", choices=["auto", "measure", "estimate", "skip"], default="auto",
                        help="conventional baseline: measure it in a fresh process, estimate it from small "
                             "measured runs (1K, 2K and 4K tokens), or (auto) measure only when the estimate fits in "
                             "half the free memory")


@contextlib.contextmanager
def _threads_for_children(threads):
    """Fresh baseline processes run with this process's intra-op threads, so that their wall time compares with
    the demo's (the benchmark's fresh processes take one thread unless told otherwise)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


# The conventional baseline is estimated from runs at these prompt lengths, cheap enough for a 2-core machine. Its
# time is fitted with a quadratic term (each prompt token's attention reads every earlier token); its peak with a
# linear one (autograd keeps activations and K/V per token; the attention kernels work block by block and never
# hold [prompt, prompt] scores).
FIT_LENGTHS = (1024, 2048, 4096)
TIME_DEGREE, PEAK_DEGREE = 2, 1
TERMS = ("constant", "linear", "quadratic")


def _terms(degree):
    return " + ".join(TERMS[:degree + 1])


def fit_polynomial(xs, ys, degree) -> tuple:
    """Least-squares coefficients (constant first) of y = c_0 + c_1 x + ... + c_degree x^degree, each >= 0.

    A cost has no negative term, and the constraint matters when extrapolating: a little timing noise in the small
    runs can tilt an unconstrained quadratic term below zero, which 64x further out is a negative time. Solved
    exactly by trying every subset of the terms (at most 2^3) and keeping the best fit whose coefficients are all
    >= 0; float64, with x scaled to [0, 1] so that the columns are of one size."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if len(set(xs.tolist())) <= degree:
        raise ValueError(f"a fit with {degree + 1} terms needs at least {degree + 1} distinct lengths, "
                         f"got {sorted(set(xs.tolist()))}")
    scale = xs.max()
    columns = np.stack([(xs / scale) ** k for k in range(degree + 1)], axis=1)
    best, best_residual = np.zeros(degree + 1), float(ys @ ys)
    for support in itertools.chain.from_iterable(
            itertools.combinations(range(degree + 1), size) for size in range(1, degree + 2)):
        picked = list(support)
        coefficients = np.zeros(degree + 1)
        coefficients[picked] = np.linalg.lstsq(columns[:, picked], ys, rcond=None)[0]
        residual = float(np.sum((columns @ coefficients - ys) ** 2))
        if coefficients.min() >= 0 and residual < best_residual:
            best, best_residual = coefficients, residual
    return tuple(float(c / scale**k) for k, c in enumerate(best))


def polynomial_at(coefficients, x) -> float:
    return float(sum(c * float(x) ** k for k, c in enumerate(coefficients)))


def fit_conventional(lengths, seconds, peak_bytes) -> dict:
    """The conventional step's time (constant + linear + quadratic in the prompt) and peak (constant + linear),
    fitted to runs measured at `lengths`; "describe" says so in a few words for the verdict line."""
    if len(set(lengths)) < TIME_DEGREE + 1:
        raise ValueError(f"the conventional estimate needs at least {TIME_DEGREE + 1} distinct measured prompt "
                         f"lengths (its time has {_terms(TIME_DEGREE)} terms), got {sorted(set(lengths))}")
    if not len(lengths) == len(seconds) == len(peak_bytes):
        raise ValueError(f"one time and one peak per measured length: {len(lengths)} lengths, {len(seconds)} "
                         f"times, {len(peak_bytes)} peaks")
    return {"seconds": fit_polynomial(lengths, seconds, TIME_DEGREE),
            "peak_bytes": fit_polynomial(lengths, peak_bytes, PEAK_DEGREE),
            "describe": f"fit of {len(set(lengths))} measured lengths, {_terms(TIME_DEGREE)}"}


def _conventional_run(args, prompt):
    from ds_longstraw.tools.bench import run_fresh

    return run_fresh("conventional", prompt, args.group, args.response, shape=args.shape)


def _estimate(args):
    """The conventional figures fitted to runs at FIT_LENGTHS; None where the demo should measure instead
    (--baseline auto, and the fitted peak fits in half the free memory)."""
    lengths = ", ".join(f"{n:,}" for n in FIT_LENGTHS[:-1]) + f" and {FIT_LENGTHS[-1]:,}"
    print(f"conventional baseline: measuring at {lengths} prompt tokens (fresh processes) ...")
    runs = [_conventional_run(args, n) for n in FIT_LENGTHS]
    fit = fit_conventional(FIT_LENGTHS, [r["seconds"] for r in runs], [r["step_peak_bytes"] for r in runs])
    peak = polynomial_at(fit["peak_bytes"], args.prompt)
    fits = peak < 0.5 * psutil.virtual_memory().available
    if args.baseline == "auto" and fits:
        return None
    why = "" if fits else "; a measurement would not fit in half of this machine's free memory"
    return {"label": f"ESTIMATE, a least-squares fit of runs measured at {lengths} tokens (time: "
                     f"{_terms(TIME_DEGREE)} in the prompt; peak: {_terms(PEAK_DEGREE)}){why}",
            "estimated": True, "fit": fit["describe"], "step_peak_bytes": peak,
            "seconds": polynomial_at(fit["seconds"], args.prompt)}


def _conventional_figures(args, threads):
    """The conventional baseline's step peak and wall time at the demo's prompt: measured in a fresh process, or
    (too big, or --baseline estimate) fitted to measured smaller prompts. A prompt no longer than the fit's
    longest run is measured: that costs no more than the fit."""
    if args.baseline == "skip":
        return None
    print()
    with _threads_for_children(threads):
        if args.baseline != "measure" and args.prompt > FIT_LENGTHS[-1]:
            estimate = _estimate(args)
            if estimate is not None:
                return estimate
        print(f"conventional baseline: measuring at {args.prompt:,} prompt tokens in a fresh process ...")
        return {"label": "measured in a fresh process", "estimated": False, **_conventional_run(args, args.prompt)}


# Exact mode's extra retained state (zero, and not part of the method, in detached mode)
EXACT_ONLY = ("carry_checkpoints", "kept_attention_pages")


def _retained_rows(row, prefix_grad):
    rows = [(kind, size) for kind, size in row["retained_bytes"].items()
            if kind not in EXACT_ONLY or (prefix_grad == "exact" and size)]
    if prefix_grad == "exact":
        rows.append(("gradient_pages", row["grad_page_bytes"]))
    return rows


def summary_line(row, conv, args) -> str:
    """The verdict: ds_longstraw against the conventional baseline, as ratios (below 1: ds_longstraw smaller)."""
    head = f"ds_longstraw vs conventional, prompt {args.prompt:,} tokens, G = {args.group}"
    if conv is None:
        return f"{head}: conventional baseline skipped (--baseline skip)"
    tag = f" (conventional estimated: {conv['fit']})" if conv["estimated"] else ""
    return (f"{head}: step peak {row['step_peak_bytes'] / conv['step_peak_bytes']:.2f}x "
            f"({_fmt(row['step_peak_bytes'])} vs {_fmt(conv['step_peak_bytes'])}), "
            f"time {row['seconds'] / conv['seconds']:.2f}x ({row['seconds']:.1f} s vs {conv['seconds']:.1f} s)"
            f"{tag}")


def demo(args):
    if args.task in TASK_DEFAULTS:
        for key, value in TASK_DEFAULTS[args.task].items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        from ds_longstraw.tasks.recall_demo import run

        return run(args)
    import torch

    from ds_longstraw.kernels.dispatch import describe_paths, reset_paths_taken
    from ds_longstraw.tools.bench import run_one

    shape, prompt = MODELS[args.model]
    args.shape = args.shape or shape
    args.prompt = args.prompt or prompt
    threads = torch.get_num_threads()
    print(f"ds_longstraw demo: {args.shape} model (random weights), prompt {args.prompt:,} tokens, "
          f"G = {args.group}, responses up to {args.response} tokens, prefix_grad = {args.prefix_grad}, "
          f"{threads} threads")
    reset_paths_taken()
    row = run_one(f"longstraw-{args.prefix_grad}", args.prompt, args.group, args.response, args.shape, args.chunk,
                  progress=True)
    print(f"\nGRPO step done: loss {row['loss']:.6f}, wall {row['seconds']:.1f} s")
    print(f"  {describe_paths()}")
    print(f"\n  {'phase':<10} {'seconds':>8}   {'peak':>12}   (process high-water mark)")
    for name, phase in row["phases"].items():
        print(f"  {name:<10} {phase['seconds']:8.2f}   {_fmt(phase['peak_bytes']):>12}")
    print(f"  step peak above the pre-step resident set: {_fmt(row['step_peak_bytes'])}")
    print("\nretained prompt state by layer type:")
    rows = _retained_rows(row, args.prefix_grad)
    width = max(len(kind) for kind, _ in rows)
    for kind, size in rows:
        print(f"  {kind:<{width}}  {_fmt(size):>12}")
    conv = _conventional_figures(args, threads)
    if conv is not None:
        print(f"\nconventional baseline: {conv['label']}")
        print(f"  step peak {_fmt(conv['step_peak_bytes'])}, wall {conv['seconds']:.1f} s"
              + (" (estimated)" if conv["estimated"] else ""))
    print("\n" + summary_line(row, conv, args))


def main(argv=None):
    from ds_longstraw.tools.console import hide_third_party_notices

    hide_third_party_notices()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plan":
        from ds_longstraw.tools import planner

        return planner.main(argv[1:])
    if argv and argv[0] == "bench":
        from ds_longstraw.tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "export":
        from ds_longstraw.engine.export import main as export_main

        return export_main(argv[1:])
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub.add_parser("demo", help="one GRPO step on the embedded default"))
    sub.add_parser("plan", help="tier planner (longstraw plan --help)")
    sub.add_parser("bench", help="benchmarks (longstraw bench --help)")
    sub.add_parser("export", help="checkpoint -> transformers / peft directory (longstraw export --help)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args)


if __name__ == "__main__":
    # main's return is the exit status (longstraw plan's 2 on a bad model, say), as the console script passes it on
    raise SystemExit(main())
