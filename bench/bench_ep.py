"""Benchmark: expert parallelism on the small GLM shape, under the DeepSpeed engine (ZeRO-3) on 2 CPU ranks.

    python bench/bench_ep.py [--prompt 2048] [--group 2] [--response 64] [--ep 1,2] [--steps 2] [--write BENCHMARKS.md]

For each EP size it starts the real `deepspeed` launcher (`--num_gpus 2`: 2 CPU ranks on gloo, one intra-op thread
each) on this file as the rank script. Every rank builds the same random small-glm model (float32), brings its own
group (a prompt of --prompt tokens and --group responses of --response tokens: same shape on both ranks, so the
lockstep pads nothing), and takes --steps engine.grpo_step's (detached, SGD); the last step is reported (the first
also records ZeRO-3's module trace). Per step and rank:

  dispatch   GroupResult.extras["ep"]: dispatches (forward calls of a MoE block's all-to-all), pairs_routed (the
             rank's (token, expert) pairs: k per token and MoE call), pairs_received per rank, bytes_sent (the
             token vectors this rank sends to other ranks plus the results it sends back for pairs it received,
             forward only). Summed over the ranks, each pair that crosses ranks is counted twice (out, back), so
             bytes per MoE layer and token = sum(bytes_sent) / (sum(pairs_routed) / k) = 2 k hidden 4 B x f,
             f = remote pairs / pairs; the planner's formula takes f = (E - 1) / E (uniform routing).
             Backward sends the replay's gradients back the same way: counted separately by wrapping
             torch.distributed.all_to_all_single (every 2-D floating-point tensor it sends to another rank).
  gathers    ZeRO-3's weight gathers: every partitioned parameter's all_gather / all_gather_coalesced is wrapped
             and counts ds_numel x element size of each parameter it is asked for while NOT_AVAILABLE (the ones it
             actually brings in), by kind: routed experts, the rest of a MoE block (router, shared expert), the
             rest of the model. stage3_param_persistence_threshold 0 and stage3_max_reuse_distance 0 make every
             module call gather its parameters, as a model too large to keep them would (this model would
             otherwise keep them all resident after the first step).
  time/peak  StepResult.seconds (wall) and the process's CPU seconds; the step's host peak (VmHWM reset before
             the step, and at each phase by the transaction's meter) less the resident set before it.
The planner's figures for the same shape (offload/plan.moe_figures at 4 B per weight and activation) are printed
beside the measurements.
"""

import argparse
import json
import os
import shlex
import sys
import time

import torch
from two_ranks import add_rank_script_arguments, launch_two_ranks  # bench/ is the script's folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SECTION = "ep-glm"
KINDS = ("routed", "moe_rest", "other")


# -- rank script ------------------------------------------------------------------------------------------------

class GatherCounter:
    """Bytes ZeRO-3 gathers, by kind: wraps each partitioned parameter's all_gather entry points (the coordinator
    calls params[0].all_gather_coalesced(params), GatheredParameters params[0].all_gather(param_list=params))."""

    def __init__(self, module, kind_of):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.not_available = ZeroParamStatus.NOT_AVAILABLE
        self.kind_of = kind_of
        self.reset()
        for param in module.parameters():
            if hasattr(param, "ds_id"):
                param.all_gather_coalesced = self._wrap(param.all_gather_coalesced, param, "params")
                param.all_gather = self._wrap(param.all_gather, param, "param_list")

    def reset(self):
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)

    def _wrap(self, original, owner, list_name):
        def gather(*args, **kwargs):
            params = kwargs.get(list_name, args[0] if args else None)
            for param in [owner] if params is None else params:
                if param.ds_status == self.not_available:
                    kind = self.kind_of(param)
                    self.bytes[kind] += param.ds_numel * param.element_size()
                    self.calls[kind] += 1
            return original(*args, **kwargs)

        return gather


class AllToAllCounter:
    """Bytes of 2-D floating-point rows that torch.distributed.all_to_all_single sends to other ranks (token
    vectors and results forward, their gradients backward); the counts and expert ids (integers) are left out."""

    def __init__(self):
        import torch.distributed as dist

        self.original = dist.all_to_all_single
        self.bytes = 0
        dist.all_to_all_single = self._counted

    def _counted(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        import torch.distributed as dist

        if input.is_floating_point() and input.dim() == 2 and input_split_sizes is not None:
            me = dist.get_rank(group=group)
            self.bytes += (sum(input_split_sizes) - input_split_sizes[me]) * input.shape[1] * input.element_size()
        return self.original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


class RouterCounter:
    """The router's choices, seen independently of the dispatch: forward hooks on every MoE block's gate count
    token visits (tokens x MoE calls) and the pairs whose expert lives on another rank of an EP group of
    `ep_size` (owner = expert // (n / ep_size), the slices of shard_experts); for EP 1, those that would under
    EP 2."""

    def __init__(self, blocks, experts, ep_size, rank):
        self.per_rank, self.rank = experts // ep_size, rank % ep_size
        self.reset()
        for block in blocks:
            block.gate.register_forward_hook(self._seen)

    def reset(self):
        self.tokens = self.pairs = self.remote = self.calls = 0

    def _seen(self, module, inputs, output):
        indices = output[2]  # (logits, weights, indices [T, k])
        self.calls += 1
        self.tokens += indices.shape[0]
        self.pairs += indices.numel()
        self.remote += int((torch.div(indices, self.per_rank, rounding_mode="floor") != self.rank).sum())


def _group(prompt, group_size, response, vocab, seed):
    from ds_longstraw import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(0, vocab, (prompt,), generator=gen),
                     [torch.randint(0, vocab, (response,), generator=gen) for _ in range(group_size)],
                     rewards=torch.rand(group_size, generator=gen).tolist())


def rank_main(args):
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed import comm as dist

    import ds_longstraw
    from ds_longstraw.arch.glm_moe_dsa_experts import moe_blocks
    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak
    from ds_longstraw.models.shapes import build_named

    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = build_named("small-glm", dtype=torch.float32, seed=0)  # the same weights on every rank
    kinds = {}
    for block in moe_blocks(model):
        for name, param in block.named_parameters():
            kinds[id(param)] = "routed" if name.startswith("experts.") else "moe_rest"
    k = model.config.num_experts_per_tok
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0,  # the engine refuses clipping with expert slices (not a global norm)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
              "longstraw": {"enabled": True, "prefix_grad": "detached", "ep_size": args.ep_size}}
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                         config=config)
    gathers = GatherCounter(engine.module, lambda p: kinds.get(id(p), "other"))
    blocks = moe_blocks(engine.module)
    # EP 1's routes are counted against EP 2's slices: the pairs that would leave the rank
    router = RouterCounter(blocks, model.config.n_routed_experts, max(args.ep_size, 2), rank)
    rest_per_block = sum(1 for name, _ in blocks[0].named_parameters() if not name.startswith("experts."))
    alltoall = AllToAllCounter()
    slices = engine.longstraw_experts
    resident = sum(p.ds_tensor.numel() * p.element_size() for p in engine.module.parameters() if hasattr(p, "ds_id"))
    resident_slices = 0 if slices is None else sum(p.numel() * p.element_size() for p in slices.params.values())
    steps = []
    for step in range(args.steps):
        group = _group(args.prompt, args.group, args.response, model.config.vocab_size, seed=1000 * step + rank)
        gathers.reset()
        router.reset()
        alltoall.bytes = 0
        dist.barrier()
        before = host_current_bytes()
        reset_host_peak()
        cpu = time.process_time()
        result = engine.grpo_step(group)
        cpu = time.process_time() - cpu
        phase_peak = max(p.peak_bytes for p in result.groups[0].phases.values())
        steps.append({"seconds": result.seconds, "cpu_seconds": cpu,
                      "step_peak_bytes": max(host_peak_bytes(), phase_peak) - before,
                      "process_peak_bytes": max(host_peak_bytes(), phase_peak),
                      "gather_bytes": dict(gathers.bytes), "gather_params": dict(gathers.calls),
                      "alltoall_bytes": alltoall.bytes, "ep": result.groups[0].extras.get("ep"),
                      "router": {"calls": router.calls, "tokens": router.tokens, "pairs": router.pairs,
                                 "remote": router.remote},
                      "moe_gathers": gathers.calls["moe_rest"] / rest_per_block,
                      "mean_loss": result.mean_loss, "tokens": result.tokens})
    out = {"rank": rank, "ep_size": args.ep_size, "k": k, "hidden": model.config.hidden_size,
           "moe_layers": len(blocks), "resident_zero3_bytes": resident,
           "resident_slice_bytes": resident_slices, "steps": steps}
    with open(os.path.join(args.result, f"rank{rank}.json"), "w") as handle:
        json.dump(out, handle)
    dist.barrier()
    dist.destroy_process_group()


# -- driver -----------------------------------------------------------------------------------------------------

def launch(args, ep_size):
    """One 2-rank job (fresh processes) for one EP size; returns the two ranks' results."""
    return launch_two_ranks(__file__, ["--ep-size", str(ep_size), "--prompt", str(args.prompt), "--group",
                                       str(args.group), "--response", str(args.response), "--steps",
                                       str(args.steps)], f"bench_ep{ep_size}")


def planner_figures(ep_size, prompt):
    """The planner's MoE figures for this shape on 2 ranks, at 4 B per weight and activation (float32)."""
    from ds_longstraw.models.model_shape import shape_from_config
    from ds_longstraw.models.modeling import MODELS_DIR, load_shape
    from ds_longstraw.offload.plan import Cluster, captured_tokens_per_rank, moe_figures

    shape = shape_from_config("small-glm", load_shape(MODELS_DIR / "small_glm_moe_dsa.yaml"), 4)
    cluster = Cluster(gpus=2, cp=1, ep=ep_size, weight_bytes=4.0)
    return moe_figures(shape, cluster, captured_tokens_per_rank(prompt, 1), 4096)


def _mib(n):
    return f"{n / 2**20:,.2f}"


def summarise(ep_size, ranks):
    """One column of the table: the last step, the slowest rank's time and peak, bytes summed or averaged over
    the ranks as labelled."""
    last = [r["steps"][-1] for r in ranks]
    k, hidden = ranks[0]["k"], ranks[0]["hidden"]
    routes = {key: sum(s["router"][key] for s in last) for key in ("calls", "tokens", "pairs", "remote")}
    row = {"ep": ep_size, "k": k, "hidden": hidden,
           "seconds": max(s["seconds"] for s in last), "cpu": max(s["cpu_seconds"] for s in last),
           "step_peak": max(s["step_peak_bytes"] for s in last),
           "process_peak": max(s["process_peak_bytes"] for s in last),
           "gather": {kind: sum(s["gather_bytes"][kind] for s in last) / len(last) for kind in KINDS},
           "moe_gathers": sum(s["moe_gathers"] for s in last) / len(last),
           "resident": max(r["resident_zero3_bytes"] + r["resident_slice_bytes"] for r in ranks),
           "resident_slices": max(r["resident_slice_bytes"] for r in ranks),
           "router_fraction": routes["remote"] / routes["pairs"], "router_tokens": routes["tokens"],
           "ep_stats": None}
    row["gather_total"] = sum(row["gather"].values())
    row["gather_per_moe_call"] = (row["gather"]["routed"] + row["gather"]["moe_rest"]) / row["moe_gathers"]
    if ep_size > 1:
        eps = [s["ep"] for s in last]
        token_layers = sum(e["pairs_routed"] for e in eps) / k
        sent = sum(e["bytes_sent"] for e in eps)
        dispatches = sum(e["dispatches"] for e in eps)
        row["ep_stats"] = {
            "dispatches_per_rank": dispatches / len(eps), "tokens_per_dispatch": token_layers / dispatches,
            "token_layers": token_layers, "bytes_sent": sent, "bytes_per_layer_token": sent / token_layers,
            "load_imbalance": eps[0]["load_imbalance"], "pairs_received_per_rank": eps[0]["pairs_received_per_rank"],
            "alltoall_total": sum(s["alltoall_bytes"] for s in last)}
    return row


def report(args, rows, command):
    first = rows[0]
    out_and_back = 2 * first["k"] * first["hidden"] * 4  # per token and MoE layer, float32
    lines = [f"Command: `{command}`", "",
             f"small-glm (8 layers: 7 MoE layers of 8 routed experts, top-2 in 2 groups, + 1 shared expert; hidden "
             f"128), float32, ZeRO-3 on 2 CPU ranks (`deepspeed --num_gpus 2`, gloo, 1 thread each), detached, "
             f"prompt {args.prompt:,}, G = {args.group}, responses of {args.response} tokens, one group per rank; "
             f"step {args.steps} of {args.steps} reported. Bytes per rank are the mean of the two ranks; time and "
             "peak the slower rank's.", "",
             "| | " + " | ".join(f"EP {r['ep']}" for r in rows) + " |", "|---|" + "---:|" * len(rows)]

    def add(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in rows) + " |")

    def ep_only(fn):
        return lambda r: "-" if r["ep_stats"] is None else fn(r["ep_stats"])

    add("step wall s / CPU s", lambda r: f"{r['seconds']:.2f} / {r['cpu']:.2f}")
    add("step peak MiB (process peak)", lambda r: f"{_mib(r['step_peak'])} ({_mib(r['process_peak'])})")
    add("weights resident per rank MiB (expert slices)",
        lambda r: f"{_mib(r['resident'])} ({_mib(r['resident_slices'])})")
    add("**(c)** ZeRO-3 gathered per rank per step MiB", lambda r: _mib(r["gather_total"]))
    add("- routed experts", lambda r: _mib(r["gather"]["routed"]))
    add("- router + shared expert", lambda r: _mib(r["gather"]["moe_rest"]))
    add("- rest of the model", lambda r: _mib(r["gather"]["other"]))
    add("MoE block gathers per rank (forward + backward)", lambda r: f"{r['moe_gathers']:.0f}")
    add("B per MoE block gather, measured", lambda r: f"{r['gather_per_moe_call']:,.0f}")
    add("- planner", lambda r: f"{planner_figures(r['ep'], args.prompt)[_per_call_key(r['ep'])]:,}")
    add("**(a)** dispatches per rank (forward MoE calls)", ep_only(lambda e: f"{e['dispatches_per_rank']:.0f}"))
    add("token visits (tokens x MoE calls), both ranks", ep_only(lambda e: f"{e['token_layers']:,.0f}"))
    add("tokens per dispatch", ep_only(lambda e: f"{e['tokens_per_dispatch']:,.1f}"))
    add("pairs routed off their rank, f (router hooks; EP 1: under EP 2)", lambda r: f"{r['router_fraction']:.3f}")
    add("dispatch B per MoE layer and token, measured", ep_only(lambda e: f"{e['bytes_per_layer_token']:,.1f}"))
    add(f"- formula 2 k H 4 B x f = {out_and_back:,} x f", lambda r: f"{out_and_back * r['router_fraction']:,.1f}"
        if r["ep_stats"] else "-")
    add("- planner: uniform routing, f = (E-1)/E",
        lambda r: f"{planner_figures(r['ep'], args.prompt)['alltoall_leaving_bytes_per_layer_token']:,.1f}"
        if r["ep_stats"] else "-")
    add("all-to-all rows sent MiB, both ranks: forward (bytes_sent) / forward + backward",
        ep_only(lambda e: f"{_mib(e['bytes_sent'])} / {_mib(e['alltoall_total'])}"))
    add("**(b)** pairs received per rank", ep_only(lambda e: ", ".join(f"{v:,.0f}"
                                                                  for v in e["pairs_received_per_rank"])))
    add("load imbalance (max / mean)", ep_only(lambda e: f"{e['load_imbalance']:.3f}"))
    base = next((r for r in rows if r["ep"] == 1), None)
    for r in rows:
        if r["ep_stats"] and base is not None:
            lines.append("")
            lines.append(f"EP {r['ep']} against EP 1: ZeRO-3 gathers {r['gather_total'] / base['gather_total']:.3f}x "
                         f"the bytes per step ({_mib(base['gather_total'] - r['gather_total'])} MiB less per rank); "
                         f"the dispatch sends {_mib(r['ep_stats']['alltoall_total'])} MiB over both ranks instead; "
                         f"step peak {r['step_peak'] / base['step_peak']:.2f}x, CPU seconds "
                         f"{r['cpu'] / base['cpu']:.2f}x (wall {r['seconds'] / base['seconds']:.2f}x: other work on "
                         "the cores stretches wall time).")
    return "\n".join(lines)


def _per_call_key(ep_size):
    return "zero3_gather_bytes_per_moe_call_ep" if ep_size > 1 else "zero3_gather_bytes_per_moe_call"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--group", type=int, default=2, help="responses per group (G)")
    parser.add_argument("--response", type=int, default=64, help="tokens per response")
    parser.add_argument("--steps", type=int, default=2, help="grpo_steps per configuration; the last is reported")
    parser.add_argument("--ep", default="1,2", help="EP sizes to compare (1 or 2)")
    parser.add_argument("--write", default=None, help="markdown file whose bench:ep-glm section to rewrite")
    parser.add_argument("--json", default=None, help="also save the raw per-rank results here")
    # the rank script's arguments
    add_rank_script_arguments(parser)
    parser.add_argument("--ep-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_script:
        rank_main(args)
        return 0
    command = "python bench/bench_ep.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows, raw = [], {}
    for ep_size in [int(e) for e in args.ep.split(",")]:
        started = time.perf_counter()
        ranks = launch(args, ep_size)
        print(f"EP {ep_size}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        raw[ep_size] = ranks
        rows.append(summarise(ep_size, ranks))
    text = report(args, rows, command.strip())
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(raw, handle, indent=1)
    if args.write:
        from ds_longstraw.tools.bench import write_section

        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
