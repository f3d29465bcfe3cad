"""Multi-turn rollouts: peak and decode speed of G samples that take turns with an environment, against one turn.

    python bench/bench_agent_rollouts.py [--prompt 16384] [--samples 4] [--turns 4] [--observation 8192]
                                         [--out bench/results/agent_rollouts.json] [--plot bench/agent_decode_steps.png]

The configurations, each in a fresh process (the small shape, float32, one intra-op thread, freed blocks of 1 MiB
and more handed back to the kernel), generate's defaults (batched decode, device tier):
  one turn        the prompt, G samples of `--actions` tokens each (no environment, no eos);
  turns           the prompt, G samples that take `--turns` turns with an environment whose observations are
                  `--observation` tokens; a sixteenth of the vocabulary ends an action (actions of ~16 tokens at
                  temperature 1), a stop id past the last turn ends the sample;
  one turn, long  the prompt plus the turns' observations as one prompt (the context the last turn decodes at),
                  G samples of `--actions` tokens;
  one turn at k   (G = --samples only) the prompt plus k observations as one prompt, k = 1 .. turns - 1: with the
                  two above, one-turn step times at every context a turn starts at.
Peak: the kernel's high-water mark (VmHWM) over the generate call minus the resident set before it. The allowance
for the turns is the one-turn peak plus the observations' pages: the rows of every paged layer for every
observation token of every sample (the state spec's bytes per token), which the samples keep to attend to.
Decode speed: action tokens per second of decoding, the observations' forwards taken out (Rollouts.phases
"observations"); the turns decode at contexts from the prompt's to the long prompt's, so both one-turn speeds are
reported beside them. A batch decodes one token per running sample per step, so its tokens per second fall as its
samples end at different steps (the turns' actions end at random), whatever the speed of a step: Rollouts.
decode_steps times every step with the samples it decoded, so the speed is also reported over the steps at a full
batch (all G samples decoding), and over those at the long prompt's context or beyond (the last action of some
sample), and against one turn at the same context: each full-batch step's CPU time beside the one-turn step's at
its context (linear between the one-turn runs' contexts, one per turn: a one-turn step reads the prompt's keys once
for every sample). The control "one turn, long, ragged" is the long one-turn rollout whose samples end at a stop id
(the turns' stop ids as eos ids), so that its batch empties at random too. With G samples the long prompt's keys
are read once per step for all of them, while each sample's observations are its own (G times the keys): the
configurations run again at G = 1, where the two read the same keys per step.
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
CONFIG = {"capture_chunk": 1024, "page_tokens": 256}


class FixedObservations:
    """Answers every tool call with `length` tokens (a function of the sample and its response so far), for `turns`
    turns; a sixteenth of the vocabulary are stop ids."""

    def __init__(self, vocab, length):
        self.vocab, self.length = vocab, length
        self.stop_ids = tuple(range(0, vocab, 16))

    def observe(self, sample, response_ids):
        import torch

        seed = int(response_ids.sum()) * 31 + sample
        return torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(seed))


def run_one(kind, prompt, samples, turns, observation, actions, context_turns=None):
    """One configuration on the small shape on the CPU, its peak the kernel's high-water mark."""
    from ds_longstraw.grpo.memory import require_host_peaks
    from ds_longstraw.models.shapes import build_named

    require_host_peaks("bench_agent_rollouts")
    return measure(build_named("small"), kind, prompt, samples, turns, observation, actions, context_turns)


def measure(model, kind, prompt, samples, turns, observation, actions, context_turns=None, longstraw=None):
    """One configuration's row on `model` (on any device: on CUDA the peak is the allocator's): its peak above the
    memory before it, its phases, its decode speeds and each decode step."""
    import torch

    from ds_longstraw.arch import adapter_for
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak, return_freed_host_memory
    from ds_longstraw.rollout.generate import generate

    vocab = model.config.vocab_size
    long_context = prompt + turns * observation
    length = long_context if kind.startswith("one_turn_long") else prompt + (context_turns or 0) * observation
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0))
    kwargs = dict(seed=0, longstraw=longstraw or CONFIG)
    if kind == "turns":
        # every turn's action (~16 tokens, at most 4x that) and observation, and a last action that ends it
        new_tokens = turns * (observation + 4 * 16) + 4 * 16
        kwargs.update(environment=FixedObservations(vocab, observation), max_turns=turns)
    else:
        new_tokens = actions
    if kind == "one_turn_long_ragged":
        kwargs.update(eos_token_id=list(FixedObservations(vocab, observation).stop_ids))
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        return_freed_host_memory("cpu")
        before = host_current_bytes()
        reset_host_peak()
    start = time.perf_counter()
    result = generate(model, ids, samples, new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = max([host_peak_bytes()] + [s.peak_bytes for s in result.phases.values() if s.peak_measured])
    decode = result.phases["decode"].seconds
    observing = result.phases["observations"].seconds if "observations" in result.phases else 0.0
    masks = result.response_masks or [torch.ones(r.numel(), dtype=torch.bool) for r in result.response_ids]
    action_tokens = sum(int(m.sum()) for m in masks)
    observed = sum(int((~m).sum()) for m in masks)
    per_token = sum(spec.bytes_per_token for spec in adapter_for(model).specs if spec.bytes_per_token)
    return {"kind": kind, "prompt": length, "samples": samples, "peak_bytes": peak - before, "seconds": seconds,
            "capture_seconds": result.phases["capture"].seconds, "decode_seconds": decode,
            "observation_seconds": observing, "action_tokens": action_tokens, "observation_tokens": observed,
            "turns": result.turns, "action_tokens_per_second": action_tokens / (decode - observing),
            "steps_per_second": max(int(m.sum()) for m in masks) / (decode - observing),
            "observation_pages_bytes": observed * per_token, **_step_speeds(result.decode_steps, samples, long_context),
            "steps": [[step.samples, step.context, step.seconds, step.cpu_seconds] for step in result.decode_steps]}


def _step_speeds(steps, samples, long_context):
    """Tokens per second over the steps of a full batch, and over those at the long prompt's context or beyond, per
    second of wall time and per second of CPU time (the process's: what a step cost where other work shares the
    cores); seconds per step by the samples it decoded."""
    def speed(chosen, clock="seconds"):
        seconds = sum(getattr(step, clock) for step in chosen)
        return sum(step.samples for step in chosen) / seconds if chosen else None

    full = [step for step in steps if step.samples == samples]
    late = [step for step in full if step.context >= long_context]
    by_batch = {}
    for step in steps:
        count, seconds = by_batch.get(step.samples, (0, 0.0))
        by_batch[step.samples] = (count + 1, seconds + step.seconds)
    return {"full_batch_steps": len(full), "full_batch_tokens_per_second": speed(full),
            "late_full_batch_steps": len(late), "late_full_batch_tokens_per_second": speed(late),
            "all_tokens_per_cpu_second": speed(steps, "cpu_seconds"),
            "full_batch_tokens_per_cpu_second": speed(full, "cpu_seconds"),
            "late_full_batch_tokens_per_cpu_second": speed(late, "cpu_seconds"),
            "step_seconds_by_batch": {str(n): seconds / count for n, (count, seconds) in sorted(by_batch.items())}}


def _summary(one, turns, long, ragged, references):
    """The turns' peak against the one-turn peak plus the observations' pages, and their decode speed against the
    one-turn rollouts': overall, at a full batch, at a full batch past the long prompt's context, and at a full
    batch against one turn at the same context (`references`: one-turn rows at increasing contexts)."""
    out = {
        "peak_vs_allowance": turns["peak_bytes"] / (one["peak_bytes"] + turns["observation_pages_bytes"]),
        "excess_over_pages": (turns["peak_bytes"] - one["peak_bytes"]) / turns["observation_pages_bytes"],
        "speed_vs_one_turn": turns["action_tokens_per_second"] / one["action_tokens_per_second"],
        "speed_vs_one_turn_long": turns["action_tokens_per_second"] / long["action_tokens_per_second"],
        "ragged_long_speed_vs_one_turn_long": ragged["action_tokens_per_second"] / long["action_tokens_per_second"]}
    for name in ("all", "full_batch", "late_full_batch"):  # per CPU second: what a step cost on shared cores
        mine = turns[f"{name}_tokens_per_cpu_second"]
        out[f"{name}_cpu_speed_vs_one_turn_long"] = None if mine is None else mine / long[
            f"{name}_tokens_per_cpu_second"]
    out["full_batch_cpu_speed_vs_one_turn_at_same_context"] = matched_speed(turns, references)
    return out


CPU_CLOCK, WALL_CLOCK = 3, 2  # a step's columns in a row's "steps": samples, context, seconds, CPU seconds


def _one_turn_step(row, clock=CPU_CLOCK):
    """(context, seconds per step on `clock`) of a one-turn row: the mean over its steps (all at a full batch,
    within --actions tokens of its prompt's context)."""
    steps = row["steps"]
    return sum(step[1] for step in steps) / len(steps), sum(step[clock] for step in steps) / len(steps)


def matched_speed(turns, references, clock=CPU_CLOCK):
    """The turns' full-batch steps' time on `clock` against the one-turn step's at each one's context: the sum of
    the one-turn times (linear between the references' contexts) over the sum of the turns' times."""
    import numpy as np

    points = sorted(_one_turn_step(row, clock) for row in references)
    full = [step for step in turns["steps"] if step[0] == turns["samples"]]
    if not full:
        return None
    reference = np.interp([step[1] for step in full], [p[0] for p in points], [p[1] for p in points])
    return float(reference.sum()) / sum(step[clock] for step in full)


def _plot(rows, samples, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = next(row for row in rows if row["kind"] == "turns" and row["samples"] == samples)
    references = sorted(_one_turn_step(row) for row in rows if row["kind"] in ("one_turn", "one_turn_long")
                        and row["samples"] == samples)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for count in sorted({step[0] for step in turns["steps"]}, reverse=True):
        mine = [step for step in turns["steps"] if step[0] == count]
        ax.scatter([step[1] / 1024 for step in mine], [1000 * step[3] for step in mine], s=12,
                   label=f"turns: a step of {count} sample{'s' if count > 1 else ''}")
    ax.plot([p[0] / 1024 for p in references], [1000 * p[1] for p in references], "k-o",
            label=f"one turn, {samples} samples, at that context")
    ax.set_xlabel("context of the step's longest sample (K tokens)")
    ax.set_ylabel("CPU ms per decode step")
    ax.set_title(f"Decode steps of G = {samples} samples taking turns, against one turn at the same context")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_fresh(arguments):
    from ds_longstraw.tools.bench import fresh_json

    return fresh_json(__file__, arguments, timeout=3600)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench/bench_agent_rollouts.py")
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--observation", type=int, default=8192)
    parser.add_argument("--actions", type=int, default=64, help="tokens per sample of the one-turn rollouts")
    parser.add_argument("--out", default=None, help="the rows as JSON")
    parser.add_argument("--no-single", action="store_true", help="skip the G = 1 configurations")
    parser.add_argument("--plot", default=None, help="each decode step's CPU time against its context (PNG)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_one(**json.loads(args.one))))
        return
    rows = []

    def run(kind, samples, context_turns=None):
        row = run_fresh(dict(kind=kind, prompt=args.prompt, samples=samples, turns=args.turns,
                             observation=args.observation, actions=args.actions, context_turns=context_turns))
        full = row["full_batch_tokens_per_second"]
        print(f"{kind}{'' if context_turns is None else f' at {context_turns}'} G={samples}: context "
              f"{row['prompt']:,}, peak {row['peak_bytes'] / MIB:,.1f} MiB, {row['seconds']:.1f} s, decode "
              f"{row['action_tokens_per_second']:.2f} action tokens/s ({full:.2f} at a full batch), turns "
              f"{row['turns']}", flush=True)
        rows.append(row)
        return row

    summary = {}
    # G = 1: each sample's context its own in both, the same keys read
    for samples in (args.samples,) if args.no_single else (args.samples, 1):
        one, turns, long = run("one_turn", samples), run("turns", samples), run("one_turn_long", samples)
        between = [run("one_turn", samples, k) for k in range(1, args.turns)] if samples > 1 else []
        ragged = run("one_turn_long_ragged", samples)
        summary[f"G={samples}"] = _summary(one, turns, long, ragged, [one, *between, long])
    print(json.dumps(summary, indent=1))
    if args.plot:
        _plot(rows, args.samples, args.plot)
    if args.out:
        command = "python bench/bench_agent_rollouts.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.out, "w") as handle:
            json.dump({"command": command.strip(), "rows": rows, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
