"""Plot: GLM's exact step with the capture's graph kept (prefix_keep_graph "fits") beside the default step, which
keeps none, conventional full autograd and the detached step: the median CPU seconds of each and its step peak,
at 8K and 32K tokens, from bench/results/grpo-glm-kept-graph-46.json (BENCHMARKS.md, "The capture's graph kept").

    python bench/plot_kept_graph.py [--results bench/results/grpo-glm-kept-graph-46.json]
                                    [--out bench/kept_graph.png]
"""

import argparse
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {"longstraw-exact-graph": "exact, graph kept (\"fits\")", "longstraw-exact": "exact (default)",
           "conventional": "conventional autograd", "longstraw-detached": "detached"}


def medians(rows):
    """{prompt: {method: (median seconds, median step peak MiB)}} over the rounds."""
    seen = {}
    for row in rows:
        seen.setdefault(row["prompt"], {}).setdefault(row["method"], []).append(row)
    return {prompt: {method: (statistics.median(r["seconds"] for r in runs),
                              statistics.median(r["step_peak_bytes"] for r in runs) / 2**20)
                     for method, runs in by_method.items()}
            for prompt, by_method in seen.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "grpo-glm-kept-graph-46.json"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "kept_graph.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as handle:
        figures = medians(json.load(handle))
    prompts = sorted(figures)
    fig, axes = plt.subplots(2, len(prompts), figsize=(6 * len(prompts), 7), squeeze=False)
    for column, prompt in enumerate(prompts):
        shown = [m for m in METHODS if m in figures[prompt]]
        labels = [METHODS[m] for m in shown]
        for row, (index, unit) in enumerate(((0, "CPU seconds (median)"), (1, "step peak, MiB (median)"))):
            ax = axes[row][column]
            values = [figures[prompt][m][index] for m in shown]
            bars = ax.barh(labels, values, color=["tab:green", "tab:olive", "tab:gray", "tab:blue"][:len(shown)])
            ax.bar_label(bars, fmt="%.1f" if index == 0 else "%.0f", padding=2)
            ax.set_xlabel(unit)
            ax.invert_yaxis()
            if row == 0:
                ax.set_title(f"small glm_moe_dsa, {prompt:,} tokens, G = 8", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
