"""Side-by-side measurements of ds_longstraw and the baselines, each configuration in a fresh process.

    python -m ds_longstraw.tools.bench grid [--prompts 8192,32768,131072] [--groups 2,8] [--out BENCHMARKS.md]
    python -m ds_longstraw.tools.bench one --method longstraw-detached --prompt 32768 --group 8   (one JSON line)

Memory is the kernel's high-water mark (VmHWM) of the fresh process: "step peak" is that mark during the step
minus the resident memory just before it (weights, interpreter and libraries excluded), which is what grows with
prompt length and group size. Time is the step's wall time on this machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

# longstraw-exact: exact mode's defaults (prefix_keep_attention "auto": the selections kept for glm_moe_dsa, nothing
# for qwen3_5); longstraw-exact-keep: prefix_keep_attention true (qwen3_5: the capture's attention outputs kept on
# pages with the K/V pages); longstraw-exact-keep-nvme: the same with the kept pages on the NVMe tier (files under
# $TMPDIR); longstraw-exact-recompute: prefix_keep_attention false (the prefix pass recomputes what it needs);
# longstraw-exact-graph: prefix_keep_graph "fits" (capture keeps its graph where it fits: grpo/kept_graph.py).
METHODS = ("longstraw-detached", "longstraw-exact", "longstraw-exact-keep", "longstraw-exact-keep-nvme",
           "longstraw-exact-recompute", "longstraw-exact-graph", "conventional", "per_member")


def run_one(method, prompt, group_size, response, shape="small", chunk=4096, dtype="float32", seed=0, progress=False,
            prefix_block=None, prefix_recompute=True, kl_coef=0.0):
    """kl_coef > 0: the objective's KL term against a frozen reference (a copy of the starting weights, built
    before the step so its bytes are not part of the step's peak), scored as each method scores it."""
    import copy
    import tempfile

    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, require_host_peaks, reset_host_peak
    from ds_longstraw.grpo.transaction import grpo_backward
    from ds_longstraw.models.shapes import build_named, synthetic_group
    from ds_longstraw.objective import GRPOObjective
    from ds_longstraw.tools.baselines import conventional, per_member

    require_host_peaks("the benchmark")  # reset_host_peak below raises where /proc/self/clear_refs is not writable
    torch.manual_seed(seed)
    model = build_named(shape, dtype=getattr(torch, dtype), seed=seed)
    group = synthetic_group(prompt, group_size, response, model.config.vocab_size, seed=seed)
    config = {"capture_chunk": chunk, "prefix_block": prefix_block, "prefix_recompute": prefix_recompute,
              "replay_block": 1024, "progress": progress}
    objective = GRPOObjective(kl_coef=kl_coef)
    reference = copy.deepcopy(model).requires_grad_(False) if kl_coef > 0 else None
    nvme_dir = None
    if method.startswith("longstraw"):
        config["prefix_grad"] = method.split("-")[1]
        if method.startswith("longstraw-exact-keep"):
            config["prefix_keep_attention"] = True
        elif method == "longstraw-exact-recompute":
            config["prefix_keep_attention"] = False
        elif method == "longstraw-exact-graph":
            config["prefix_keep_graph"] = "fits"
        if method == "longstraw-exact-keep-nvme":
            from ds_longstraw.offload import io_engine

            io_engine.load_aio()  # a job loads the I/O op once, not per step: not part of the step's time
            nvme_dir = tempfile.TemporaryDirectory(prefix="longstraw-bench-")
            # A 4 MiB host budget bounds the tier's write queue and buffer cache (2 MiB each): this is a small
            # model, whose kept pages (8 MiB at 8K tokens) would otherwise sit in the 32 MiB write queue whole.
            config["offload"] = {"kept_attention_tier": "nvme", "nvme_path": nvme_dir.name,
                                 "host_memory_budget_gb": 4 / 1024}
        step = lambda: grpo_backward(model, group, objective, longstraw=config, ref_model=reference)  # noqa: E731
    elif method == "conventional":
        step = lambda: conventional(model, group, objective, longstraw=config, ref_model=reference)  # noqa: E731
    elif method == "per_member":
        step = lambda: per_member(model, group, objective, longstraw=config, ref_model=reference)  # noqa: E731
    else:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    before = host_current_bytes()
    reset_host_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if nvme_dir is not None:
        nvme_dir.cleanup()
    # The meter resets the high-water mark at each phase start: the step's peak is the largest of its phases'.
    peak = max([host_peak_bytes()] + [p.peak_bytes for p in result.phases.values()])
    return {
        "method": method, "prompt": prompt, "group": group_size, "response": response, "shape": shape,
        "seconds": seconds, "cpu_seconds": cpu_seconds, "threads": torch.get_num_threads(),
        "process_peak_bytes": peak, "step_peak_bytes": peak - before,
        "loss": result.loss, "retained_bytes": result.retained_bytes, "grad_page_bytes": result.grad_page_bytes,
        "phases": {name: {"seconds": p.seconds, "peak_bytes": p.peak_bytes} for name, p in result.phases.items()},
        "kl_coef": kl_coef,
        "extras": {k: v for k, v in result.extras.items() if k.startswith(("prefix_", "kept_graph_"))},
    }


def run_fresh(method, prompt, group_size, response, timeout=3600, **kwargs):
    """run_one in a fresh interpreter (so one configuration's peak never hides in another's)."""
    args = [sys.executable, "-m", "ds_longstraw.tools.bench", "one", "--method", method, "--prompt", str(prompt),
            "--group", str(group_size), "--response", str(response)]
    for key, value in kwargs.items():
        if value is not None:
            args += [f"--{key}", str(value)]
    # One intra-op thread unless told otherwise: then CPU seconds measure the work, whatever else the machine runs.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mb(value):
    return f"{value / 2**20:,.0f}"


def grid(prompts, groups, response, methods, skip, partial_path=None, prefix_block=None, prefix_recompute=True,
         kl_coef=0.0, repeat=1, shape="small"):
    """Run every configuration in a fresh process; each finished run is also appended to `partial_path` (JSON
    lines) so an interrupted grid keeps what it measured.

    repeat > 1: the whole grid runs `repeat` times, round after round (so slow drift of the machine touches every
    configuration alike), and each configuration reports its median-CPU-time run, with every run's CPU seconds
    in "cpu_seconds_runs"."""
    configs = [(prompt, group_size, method) for prompt in prompts for group_size in groups for method in methods]
    runs = {config: [] for config in configs}
    total, done = len(configs) * repeat, 0
    for _ in range(repeat):
        for config in configs:
            prompt, group_size, method = config
            done += 1
            if (method, prompt) in skip:
                print(f"[{done}/{total}] {method} prompt={prompt} G={group_size}: skipped ({skip[(method, prompt)]})",
                      flush=True)
                continue
            print(f"[{done}/{total}] {method} prompt={prompt} G={group_size} ...", end=" ", flush=True)
            row = run_fresh(method, prompt, group_size, response, prefix_block=prefix_block,
                            prefix_recompute="on" if prefix_recompute else "off", kl_coef=kl_coef or None,
                            shape=shape)
            print(f"{row['seconds']:.1f} s wall, {row['cpu_seconds']:.1f} s CPU, "
                  f"step peak {_mb(row['step_peak_bytes'])} MiB", flush=True)
            runs[config].append(row)
            if partial_path:
                with open(partial_path, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
    rows = []
    for (prompt, group_size, method), measured in runs.items():
        if (method, prompt) in skip:
            rows.append({"method": method, "prompt": prompt, "group": group_size, "skipped": skip[(method, prompt)]})
            continue
        row = sorted(measured, key=lambda r: r["cpu_seconds"])[(len(measured) - 1) // 2]
        rows.append(dict(row, cpu_seconds_runs=[r["cpu_seconds"] for r in measured]))
    return rows


def _find(rows, method, prompt, group_size):
    for row in rows:
        if row["method"] == method and row["prompt"] == prompt and row["group"] == group_size and "skipped" not in row:
            return row
    return None


def _cpu(row):
    runs = row.get("cpu_seconds_runs", [])
    return f"{row['cpu_seconds']:.2f}" + (f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else "")


def table(rows, command):
    repeats = max((len(r.get("cpu_seconds_runs", [])) for r in rows), default=1)
    lines = [f"Command: `{command}`", ""]
    if repeats > 1:
        lines += [f"Each configuration ran {repeats} times (rounds over the grid); its row is the run of median CPU "
                  "time, with the range of all runs in brackets.", ""]
    lines += [
             "| method | prompt | G | step CPU time (s) | wall (s) | step peak (MiB) | process peak (MiB) "
             "| state pages (MiB) | grad pages (MiB) | kept attention (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['method']} | {row['prompt']} | {row['group']} | skipped: {row['skipped']} "
                         "| | | | | | |")
            continue
        kept = row["retained_bytes"].get("kept_attention_pages", 0)
        # every family's per-token pages (qwen3_5: K/V; glm_moe_dsa: latent + indexer keys), kept attention apart
        kv = sum(size for label, size in row["retained_bytes"].items() if label.endswith("_pages")) - kept
        lines.append(f"| {row['method']} | {row['prompt']} | {row['group']} | {_cpu(row)} | {row['seconds']:.2f} | "
                     f"{_mb(row['step_peak_bytes'])} | {_mb(row['process_peak_bytes'])} | {_mb(kv)} | "
                     f"{_mb(row.get('grad_page_bytes', 0))} | {_mb(kept)} |")
    lines += ["", "Ratios (same run):", ""]
    prompts = sorted({r["prompt"] for r in rows})
    groups = sorted({r["group"] for r in rows})
    for prompt in prompts:
        detached = {g: _find(rows, "longstraw-detached", prompt, g) for g in groups}
        if len(groups) >= 2 and detached[groups[0]] and detached[groups[-1]]:
            a, b = detached[groups[0]]["step_peak_bytes"], detached[groups[-1]]["step_peak_bytes"]
            pa, pb = detached[groups[0]]["process_peak_bytes"], detached[groups[-1]]["process_peak_bytes"]
            lines.append(f"- prompt {prompt}: detached peak growth G={groups[0]} -> G={groups[-1]}: step "
                         f"{100 * (b - a) / a:+.2f}%, process {100 * (pb - pa) / pa:+.2f}%")
        g = groups[-1]
        mine, conv, per = detached[g], _find(rows, "conventional", prompt, g), _find(rows, "per_member", prompt, g)
        exact = _find(rows, "longstraw-exact", prompt, g)
        if mine and conv:
            lines.append(f"- prompt {prompt}, G={g}: detached step peak / conventional = "
                         f"{mine['step_peak_bytes'] / conv['step_peak_bytes']:.3f} "
                         f"(process peak {mine['process_peak_bytes'] / conv['process_peak_bytes']:.3f})")
        if mine and per:
            lines.append(f"- prompt {prompt}, G={g}: per_member time / detached time = "
                         f"{per['cpu_seconds'] / mine['cpu_seconds']:.1f}x (CPU seconds)")
        if mine and conv:
            lines.append(f"- prompt {prompt}, G={g}: conventional time / detached time = "
                         f"{conv['cpu_seconds'] / mine['cpu_seconds']:.2f}x (full autograd: the prompt's forward AND "
                         "backward, the work any exact gradient must do)")
        if mine and exact:
            lines.append(f"- prompt {prompt}, G={g}: exact time / detached time = "
                         f"{exact['cpu_seconds'] / mine['cpu_seconds']:.2f}x (CPU seconds); "
                         f"exact step peak {_mb(exact['step_peak_bytes'])} MiB "
                         f"vs detached {_mb(mine['step_peak_bytes'])} MiB "
                         f"+ grad pages {_mb(exact['grad_page_bytes'])} MiB")
            split = exact.get("extras", {})
            if "prefix_forward_seconds" in split:
                forward, backward = split["prefix_forward_seconds"], split["prefix_backward_seconds"]
                lines.append(f"- prompt {prompt}, G={g}: exact's prefix pass: forward (the recompute) {forward:.2f} s, "
                             f"backward {backward:.2f} s; exact less the recompute "
                             "(the most keeping capture activations could save): "
                             f"{(exact['cpu_seconds'] - forward) / mine['cpu_seconds']:.2f}x detached")
        for method, where in (("longstraw-exact-keep", "with the K/V pages"), ("longstraw-exact-keep-nvme", "on NVMe")):
            keep = _find(rows, method, prompt, g)
            if not (mine and keep):
                continue
            kept = keep["retained_bytes"].get("kept_attention_pages", 0)
            forward = keep.get("extras", {}).get("prefix_forward_seconds", float("nan"))
            lines.append(f"- prompt {prompt}, G={g}: exact with the attention kept ({_mb(kept)} MiB, {where}) "
                         "/ detached "
                         f"time = {keep['cpu_seconds'] / mine['cpu_seconds']:.2f}x (prefix forward {forward:.2f} s); "
                         f"step peak {_mb(keep['step_peak_bytes'])} MiB vs detached {_mb(mine['step_peak_bytes'])} MiB "
                         f"+ grad pages {_mb(keep['grad_page_bytes'])} MiB")
    return "\n".join(lines)


def plot_rows(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        for method in METHODS:
            pts = sorted((r["prompt"], r["step_peak_bytes"] / 2**20) for r in rows
                         if r["method"] == method and r["group"] == g and "skipped" not in r)
            if pts:
                ax.plot([p for p, _ in pts], [m for _, m in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("step peak memory (MiB)")
        ax.set_title(f"G = {g}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fresh_json(script, arguments, timeout=1800):
    """The last JSON line printed by `python script --one JSON(arguments)`, run in a fresh process as the benchmarks
    measure: one intra-op thread, freed blocks of 1 MiB and more handed back to the kernel (MALLOC_MMAP_THRESHOLD_),
    warnings off. RuntimeError with the process's stderr when it fails."""
    command = [sys.executable, os.path.abspath(script), "--one", json.dumps(arguments)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_section(path, name, text):
    """Replace the text between <!-- bench:NAME --> and <!-- /bench:NAME --> in a markdown file (appending the
    section when it is not there yet), so each benchmark rewrites only its own table."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    body = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in body and end in body:
        body = body[:body.index(begin)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip("\n") + ("\n\n" if body else "") + block + "\n"
    with open(path, "w") as handle:
        handle.write(body)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_longstraw.tools.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one")
    one.add_argument("--method", choices=METHODS, required=True)
    one.add_argument("--prompt", type=int, required=True)
    one.add_argument("--group", type=int, required=True)
    one.add_argument("--response", type=int, default=256)
    one.add_argument("--shape", default="small")
    one.add_argument("--chunk", type=int, default=4096)
    one.add_argument("--dtype", default="float32")
    one.add_argument("--prefix-block", "--prefix_block", dest="prefix_block", type=int, default=None)
    one.add_argument("--prefix-recompute", "--prefix_recompute", dest="prefix_recompute", choices=["on", "off"],
                     default="on")
    one.add_argument("--kl-coef", "--kl_coef", dest="kl_coef", type=float, default=0.0)
    many = sub.add_parser("grid")
    many.add_argument("--prompts", default="8192,32768,131072")
    many.add_argument("--groups", default="2,8")
    many.add_argument("--response", type=int, default=256)
    many.add_argument("--methods", default=",".join(METHODS))
    many.add_argument("--skip", default="per_member@131072,conventional@131072",
                      help="method@prompt pairs not run (too slow or too large for a 2-core, 24 GiB machine)")
    many.add_argument("--out", default=None, help="markdown file to write the table to")
    many.add_argument("--plot", default=None, help="PNG of step peak memory vs prompt length")
    many.add_argument("--section", default="grpo", help="name of the BENCHMARKS.md section to (re)write")
    many.add_argument("--prefix-block", dest="prefix_block", type=int, default=None,
                      help="longstraw.prefix_block of the exact-mode rows")
    many.add_argument("--no-prefix-recompute", dest="prefix_recompute", action="store_false",
                      help="longstraw.prefix_recompute = false for the exact-mode rows")
    many.add_argument("--kl-coef", dest="kl_coef", type=float, default=0.0,
                      help="the objective's KL coefficient (> 0: every method also scores a frozen reference)")
    many.add_argument("--shape", default="small", help="a named shape of ds_longstraw.models.shapes (small, small-glm)")
    many.add_argument("--repeat", type=int, default=1,
                      help="rounds over the whole grid; each configuration reports its median-CPU-time run")
    args = parser.parse_args(argv)
    if args.command == "one":
        row = run_one(args.method, args.prompt, args.group, args.response, args.shape, args.chunk, args.dtype,
                      prefix_block=args.prefix_block, prefix_recompute=args.prefix_recompute == "on",
                      kl_coef=args.kl_coef)
        print(json.dumps(row))
        return
    prompts = [int(x) for x in args.prompts.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    skip = {}
    for item in filter(None, args.skip.split(",")):
        method, prompt = item.split("@")
        skip[(method, int(prompt))] = "not run on this machine (see BENCHMARKS.md)"
    partial = None if not args.out else os.path.splitext(args.out)[0] + f".{args.section}.partial.jsonl"
    rows = grid(prompts, groups, args.response, args.methods.split(","), skip, partial, args.prefix_block,
                args.prefix_recompute, args.kl_coef, args.repeat, args.shape)
    command = "python -m ds_longstraw.tools.bench grid " + " ".join(sys.argv[2:] if argv is None else argv[1:])
    text = table(rows, command)
    print(text)
    if args.out:
        write_section(args.out, args.section, text)
        with open(os.path.splitext(args.out)[0] + f".{args.section}.json", "w") as handle:
            json.dump(rows, handle, indent=1)
    if args.plot:
        plot_rows([r for r in rows if "skipped" not in r], args.plot)


if __name__ == "__main__":
    main()
