"""Exact mode's prefix pass: step time and peak memory against prefix_block, with and without the per-layer
recompute, beside the detached step of the same group (each configuration in a fresh process).

    python bench/bench_prefix_block.py [--prompt 8192] [--group 8] [--blocks 128,256,512,1024,4096]
                                       [--out BENCHMARKS.md] [--plot bench/exact_prefix_block.png]

The goal the rows are read against: exact step peak <= detached step peak + gradient pages.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ds_longstraw.tools.bench import run_fresh, write_section  # noqa: E402

MIB = 2 ** 20


def measure(prompt, group, response, blocks):
    detached = run_fresh("longstraw-detached", prompt, group, response)
    print(f"detached: {detached['cpu_seconds']:.1f} s CPU, step peak {detached['step_peak_bytes'] / MIB:.0f} MiB",
          flush=True)
    rows = []
    for recompute in ("off", "on"):
        for block in blocks:
            row = run_fresh("longstraw-exact", prompt, group, response, prefix_block=block,
                            prefix_recompute=recompute)
            row.update(prefix_block=block, prefix_recompute=recompute)
            print(f"exact prefix_block={block} recompute={recompute}: {row['cpu_seconds']:.1f} s CPU, step peak "
                  f"{row['step_peak_bytes'] / MIB:.0f} MiB", flush=True)
            rows.append(row)
    return detached, rows


def table(detached, rows, command):
    budget = detached["step_peak_bytes"] + rows[0]["grad_page_bytes"]
    lines = [f"Command: `{command}`", "",
             f"Detached: {detached['cpu_seconds']:.2f} s CPU, step peak {detached['step_peak_bytes'] / MIB:.0f} MiB; "
             f"gradient pages {rows[0]['grad_page_bytes'] / MIB:.0f} MiB, so the memory goal is "
             f"{budget / MIB:.0f} MiB.", "",
             "| prefix_block | recompute | step CPU time (s) | exact / detached time | step peak (MiB) | within goal |",
             "|---:|---|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['prefix_block']} | {row['prefix_recompute']} | {row['cpu_seconds']:.2f} | "
                     f"{row['cpu_seconds'] / detached['cpu_seconds']:.2f}x | {row['step_peak_bytes'] / MIB:.0f} | "
                     f"{'yes' if row['step_peak_bytes'] <= budget else 'no'} |")
    return "\n".join(lines)


def plot(detached, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recompute, marker in (("off", "o"), ("on", "s")):
        pts = [(r["cpu_seconds"] / detached["cpu_seconds"], r["step_peak_bytes"] / MIB, r["prefix_block"])
               for r in rows if r["prefix_recompute"] == recompute]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"recompute {recompute}")
        for x, y, block in pts:
            ax.annotate(str(block), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    budget = (detached["step_peak_bytes"] + rows[0]["grad_page_bytes"]) / MIB
    ax.axhline(budget, color="grey", linestyle="--", label="detached peak + gradient pages")
    ax.set_xlabel("exact step time / detached step time (CPU seconds)")
    ax.set_ylabel("exact step peak (MiB)")
    ax.set_title(f"prefix_block trade-off (prompt {rows[0]['prompt']}, G = {rows[0]['group']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench/bench_prefix_block.py")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--blocks", default="128,256,512,1024,4096")
    parser.add_argument("--out", default=None, help="markdown file whose exact-prefix-block section is rewritten")
    parser.add_argument("--plot", default=None, help="PNG of the trade-off")
    args = parser.parse_args(argv)
    blocks = [int(x) for x in args.blocks.split(",")]
    detached, rows = measure(args.prompt, args.group, args.response, blocks)
    command = "python bench/bench_prefix_block.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(detached, rows, command)
    print(text)
    if args.out:
        write_section(args.out, "exact-prefix-block", text)
    if args.plot:
        plot(detached, rows, args.plot)


if __name__ == "__main__":
    main()
