"""Plot: the CP 2 replay's wall time against one process's, spread and gathered (cp_replay), from bench_cp.py's
"Phases against one process" tables saved in bench/results/cp-replay-gathered-46.md (BENCHMARKS.md, "The CP replay
gathered").

    python bench/plot_cp_replay.py [--results bench/results/cp-replay-gathered-46.md]
                                   [--out bench/cp_replay_gathered.png]
"""

import argparse
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replay_ratios(path):
    """{(section, mode): [replay x CP 1 of each CP 2 row, in table order]} from the saved tables: per section and
    mode the rows run spread first, then gathered (bench_cp's --replay spread,gathered)."""
    ratios, section, in_phases = {}, None, False
    with open(path) as handle:
        for line in handle:
            if line.startswith("#"):  # a run's heading (## or ###): its label
                section, in_phases = line.lstrip("#").strip(), False
            elif line.startswith("Phases against one process"):
                in_phases = True
            elif in_phases and line.startswith("| none | 2 |"):
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                ratios.setdefault((section, cells[2]), []).append(float(cells[9]))  # replay s, x CP 1
    return ratios


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "cp-replay-gathered-46.md"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "cp_replay_gathered.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = replay_ratios(args.results)
    labels = [f"{section}\n{mode}" for section, mode in ratios]
    spread = [values[0] for values in ratios.values()]
    gathered = [values[1] for values in ratios.values()]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar([x - 0.2 for x in xs], spread, 0.4, label="spread")
    ax.bar([x + 0.2 for x in xs], gathered, 0.4, label="gathered (auto here)")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("CP 2 replay wall / one process's")
    ax.set_title("The CP replay: pages gathered once against queries sent per layer and block")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
