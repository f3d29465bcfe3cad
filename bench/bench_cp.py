"""Benchmark: the GRPO transaction with the prompt sharded over CP 1/2/4 gloo ranks on CPU.

Reports, per CP size and gradient mode: step time (wall of grpo_backward, slowest rank), phase times, bytes moved
per replayed token (replay-phase bytes received, summed over ranks, per response token), capture bytes per
attention / GDN layer (summed over ranks), exact mode's prefix-pass bytes, and retained K/V page bytes per rank.
Ranks are forked local processes on one machine, each with --threads intra-op threads: on a 2-core machine CP 4
oversubscribes, so its step time says little about speed; the byte counts are what the design moves.

    python bench/bench_cp.py [--prompt 1024] [--responses 4x32] [--cp 1,2,4] [--modes detached,exact,exact-keep]
                             [--tiers none,cpu,nvme] [--layouts auto,zigzag,contiguous]
                             [--scans one_pass,two_pass] [--prefixes layer_major,turns] [--inputs-every 1,4]

A second table sets each phase beside the single-process one and gives every rank's busy and waiting seconds
(waiting: inside blocking exchanges, CPContext's timers).

With a host or NVMe tier it also reports the bytes each step reads from the tier (summed over ranks, per paged
layer) and the largest single read in tokens: what the stager streams, page by page, instead of whole shards.
"""

import argparse
import itertools
import os
import shlex
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_model(layers, seed=0, family="qwen"):
    from ds_longstraw.models.shapes import build_named as build

    if family == "glm":  # the "small-glm" shape (8 MLA + DSA layers, top-512 selection, 8 experts), as it is
        return build("small-glm", seed=seed, vocab_size=512)
    # The "small" shape with 8 query heads over 2 kv heads (GQA 4:1, where sending pages beats sending queries).
    return build("small", seed=seed, vocab_size=512, num_hidden_layers=layers, num_attention_heads=8,
                 max_position_embeddings=1 << 16,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 2, 4]})


def build_group(prompt, responses, vocab=512, seed=0):
    from ds_longstraw import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    count, length = responses
    return GRPOGroup(torch.randint(0, vocab, (prompt,), generator=gen),
                     [torch.randint(0, vocab, (length,), generator=gen) for _ in range(count)],
                     rewards=torch.rand(count, generator=gen).tolist())


TIER_READS = {"bytes": 0, "largest": 0}


def count_tier_reads():
    """Count what host and NVMe pools read from their tier (every read goes through begin_read)."""
    from ds_longstraw.offload.tiered import TieredPagePool

    original = TieredPagePool.begin_read

    def begin_read(self, layer, name, start=0, end=None, kind="state"):
        stop = self.length(layer, name) if end is None else end
        TIER_READS["bytes"] += (stop - start) * self._stream(layer, name).token_bytes
        TIER_READS["largest"] = max(TIER_READS["largest"], stop - start)
        return original(self, layer, name, start, end, kind)

    TieredPagePool.begin_read = begin_read


def one_step(args, mode, cp_group=None, world=1, attention="lse", tier="none", out=None, replay="replicated",
             layout="auto", scan="one_pass", prefix="auto", every="auto"):
    from ds_longstraw import GRPOObjective, grpo_backward
    from ds_longstraw.arch import adapter_for

    model = build_model(args.layers, family=args.family)
    group = build_group(args.prompt, args.responses)
    # "exact-keep": exact mode with prefix_keep_attention (each rank keeps its tokens' merged attention)
    config = {"prefix_grad": mode.removesuffix("-keep"), "prefix_keep_attention": mode.endswith("-keep"),
              "capture_chunk": args.chunk, "page_tokens": 256, "replay_block": args.block, "cp_size": world,
              "cp_attention": attention, "offload": {"tier": tier}, "cp_replay": replay, "cp_layout": layout,
              "cp_scan": scan, "cp_prefix": prefix, "prefix_inputs_every": every}
    if tier == "nvme":
        config["offload"]["nvme_path"] = os.path.join(out, "nvme")
        os.makedirs(config["offload"]["nvme_path"], exist_ok=True)
    grpo_backward(model, build_group(64, (1, 4)), GRPOObjective(), longstraw=dict(config), cp_group=cp_group)  # warm-up
    best = None
    for _ in range(args.repeat):  # the fastest of a few steps: this machine is shared
        model.zero_grad(set_to_none=True)
        TIER_READS.update(bytes=0, largest=0)
        start = time.perf_counter()
        result = grpo_backward(model, group, GRPOObjective(), longstraw=config, cp_group=cp_group)
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    seconds = best
    return {"seconds": seconds, "phases": {k: v.seconds for k, v in result.phases.items()},
            "replay_cpu": result.phases["replay"].cpu_seconds, "replay": replay,
            "tier_read_bytes": TIER_READS["bytes"], "largest_read": TIER_READS["largest"],
            "retained": result.retained_bytes, "cp": result.extras.get("cp"), "tokens": group.response_tokens,
            "prompt": group.prompt_ids.numel(),
            # from the adapter's layer-state specs: paged ("lse") layers and carried ("affine_scan") ones
            "attn_layers": adapter_for(model).paged_layers, "gdn_layers": adapter_for(model).carry_layers}


def _worker(rank, world, port, args, mode, attention, tier, out, replay="replicated", layout="auto",
            scan="one_pass", prefix="auto", every="auto"):
    torch.set_num_threads(args.threads)
    count_tier_reads()
    try:
        if world == 1:  # the single-process transaction, in a child like the others
            torch.save(one_step(args, mode, tier=tier, out=out), os.path.join(out, "rank0.pt"))
            return
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.new_group(list(range(world)), backend="gloo")
        result = one_step(args, mode, group, world, attention, tier, out, replay, layout, scan, prefix, every)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier(group=group)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def run_world(args, mode, world, attention="lse", tier="none", replay="replicated", layout="auto", scan="one_pass",
              prefix="auto", every="auto"):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix=f"bench_cp{world}_")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, mode, attention, tier, out, replay, layout, scan,
                                               prefix, every))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"CP {world} failed: exit codes {[p.exitcode for p in procs]}")
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _paged_bytes(retained):
    """A rank's attention pages: qwen3_5's K/V pages, or glm_moe_dsa's latent, rope and indexer-key pages."""
    if "attention_kv_pages" in retained:
        return retained["attention_kv_pages"]
    return sum(b for label, b in retained.items() if label in ("mla_latent_pages", "indexer_key_pages"))


def summarise(world, mode, attention, ranks, tier="none"):
    first = ranks[0]
    row = {"cp": world, "mode": mode, "attention": attention if world > 1 else "-", "tier": tier,
           "layout": first["cp"]["layout"] if world > 1 else "-",
           "prefix": first["cp"]["prefix"] if world > 1 and mode.startswith("exact") else "-",
           # per rank: (phase -> wall seconds, phase -> seconds waited inside blocking exchanges)
           "rank_phases": [(r["phases"], (r["cp"] or {}).get("waited_seconds", {})) for r in ranks],
           "prompt": first["prompt"],
           "replay": first["replay"] if world > 1 else "-",
           "replay_cpu_max": max(r["replay_cpu"] for r in ranks), "replay_cpu_sum": sum(r["replay_cpu"] for r in ranks),
           "tier_read_b_per_layer": sum(r["tier_read_bytes"] for r in ranks) // len(first["attn_layers"]),
           "largest_read": max(r["largest_read"] for r in ranks),
           "step_s": max(r["seconds"] for r in ranks),
           "phases": {k: max(r["phases"].get(k, 0.0) for r in ranks) for k in first["phases"]},
           "kv_pages_per_rank": max(_paged_bytes(r["retained"]) for r in ranks),
           "kept_per_rank": max(r["retained"].get("kept_attention_pages", 0) for r in ranks),
           "replay_b_per_tok": 0.0, "capture_attn_b": 0, "capture_gdn_b": 0, "prefix_b": 0, "moves": "-"}
    if world > 1:
        tokens = first["tokens"]
        attn = set(first["attn_layers"])

        def total(phase, keep=lambda layer: True):
            return sum(b for r in ranks for layer, b in r["cp"]["received_bytes_by_layer"].get(phase, {}).items()
                       if keep(layer))

        row["replay_b_per_tok"] = total("replay") / tokens
        row["replay_b_per_tok_layer"] = row["replay_b_per_tok"] / len(attn)
        row["capture_attn_b"] = total("capture", lambda layer: layer in attn) // len(attn)
        gdn = set(first["gdn_layers"])
        row["capture_gdn_b"] = total("capture", lambda layer: layer in gdn) // max(1, len(gdn))
        row["prefix_b"] = total("prefix")
        row["grad_reduce_b"] = total("reduce")
        row["moves"] = ",".join(sorted(set(first["cp"]["capture_moves"].get("capture", {}).values())))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--responses", default="4x32", help="GxT: G responses of T tokens")
    parser.add_argument("--layers", type=int, default=8, help="layers of the qwen shape")
    parser.add_argument("--family", default="qwen", choices=("qwen", "glm"),
                        help="qwen: the small qwen3_5 shape at --layers; glm: the small-glm glm_moe_dsa shape")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--cp", default="1,2,4")
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--attention", default="lse,ulysses", help="capture attention paths for CP > 1")
    parser.add_argument("--tiers", default="none", help="offload tiers of the pages: none, cpu, nvme")
    parser.add_argument("--repeat", type=int, default=2, help="steps per row; the fastest is reported")
    parser.add_argument("--layouts", default="auto", help="CP layouts (cp_layout) for CP > 1: auto, zigzag, "
                        "contiguous, comma-separated")
    parser.add_argument("--plot", default=None, help="write a bar chart of every rank's capture (busy, waiting)")
    parser.add_argument("--scans", default="one_pass", help="GDN capture schedules (cp_scan) for CP > 1: one_pass, "
                        "two_pass, comma-separated")
    parser.add_argument("--prefixes", default="auto", help="exact mode's CP prefix passes (cp_prefix) for CP > 1: "
                        "auto, layer_major, turns, comma-separated")
    parser.add_argument("--inputs-every", default="auto", help="layer-major prefix pass: keep every k-th layer's "
                        "input (prefix_inputs_every: auto or k), comma-separated")
    parser.add_argument("--replay", default="replicated",
                        help="CP replay schedules (cp_replay): replicated, spread, gathered, auto, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (1: a loaded shared "
                        "machine makes multi-threaded OpenMP spin)")
    args = parser.parse_args(argv)
    import ds_longstraw  # noqa: F401  imported once here; the forked ranks inherit it (about 10 s each otherwise)

    args.responses = tuple(int(x) for x in args.responses.split("x"))
    rows = []
    for tier in args.tiers.split(","):
        for mode in args.modes.split(","):
            for world in (int(x) for x in args.cp.split(",")):
                for attention in (["lse"] if world == 1 else args.attention.split(",")):
                    for replay in (["replicated"] if world == 1 else args.replay.split(",")):
                        prefixes = args.prefixes.split(",") if mode.startswith("exact") else ["auto"]
                        everies = [k if k == "auto" else int(k) for k in args.inputs_every.split(",")]
                        for layout, scan, prefix, every in itertools.product(
                                *(["auto"], ["one_pass"], ["auto"], ["auto"]) if world == 1 else (
                                    args.layouts.split(","), args.scans.split(","), prefixes, everies)):
                            if every not in ("auto", 1) and prefix == "turns":
                                continue  # the turns keep no layer inputs
                            ranks = run_world(args, mode, world, attention, tier, replay, layout, scan, prefix, every)
                            row = dict(summarise(world, mode, attention, ranks, tier), scan=scan if world > 1 else "-")
                            every = (ranks[0]["cp"] or {}).get("inputs_every", 1)  # as it ran ("auto" resolved)
                            if row["prefix"] == "layer_major" and every > 1:
                                row["prefix"] = f"layer_major, inputs every {every}"
                            rows.append(row)
                            print(f"# done tier={tier} cp={world} mode={mode} attention={attention} replay={replay} "
                                  f"layout={layout} scan={scan} prefix={prefix} every={every}: "
                                  f"{rows[-1]['step_s']:.2f} s", file=sys.stderr, flush=True)
    print(f"`{' '.join(shlex.quote(a) for a in ['python', 'bench/bench_cp.py'] + (argv or sys.argv[1:]))}` "
          f"(prompt {args.prompt}, G x T = {args.responses[0]} x {args.responses[1]}, "
          f"{'small-glm' if args.family == 'glm' else f'{args.layers} layers'}, "
          f"float32, {os.cpu_count()} cores, {args.threads} thread(s) per rank)\n")
    print("Bytes are received payload summed over the CP ranks; 'prefix B' is exact mode's remote-attention and "
          "state-gradient traffic, 'grad all-reduce B' the one parameter-gradient all-reduce per group.\n")
    print("| tier | CP | replay | mode | capture attention | step s | capture s | replay s "
          "| replay CPU s (slowest rank) | replay CPU s (all ranks) | prefix s | tier reads B / layer "
          "| largest read (tokens) | K/V pages / rank | kept attention / rank | replay B / token "
          "| replay B / token / attn layer | capture B / attn layer | capture B / GDN layer | prefix B "
          "| grad all-reduce B |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p = r["phases"]
        moves = r["attention"] if r["attention"] != "lse" else f"lse ({r['moves']} travel)"
        print(f"| {r['tier']} | {r['cp']} | {r['replay']} | {r['mode']} | {moves if r['cp'] > 1 else '-'} "
              f"| {r['step_s']:.2f} | {p.get('capture', 0):.2f} | {p.get('replay', 0):.2f} "
              f"| {r['replay_cpu_max']:.2f} | {r['replay_cpu_sum']:.2f} | {p.get('prefix', 0):.2f} "
              f"| {r['tier_read_b_per_layer']:,} | {r['largest_read']:,} | {r['kv_pages_per_rank']:,} "
              f"| {r['kept_per_rank']:,} | {r['replay_b_per_tok']:,.0f} "
              f"| {r.get('replay_b_per_tok_layer', 0):,.0f} | {r['capture_attn_b']:,} | {r['capture_gdn_b']:,} "
              f"| {r['prefix_b']:,} | {r.get('grad_reduce_b', 0):,} |")
    print_balance(rows)
    if args.plot:
        plot_balance(rows, args.plot)


def print_balance(rows):
    """The phases against one process (same tier and mode), each rank's busy and waiting seconds, and the capture's
    bytes per attention layer and prompt token."""
    single = {(r["tier"], r["mode"]): r for r in rows if r["cp"] == 1}
    print("\nPhases against one process; per rank busy / waiting seconds (waiting: inside blocking exchanges); "
          "capture bytes received per attention layer and prompt token, summed over ranks.\n")
    print("| tier | CP | mode | layout | GDN scan | prefix pass | capture s | x CP 1 | replay s | x CP 1 | prefix s "
          "| x CP 1 | capture busy / wait per rank | prefix busy / wait per rank | capture B / attn layer / token |")
    print("|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        base = single.get((r["tier"], r["mode"]))
        cells = []
        for phase in ("capture", "replay", "prefix"):
            seconds = r["phases"].get(phase, 0.0)
            ref = base["phases"].get(phase, 0.0) if base else 0.0
            cells += [f"{seconds:.2f}", f"{seconds / ref:.2f}" if ref else "-"]

        def busy_wait(phase, r=r):
            if r["cp"] == 1:
                return "-"
            return ", ".join(f"{p.get(phase, 0.0) - w.get(phase, 0.0):.2f} / {w.get(phase, 0.0):.2f}"
                             for p, w in r["rank_phases"])

        per_token = r["capture_attn_b"] / max(1, r["prompt"] - 1)
        print(f"| {r['tier']} | {r['cp']} | {r['mode']} | {r['layout']} | {r['scan']} | {r['prefix']} "
              f"| {' | '.join(cells)} "
              f"| {busy_wait('capture')} | {busy_wait('prefix')} | {per_token:,.1f} |")


def plot_balance(rows, path):
    """Each CP rank's capture and (exact mode) prefix pass, busy and waiting, per configuration, beside the
    single-process phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("capture", [r for r in rows if r["cp"] > 1]),
              ("prefix", [r for r in rows if r["cp"] > 1 and r["mode"].startswith("exact")])]
    panels = [(phase, runs) for phase, runs in panels if runs]
    height = [0.5 + 0.45 * sum(r["cp"] for r in runs) for _, runs in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.6 + sum(height)), squeeze=False,
                             gridspec_kw={"height_ratios": height})
    for ax, (phase, runs) in zip(axes[:, 0], panels, strict=True):
        single = {(r["tier"], r["mode"]): r["phases"].get(phase, 0.0) for r in rows
                  if r["cp"] == 1 and (phase == "capture" or r["mode"].startswith("exact"))}
        labels, y = [], 0
        for r in runs:
            for rank, (phases, waited) in enumerate(r["rank_phases"]):
                wait = waited.get(phase, 0.0)
                busy = phases.get(phase, 0.0) - wait
                ax.barh(y, busy, color="tab:blue", label="busy" if y == 0 else None)
                ax.barh(y, wait, left=busy, color="tab:orange", label="waiting in exchanges" if y == 0 else None)
                schedule = r["scan"] if r["prefix"] == "-" else f"{r['scan']}, {r['prefix']}"
                labels.append(f"{r['mode']}, {r['layout']}, {schedule}: rank {rank}")
                y += 1
        for index, ((_tier, mode), seconds) in enumerate(sorted(single.items())):
            ax.axvline(seconds, color="gray", linestyle=("--", ":")[index % 2], linewidth=1,
                       label=f"one process, {mode}: {seconds:.2f} s")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{phase} wall seconds")
        ax.set_title(f"{'Capture' if phase == 'capture' else 'Exact prefix pass'}, {rows[0]['prompt']:,}-token "
                     f"prompt, CP {runs[0]['cp']}: each rank busy / waiting", fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
