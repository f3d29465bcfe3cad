"""Groups sharing a document: one tree transaction (grpo_backward_shared) against the groups run separately
(grpo_backward each) and against one group alone, in one run side by side.

    python bench/bench_shared_document.py [--modes detached,exact] [--document 16384] [--out FILE.json]

The small qwen3_5 shape (8 layers, float32); QUESTIONS groups whose prompts are one DOCUMENT-token document
followed by a 64-token question of their own; G = 4 members of 128 tokens each; grpo_backward's defaults
otherwise. Each configuration runs in a fresh process (one intra-op thread); memory is the kernel's high-water mark
(VmHWM) over the whole step, above the process's resident set before it; "one" is a single group's transaction,
the peak the shared step is held to (one document's pages and one group's graph).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
QUESTIONS, QUESTION, GROUP, RESPONSE = 4, 64, 4, 128
PATHS = ("one", "separate", "shared")


def shared_groups(document, vocab_size, seed=0):
    """QUESTIONS groups: the same document, then each its own question; G responses each, rewards at random."""
    import torch

    from ds_longstraw import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(0, vocab_size, (document,), generator=gen)
    groups = []
    for _ in range(QUESTIONS):
        question = torch.randint(0, vocab_size, (QUESTION,), generator=gen)
        responses = [torch.randint(0, vocab_size, (RESPONSE,), generator=gen) for _ in range(GROUP)]
        groups.append(GRPOGroup(torch.cat([doc, question]), responses, rewards=torch.rand(GROUP, generator=gen)))
    return groups


def run_one(document, mode, path):
    """One step in this process: its peak above the resident set before it, and seconds."""
    import torch

    from ds_longstraw import GRPOObjective, grpo_backward, grpo_backward_shared
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, require_host_peaks, reset_host_peak
    from ds_longstraw.models.shapes import build_named

    require_host_peaks("the benchmark")
    model = build_named("small", dtype=torch.float32, seed=0)
    groups = shared_groups(document, model.config.vocab_size)
    config = {"prefix_grad": mode}
    before = host_current_bytes()
    reset_host_peak()
    start = time.perf_counter()
    if path == "shared":
        results = grpo_backward_shared(model, groups, GRPOObjective(), longstraw=config)
    else:
        results = [grpo_backward(model, group, GRPOObjective(), longstraw=config)
                   for group in (groups[:1] if path == "one" else groups)]
    seconds = time.perf_counter() - start
    peak = host_peak_bytes() - before
    return {"document": document, "mode": mode, "path": path, "groups": len(results), "seconds": seconds,
            "peak_bytes": peak, "losses": [r.loss for r in results],
            "captured": results[0].extras.get("document", {}).get("tokens")}


def run_fresh(document, mode, path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--one", f"{document},{mode},{path}"], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows):
    """The markdown table for BENCHMARKS.md: each mode's shared step beside the separate groups and one group."""
    by = {(r["mode"], r["path"]): r for r in rows}
    lines = ["| mode | path | groups | step (s) | vs separate | peak above start (MiB) | vs one group |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        separate, one = by.get((r["mode"], "separate")), by.get((r["mode"], "one"))
        time_ratio = "" if separate is None or r["path"] != "shared" else f"{r['seconds'] / separate['seconds']:.2f}x"
        peak_ratio = "" if one is None or r["path"] == "one" else f"{r['peak_bytes'] / one['peak_bytes']:.2f}x"
        lines.append(f"| {r['mode']} | {r['path']} | {r['groups']} | {r['seconds']:.1f} | {time_ratio} | "
                     f"{r['peak_bytes'] / MIB:,.0f} | {peak_ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--document", type=int, default=16384)
    parser.add_argument("--out", default=None)
    parser.add_argument("--from-json", default=None, help="tabulate a saved run instead of running")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        document, mode, path = args.one.split(",")
        print(json.dumps(run_one(int(document), mode, path)))
        return
    if args.from_json:
        with open(args.from_json) as handle:
            print(table(json.load(handle)))
        return
    rows = []
    for mode in args.modes.split(","):
        for path in PATHS:
            row = run_fresh(args.document, mode, path)
            rows.append(row)
            print(f"[shared_document] {mode} {path}: {row['groups']} groups, step {row['seconds']:.1f} s, peak "
                  f"{row['peak_bytes'] / MIB:.0f} MiB", flush=True)
            if args.out:
                with open(args.out, "w") as handle:
                    json.dump(rows, handle, indent=1)
    shared = {r["mode"]: r for r in rows if r["path"] == "shared"}
    separate = {r["mode"]: r for r in rows if r["path"] == "separate"}
    for mode, row in shared.items():  # the same losses, group by group, whichever way the step ran
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(row["losses"], separate[mode]["losses"],
                                                                           strict=True)), (mode, row["losses"])
    print(table(rows))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
