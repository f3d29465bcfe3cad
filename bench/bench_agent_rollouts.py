"""Multi-turn rollouts: peak and decode speed of G samples that take turns with an environment, against one turn.

    python bench/bench_agent_rollouts.py [--prompt 16384] [--samples 4] [--turns 4] [--observation 8192]
                                         [--out bench/results/agent_rollouts.json]

Three configurations, each in a fresh process (the small shape, float32, one intra-op thread, freed blocks of 1 MiB
and more handed back to the kernel), generate's defaults (batched decode, device tier):
  one turn        the prompt, G samples of `--actions` tokens each (no environment, no eos);
  turns           the prompt, G samples that take `--turns` turns with an environment whose observations are
                  `--observation` tokens; a sixteenth of the vocabulary ends an action (actions of ~16 tokens at
                  temperature 1), a stop id past the last turn ends the sample;
  one turn, long  the prompt plus the turns' observations as one prompt (the context the last turn decodes at),
                  G samples of `--actions` tokens.
Peak: the kernel's high-water mark (VmHWM) over the generate call minus the resident set before it. The allowance
for the turns is the one-turn peak plus the observations' pages: the rows of every paged layer for every
observation token of every sample (the state spec's bytes per token), which the samples keep to attend to.
Decode speed: action tokens per second of decoding, the observations' forwards taken out (Rollouts.phases
"observations"); the turns decode at contexts from the prompt's to the long prompt's, so both one-turn speeds are
reported beside them. With G samples the long prompt's keys are read once per step for all of them, while each
sample's observations are its own (G times the keys): the configurations run again at G = 1, where the two read the
same keys per step.
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


def run_one(kind, prompt, samples, turns, observation, actions):
    import torch

    from ds_longstraw.arch import adapter_for
    from ds_longstraw.grpo.memory import (
        host_current_bytes,
        host_peak_bytes,
        require_host_peaks,
        reset_host_peak,
        return_freed_host_memory,
    )
    from ds_longstraw.models.shapes import build_named
    from ds_longstraw.rollout.generate import generate

    require_host_peaks("bench_agent_rollouts")
    model = build_named("small")
    vocab = model.config.vocab_size
    length = prompt + (turns * observation if kind == "one_turn_long" else 0)
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0))
    kwargs = dict(seed=0, longstraw=CONFIG)
    if kind == "turns":
        # every turn's action (~16 tokens, at most 4x that) and observation, and a last action that ends it
        new_tokens = turns * (observation + 4 * 16) + 4 * 16
        kwargs.update(environment=FixedObservations(vocab, observation), max_turns=turns)
    else:
        new_tokens = actions
    return_freed_host_memory("cpu")
    before = host_current_bytes()
    reset_host_peak()
    start = time.perf_counter()
    result = generate(model, ids, samples, new_tokens, **kwargs)
    seconds = time.perf_counter() - start
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
            "observation_pages_bytes": observed * per_token}


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
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_one(**json.loads(args.one))))
        return
    rows = []
    for samples in (args.samples, 1):
        for kind in ("one_turn", "turns", "one_turn_long"):
            row = run_fresh(dict(kind=kind, prompt=args.prompt, samples=samples, turns=args.turns,
                                 observation=args.observation, actions=args.actions))
            print(f"{kind} G={samples}: peak {row['peak_bytes'] / MIB:,.1f} MiB, {row['seconds']:.1f} s, decode "
                  f"{row['action_tokens_per_second']:.2f} action tokens/s, turns {row['turns']}", flush=True)
            rows.append(row)
    summary = {}
    for first in (0, 3):  # G = --samples, then G = 1 (each sample's context its own in both: the same keys read)
        one, turns, long = rows[first: first + 3]
        summary[f"G={one['samples']}"] = {
            "peak_vs_allowance": turns["peak_bytes"] / (one["peak_bytes"] + turns["observation_pages_bytes"]),
            "excess_over_pages": (turns["peak_bytes"] - one["peak_bytes"]) / turns["observation_pages_bytes"],
            "speed_vs_one_turn": turns["action_tokens_per_second"] / one["action_tokens_per_second"],
            "speed_vs_one_turn_long": turns["action_tokens_per_second"] / long["action_tokens_per_second"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        command = "python bench/bench_agent_rollouts.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.out, "w") as handle:
            json.dump({"command": command.strip(), "rows": rows, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
