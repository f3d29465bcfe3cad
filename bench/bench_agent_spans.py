"""Agent members: the replay phase's memory and time as the tool output inside each member grows, members replayed
whole against members in steps (member_span_capture, grpo/member_steps.py), in one run side by side.

    python bench/bench_agent_spans.py [--tools 0,8192,16384] [--modes detached,exact] [--out FILE.json]

The small qwen3_5 shape (8 layers, float32); a 4,096-token prompt; G = 4; each member 128 action tokens, L tool
tokens (response_masks False), 128 action tokens; grpo_backward's defaults otherwise. Each configuration runs in a
fresh process (one intra-op thread); memory is the kernel's high-water mark (VmHWM) over the replay phase, above
the process's resident set before the step (the phase meter resets the mark at each phase start). "pages" is what
the planner counts for one member's tool span kept in steps: its rows of every paged layer, their gradients and
the carry at each step's start (offload/plan.member_replay).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
PROMPT, GROUP, ACTION = 4096, 4, 128


def agent_group(tools, vocab_size, seed=0):
    """G members of ACTION + tools + ACTION tokens, the tool tokens masked out; rewards at random."""
    import torch

    from ds_longstraw import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (PROMPT,), generator=gen)
    length = 2 * ACTION + tools
    responses = [torch.randint(0, vocab_size, (length,), generator=gen) for _ in range(GROUP)]
    mask = torch.ones(length, dtype=torch.bool)
    mask[ACTION:ACTION + tools] = False
    return GRPOGroup(prompt, responses, rewards=torch.rand(GROUP, generator=gen), response_masks=[mask] * GROUP)


def run_one(tools, mode, path):
    """One step in this process: the replay phase's peak above the resident set before the step, and seconds."""
    import torch

    from ds_longstraw import GRPOObjective, grpo_backward
    from ds_longstraw.grpo.memory import host_current_bytes, require_host_peaks, reset_host_peak
    from ds_longstraw.models.shapes import build_named

    require_host_peaks("the benchmark")
    model = build_named("small", dtype=torch.float32, seed=0)
    group = agent_group(tools, model.config.vocab_size)
    config = {"prefix_grad": mode, "member_span_capture": None if path == "whole" else 1024}
    before = host_current_bytes()
    reset_host_peak()
    start = time.perf_counter()
    result = grpo_backward(model, group, GRPOObjective(), longstraw=config)
    seconds = time.perf_counter() - start
    return {"tools": tools, "mode": mode, "path": path, "seconds": seconds, "loss": result.loss,
            "replay_peak_bytes": result.phases["replay"].peak_bytes - before,
            "phases": {name: {"seconds": p.seconds, "peak_bytes": p.peak_bytes - before}
                       for name, p in result.phases.items()}}


def tool_pages_bytes(tools):
    """One member's tool span in steps, as the planner counts it (offload/plan.member_replay): the rows of every
    paged layer (the specs' bytes per token), their gradients, and the carry at each step's start."""
    import torch

    from ds_longstraw.models.model_shape import shape_from_config
    from ds_longstraw.models.modeling import MODELS_DIR, config_from_shape, load_shape
    from ds_longstraw.offload.plan import member_replay

    config = config_from_shape(load_shape(MODELS_DIR / "small_qwen3_5.yaml"))
    shape = shape_from_config("small", config, dtype_bytes=torch.float32.itemsize, parameters=False)
    member = member_replay(shape, ACTION, tools, 1024)
    return member["tool_rows"] + member["tool_carries"]


def run_fresh(tools, mode, path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--one", f"{tools},{mode},{path}"], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default="0,8192,16384")
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--paths", default="whole,steps",
                        help="which paths to run (the whole replay at 65,536 tool tokens takes most of an hour)")
    parser.add_argument("--whole-up-to", type=int, default=None,
                        help="run the whole path only at L up to this (the steps path at every L)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="PNG of the replay peak and step time against L")
    parser.add_argument("--from-json", default=None, help="plot and tabulate a saved run instead of running")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        tools, mode, path = args.one.split(",")
        print(json.dumps(run_one(int(tools), mode, path)))
        return
    if args.from_json:
        with open(args.from_json) as handle:
            rows = json.load(handle)
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return
    rows = []
    for mode in args.modes.split(","):
        for tools in (int(t) for t in args.tools.split(",")):
            for path in args.paths.split(","):
                if path == "whole" and args.whole_up_to is not None and tools > args.whole_up_to:
                    continue
                row = run_fresh(tools, mode, path)
                row["tool_pages_bytes"] = tool_pages_bytes(tools) if path == "steps" else 0
                rows.append(row)
                print(f"[agent_spans] {mode} L={tools} {path}: replay peak {row['replay_peak_bytes'] / MIB:.0f} MiB, "
                      f"replay {row['phases']['replay']['seconds']:.1f} s, step {row['seconds']:.1f} s, "
                      f"loss {row['loss']:.6f}", flush=True)
                if args.out:
                    with open(args.out, "w") as handle:
                        json.dump(rows, handle, indent=1)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


def plot(rows, path):
    """Replay peak and step seconds against L, whole against steps, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("detached", "-"), ("exact", "--")):
        for path_name, color in (("whole", "tab:red"), ("steps", "tab:blue")):
            points = sorted((r["tools"], r) for r in rows if r["mode"] == mode and r["path"] == path_name)
            if not points:
                continue
            tools = [t for t, _ in points]
            label = f"{mode}, {'replayed whole' if path_name == 'whole' else 'in steps'}"
            axes[0].plot(tools, [r["replay_peak_bytes"] / MIB for _, r in points], "o" + style, color=color,
                         label=label)
            axes[1].plot(tools, [r["seconds"] for _, r in points], "o" + style, color=color, label=label)
    for ax, label in ((axes[0], "replay phase peak above start (MiB)"), (axes[1], "step seconds")):
        ax.set_xlabel("tool tokens per member (L)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.suptitle("Agent members: small qwen3_5, prompt 4,096, G = 4, 128 + L + 128 tokens per member")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def table(rows):
    """The markdown table for BENCHMARKS.md: each path's replay peak beside L = 0's of the same mode."""
    base = {(r["mode"], r["path"]): r for r in rows if r["tools"] == 0}
    lines = ["| mode | L (tool tokens per member) | path | replay peak (MiB) | vs L = 0 + tool pages | replay (s) "
             "| step (s) | step vs whole |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    whole = {(r["mode"], r["tools"]): r for r in rows if r["path"] == "whole"}
    for r in rows:
        zero = base.get((r["mode"], r["path"]))
        allowed = None if zero is None else zero["replay_peak_bytes"] + r["tool_pages_bytes"]
        vs = "" if allowed is None or r["tools"] == 0 else f"{r['replay_peak_bytes'] / allowed:.2f}x"
        other = whole.get((r["mode"], r["tools"]))
        ratio = "" if other is None or r["path"] == "whole" else f"{r['seconds'] / other['seconds']:.2f}x"
        lines.append(f"| {r['mode']} | {r['tools']:,} | {r['path']} | {r['replay_peak_bytes'] / MIB:,.0f} | {vs} | "
                     f"{r['phases']['replay']['seconds']:.1f} | {r['seconds']:.1f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
