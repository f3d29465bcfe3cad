"""Plot: a replayed block's sparse attention backward with its prompt-page gradients, dense against by rows, over the
prompt's length, at the small GLM shape's row width and at GLM-5.2's, from bench/bench_sparse_row_grads.py's rows
(BENCHMARKS.md, "The prompt pages' gradients by rows").

    python bench/plot_sparse_row_grads.py [--results bench/results/sparse-row-grads.json
                                           bench/results/sparse-row-grads-glm52-width.json]
                                          [--out bench/sparse_row_grads.png]
"""

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = [os.path.join(ROOT, "bench", "results", name)
           for name in ("sparse-row-grads.json", "sparse-row-grads-glm52-width.json")]


def _title(rows):
    first = rows[0]
    return (f"R + E = {first['rank'] + first['rope']}, {first['queries']} queries x top-{first['topk']}, "
            f"{first['heads']} heads")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", default=RESULTS)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "sparse_row_grads.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = []
    for path in args.results:
        with open(path) as handle:
            tables.append(json.load(handle))
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4.2), squeeze=False)
    for ax, rows in zip(axes[0], tables, strict=True):
        prompts = [row["prompt"] for row in rows]
        ax.plot(prompts, [row["dense_seconds"] for row in rows], "o-", label="dense: every row, whole page gradient")
        ax.plot(prompts, [row["rows_seconds"] for row in rows], "s-", label="by rows (default)")
        for row in rows:
            share = row["selected_rows"] / (row["prompt"] + row["queries"])
            ax.annotate(f"U {share:.2f} N", (row["prompt"], row["rows_seconds"]), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt rows N")
        ax.set_ylabel("CPU seconds per backward (median)")
        ax.set_title(_title(rows), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("One replay block's sparse MLA backward + its prompt-page gradients (one CPU thread)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
