"""Plot the GRPO benchmark rows (JSON written by `python -m ds_longstraw.tools.bench grid --out ...`).

    python bench/plot_grpo.py bench/results/grpo-8k.json bench/results/grpo-32k.json --out bench/grpo.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ds_longstraw.tools.bench import METHODS  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [row for path in args.rows for row in json.load(open(path)) if "skipped" not in row]
    groups = sorted({row["group"] for row in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(5.5 * len(groups), 8), squeeze=False)
    for column, group in enumerate(groups):
        for method in METHODS:
            points = sorted((r["prompt"], r["step_peak_bytes"] / 2**20, r["cpu_seconds"]) for r in rows
                            if r["method"] == method and r["group"] == group)
            if not points:
                continue
            prompts = [p for p, _, _ in points]
            axes[0][column].plot(prompts, [m for _, m, _ in points], marker="o", label=method)
            axes[1][column].plot(prompts, [s for _, _, s in points], marker="o", label=method)
        for row, label in ((0, "step peak memory (MiB)"), (1, "step CPU seconds")):
            ax = axes[row][column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.set_title(f"G = {group}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("GRPO step, small qwen3_5 model, CPU (fresh process per point)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
