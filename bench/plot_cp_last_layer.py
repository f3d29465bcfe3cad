"""Plot: the CP 2 capture and layer-major prefix pass before and after the last layer ran for its rows alone, from
bench_cp.py's "Phases against one process" tables saved in bench/results/cp-last-layer.md (BENCHMARKS.md, "The last
layer for its rows alone under context parallelism"). Each bar is the median over the saved rounds.

    python bench/plot_cp_last_layer.py [--results bench/results/cp-last-layer.md] [--out bench/cp_last_layer.png]
"""

import argparse
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phase_seconds(path):
    """{(model, tree, mode, phase): [seconds of each round's CP 2 row]} from the saved tables, whose run headings
    read "## <model> <before|after> round <n>"."""
    out, heading, in_phases = {}, None, False
    with open(path) as handle:
        for line in handle:
            if line.startswith("## "):
                heading, in_phases = line[3:].split(), False
            elif line.startswith("Phases against one process"):
                in_phases = True
            elif in_phases and heading and line.startswith("| none | 2 |"):
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                model, tree, mode = heading[0], heading[1], cells[2]
                out.setdefault((model, tree, mode, "capture"), []).append(float(cells[6]))
                if mode == "exact":
                    out.setdefault((model, tree, mode, "prefix"), []).append(float(cells[10]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "cp-last-layer.md"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "cp_last_layer.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = phase_seconds(args.results)
    bars = sorted({(model, mode, phase) for model, _, mode, phase in seconds})
    labels = [f"{model}\n{mode} {phase}" for model, mode, phase in bars]
    before = [statistics.median(seconds[(model, "before", mode, phase)]) for model, mode, phase in bars]
    after = [statistics.median(seconds[(model, "after", mode, phase)]) for model, mode, phase in bars]
    xs = range(len(bars))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="last layer whole")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label="last layer's rows alone")
    for x, b, a in zip(xs, before, after, strict=True):
        ax.text(x + 0.2, a, f"{a / b:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("seconds at CP 2 (slowest rank, median of rounds)")
    ax.set_title("CP 2 capture and layer-major prefix pass: the last layer for its rows alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
