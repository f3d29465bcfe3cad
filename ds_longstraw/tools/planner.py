"""`longstraw plan`: size the offload tiers before anything runs.

    longstraw plan --model glm-5.2 --context 2M --group-size 8 --gpus 32 --cp 32 --gpus-per-node 8 \\
                   --gpu-memory 96GB --host-memory 2TB --prefix-grad exact
    python -m ds_longstraw.tools.planner --model path/to/config.json --context 512K ...

Reports retained bytes per rank by layer type, what each tier needs of GPU, host and NVMe memory and whether it
fits, the recommended `offload` block (tier, staging depth) and the longest prompt each tier allows. For a model
with routed experts it also reports the weights per rank with and without expert parallelism (--ep), what ZeRO-3
gathers per call of a MoE block, and the EP all-to-all's bytes per MoE layer and token. With --new-tokens it
sizes rollouts too: the G samples' own state while they decode, with the weights per call and gathered whole
(`rollout.zero3_weights`), and the longest response each tier leaves room for. Memory the
command is not given is detected: host memory with psutil, the CPU with py-cpuinfo, the GPU with torch (when
one is visible), free NVMe space at --nvme-path. Sizes take a unit (96GB, 2TiB, 512M); a bare number is GiB.
The model of what costs what is in offload/plan.py; the byte figures come from the architecture's layer-state
specs (model_shape.py).
"""

import argparse
import json
import shutil
import sys

from ds_longstraw.config import parse_config
from ds_longstraw.models.model_shape import load_config, shape_from_config
from ds_longstraw.offload.auto import (
    KEEP_GRAPH_FRACTION,
    LAYER_MAJOR_DEVICE_FRACTION,
    LAYER_MAJOR_STATE_RATIO,
    gdn_scan_outputs,
    keeps_attention,
    layer_inputs_bytes,
    layer_major_prefix,
    layer_major_workspace,
    recomputed_inputs_bytes,
)
from ds_longstraw.offload.plan import TIERS, Cluster, GiB, make_plan, recommended_tier, rollout_figures
from ds_longstraw.sizes import parse_bytes, parse_tokens
from ds_longstraw.tools.cp_time import predict, unmodelled

KEEP_CHOICES = {"auto": "auto", "true": True, "false": False}  # --keep-attention -> longstraw.prefix_keep_attention


def _memory(text: str) -> int:
    """--gpu-memory, --host-memory, --nvme-free, --weights: bytes (ds_longstraw.sizes), where a bare number is GiB."""
    return parse_bytes(text, bare=GiB)


def _parser():
    p = argparse.ArgumentParser(prog="longstraw plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="qwen3.6-27b, glm-5.2, or a transformers config.json")
    p.add_argument("--context", required=True, type=parse_tokens, help="prompt tokens (2M = 2,097,152)")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--prefix-grad", choices=("detached", "exact"), default="detached", help="longstraw.prefix_grad")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in the job")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size (default: all GPUs)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: routed experts sharded over EP ranks, outside ZeRO (with --cp > 1 it "
                        "must equal --cp)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: min(gpus, 8)")
    p.add_argument("--gpu-memory", type=_memory, default=None, help="per GPU (default: detected)")
    p.add_argument("--host-memory", type=_memory, default=None, help="per node (default: detected)")
    p.add_argument("--nvme-path", default=None, help="where page files would go (free space is detected)")
    p.add_argument("--nvme-free", type=_memory, default=None, help="free NVMe space per node")
    p.add_argument("--weights", type=_memory, default=None, help="weights per rank (default: ZeRO-3 estimate)")
    p.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per parameter for that estimate")
    p.add_argument("--reserve", type=float, default=0.10, help="GPU fraction kept for activations")
    p.add_argument("--host-fraction", type=float, default=0.80, help="host memory fraction the tier may use")
    p.add_argument("--capture-chunk", type=int, default=4096, help="longstraw.capture_chunk")
    p.add_argument("--prefix-block", type=int, default=None,
                   help="longstraw.prefix_block (exact mode: carry checkpoints every min(capture-chunk, this) tokens)")
    p.add_argument("--keep-attention", nargs="?", choices=("auto", "true", "false"), const="true", default="auto",
                   help="longstraw.prefix_keep_attention (exact mode): what makes the prompt's attention more than "
                        "linear kept from capture (qwen3_5: the outputs and LSE; glm_moe_dsa: the selections); alone: "
                        "true; default auto (kept for glm_moe_dsa on one rank)")
    p.add_argument("--kept-attention-tier", choices=("none", "cpu", "nvme"), default=None,
                   help="longstraw.offload.kept_attention_tier: the kept outputs' own tier (default: the pages')")
    p.add_argument("--new-tokens", type=parse_tokens, default=None,
                   help="rollouts: the samples' max_new_tokens (sizes decoding G samples from the captured prompt)")
    p.add_argument("--cp-scan", choices=("auto", "one_pass", "two_pass"), default="auto",
                   help="longstraw.cp_scan (two_pass: the GDN capture holds nothing across the CP exchange; auto: "
                        "one_pass where those outputs take at most a quarter of the GPU)")
    p.add_argument("--cp-prefix", choices=("auto", "layer_major", "turns"), default="auto",
                   help="longstraw.cp_prefix (exact mode under CP: layer_major, every rank at once, keeps every "
                        "layer's input; turns, one rank after another; auto: layer_major where it runs)")
    p.add_argument("--cp-replay", choices=("auto", "gathered", "spread", "replicated"), default="auto",
                   help="longstraw.cp_replay (under CP: gathered, the whole prompt's pages on every GPU for the "
                        "replay; spread, queries to the pages' ranks; auto: gathered where they take at most 1/32 of "
                        "the GPU)")
    p.add_argument("--prefix-inputs-every", type=_inputs_every, default="auto",
                   help="longstraw.prefix_inputs_every (layer-major prefix pass: capture keeps every k-th layer's "
                        "input, the pass recomputes the rest of a group of k; auto: the smallest k that fits)")
    p.add_argument("--response-tokens", type=parse_tokens, default=1024,
                   help="the longest member's response: one replayed member's autograd graph scales with it")
    p.add_argument("--tool-tokens", type=parse_tokens, default=0,
                   help="an untrained span (a tool output) inside that member: from --member-span-capture tokens "
                        "up it runs in steps, its rows counted, its graph not")
    p.add_argument("--groups-per-document", type=int, default=1,
                   help="groups of a step whose prompts are this document and a question each (grpo_backward_shared)")
    p.add_argument("--member-span-capture", type=_span_capture, default=1024,
                   help="longstraw.member_span_capture (none: every member replayed whole)")
    p.add_argument("--trains", choices=("lora", "full"), default="lora",
                   help="what trains: LoRA adapters on a frozen body, or every weight (their gradients counted)")
    p.add_argument("--gpu-tflops", type=float, default=148.0,
                   help="dense bf16 peak per GPU for the CP time prediction (H20 148, H100 and H200 989)")
    p.add_argument("--dtype-bytes", type=int, default=None, help="bytes per state element (default: config dtype)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _replay_line(plan) -> str:
    """How the CP replay reaches the prompt's pages for this prompt (longstraw.cp_replay)."""
    if plan.replay == "gathered":
        return (f"Replay (longstraw.cp_replay {plan.cp_replay}): gathered, the whole prompt's pages"
                f"{' and their gradients' if plan.prefix_grad == 'exact' else ''} ({_gib(plan.gathered_pages)}) on "
                "each GPU while it runs, counted in GPU above; nothing crosses ranks per layer and block.")
    return (f"Replay (longstraw.cp_replay {plan.cp_replay}): {plan.replay}, the prompt's pages stay sharded; each "
            "attention layer exchanges queries and partials with every rank per replayed block.")


def _detect_host_memory():
    import psutil

    return psutil.virtual_memory().total


def _detect_cpu():
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info().get("brand_raw") or "unknown CPU"
    except Exception:  # py-cpuinfo probes the machine in several ways; any failure only loses a label
        return "unknown CPU"


def _detect_gpu_memory():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except Exception:
        pass
    return None


def _gib(n):
    return "-" if n is None else f"{n / GiB:,.2f} GiB"


def _tokens(n):
    if n is None:
        return "unbounded by the budgets given"
    return f"{n:,} ({n / 2**20:.2f}M)" if n >= 2**20 else f"{n:,}"


def render(plan, detected, gpu_tflops=148.0) -> str:
    s, lay = plan.shape, plan.cluster
    lines = [f"# longstraw plan: {s.name} ({s.family}, ~{s.params / 1e9:.1f}B parameters)", "",
             f"prompt {plan.context:,} tokens, G = {plan.group_size}, prefix_grad = {plan.prefix_grad}; "
             f"{lay.gpus} GPUs, "
             f"CP {lay.cp}, {lay.gpus_per_node} per node -> {plan.tokens_per_rank:,} captured tokens per rank.",
             f"per rank: GPU {_gib(lay.gpu_memory)}, weights {_gib(plan.weights_per_rank)}, state budget "
             f"{_gib(plan.gpu_budget)}; host budget {_gib(plan.host_budget)}; NVMe budget {_gib(plan.nvme_budget)}."]
    if detected:
        lines.append("detected: " + "; ".join(detected) + ".")
    lines += ["", "## Retained bytes per rank", "", "| state | layers | bytes per token (all its layers) | per rank |",
              "|---|---:|---:|---:|"]
    carry_layers = sum(s.carry_layers.values())
    rows = {label: (s.page_layers[label], per_token) for label, per_token in s.page_bytes_per_token.items()}
    rows.update({label: (s.carry_layers[label], "per sequence") for label in s.carry_bytes})
    rows.update({"carry_checkpoints": (carry_layers, "per chunk start"),
                 "gradient_pages": ("as the pages", s.grad_bytes_per_token),
                 "kept_attention_pages": s.kept_per_rank(lay.cp),
                 "layer_inputs": (-(-sum(s.combine_counts.values()) // plan.inputs_every),
                                  layer_inputs_bytes(s, 1, plan.inputs_every)),
                 "recomputed_inputs": (max(min(plan.inputs_every, sum(s.combine_counts.values())) - 1, 0),
                                       recomputed_inputs_bytes(s, 1, plan.inputs_every))})
    for key, value in plan.retained.items():
        layers, per_token = rows[key]
        if not layers or (not value and key in ("carry_checkpoints", "gradient_pages", "kept_attention_pages",
                                                "layer_inputs", "recomputed_inputs")):
            continue  # exact mode's extras in detached mode, or what the model does not have
        per_token = f"{per_token:,}" if isinstance(per_token, int) else per_token
        lines.append(f"| {key} | {layers} | {per_token} | {_gib(value)} |")
    lines.append(f"| total | | | {_gib(sum(plan.retained.values()))} |")
    lines += ["", "## Where it fits (per rank)", "",
              "| tier | staging depth | GPU | host | NVMe | fits | longest prompt |",
              "|---|---:|---:|---:|---:|---|---:|"]
    for tier in TIERS:
        n = plan.needs[tier]
        lines.append(f"| {tier} | {plan.depth[tier]} | {_gib(n['gpu'])} | {_gib(n['host'])} | {_gib(n['nvme'])} | "
                     f"{'yes' if plan.fits[tier] else 'no'} | {_tokens(plan.max_context[tier])} |")
    parts = ", ".join(f"{name} {_gib(size)}" for name, size in plan.workspace.items() if size)
    lines += ["", f"GPU includes the kernels' workspace, the largest of: {parts} (offload/plan.phase_workspace)."]
    lines.append(_graph_line(plan))
    if "gdn_scan" in plan.workspace:
        lines.append("gdn_scan: the Gated DeltaNet capture's outputs held across the CP exchange (longstraw.cp_scan "
                     f"{plan.cp_scan}: one pass); --cp-scan two_pass holds none and runs those layers' capture twice.")
    elif plan.cluster.cp > 1 and plan.shape.delta_heads:
        lines.append(f"longstraw.cp_scan {plan.cp_scan}: the Gated DeltaNet capture holds no outputs across the CP "
                     "exchange (two passes over those layers).")
    if plan.cluster.cp > 1:
        lines.append(_replay_line(plan))
    if plan.prefix_grad == "exact" and plan.cluster.cp == 1:
        lines.append(_kept_graph_line(plan))
    if "layer_major_prefix" in plan.workspace:
        lines.append("layer_major_prefix: what exact mode's layer-major CP prefix pass holds across a layer (beside "
                     "the layer_inputs kept with the pages); --cp-prefix turns holds one chunk's graph instead, and "
                     "keeps no layer inputs, for the time of one GPU's pass.")
    lines += _render_document(plan)
    lines += _render_moe(plan)
    lines += _render_rollout(plan)
    lines += _render_cp_time(plan, gpu_tflops)
    lines.append("")
    if plan.tier is None:
        lines.append("Nothing fits: add GPUs (a larger CP size), host memory or NVMe, or shorten the prompt"
                     + (" or the responses." if plan.rollout else "."))
    else:
        block = {"tier": plan.tier, "staging_depth": plan.depth[plan.tier]}
        if plan.tier == "nvme":
            block["nvme_path"] = "/local_nvme/longstraw"
        decoding = " and decoding the rollouts" if plan.rollout else ""
        lines.append(f"Recommended: \"offload\": {json.dumps(block)} (the first tier that fits the transaction"
                     f"{decoding}, fastest first).")
    return "\n".join(lines)


def _render_document(plan) -> list:
    """What a document shared by several groups changes (docs/trees.md): the captures per step, not the memory."""
    n = plan.groups_per_document
    if n == 1:
        return []
    if plan.cluster.cp > 1:
        how = ("each question replayed with each of its group's members" if plan.prefix_grad == "exact" else
               "each question held by each of its group's members (forward without a graph, its state a constant)")
        return ["", f"{n} groups per document (engine.grpo_step): at CP {plan.cluster.cp} the document is captured "
                f"once, sharded as any prompt, and {how} (grpo/flat_document.py); the figures above are one group's."]
    passes = " and runs one reverse pass over it" if plan.prefix_grad == "exact" else ""
    lockstep = (" Through engine.grpo_step under ZeRO-3 with several ranks each question runs with its group's "
                "members instead of captured (grpo/flat_document.py)." if plan.cluster.gpus > 1 else "")
    return ["", f"{n} groups per document (grpo_backward_shared): a step captures the document once instead of {n} "
            f"times{passes}, each question as its child; the figures above hold (the document's pages and one "
            f"question's at a time: measured 1.00-1.02x one group's peak, BENCHMARKS.md).{lockstep}"]


def _kept_graph_line(plan) -> str:
    """Exact mode on one rank: what capture's kept graph (longstraw.prefix_keep_graph "fits", grpo/kept_graph.py)
    may take: KEEP_GRAPH_FRACTION of what the recommended tier leaves free on the GPU, and the tokens that buys."""
    rule = (f"with prefix_keep_graph \"fits\" (the default keeps none) capture keeps its first segments' autograd "
            f"graph within {KEEP_GRAPH_FRACTION:.0%} of the GPU memory free when it starts, and the prefix pass runs "
            "no forward for them")
    tier = plan.tier
    if plan.gpu_budget is None:
        return f"Exact mode on one rank: {rule} (give --gpu-memory to size it)."
    if tier is None:
        return f"Exact mode on one rank: {rule} (no tier fits here, so none is left for it)."
    budget = int(KEEP_GRAPH_FRACTION * max(plan.gpu_budget - plan.needs[tier]["gpu"], 0))
    graph = plan.shape.replay_graph.get(plan.trains)
    if graph is None:
        return (f"Exact mode on one rank: {rule}: here about {_gib(budget)} beside the {tier} tier's needs (the "
                f"{plan.shape.family} family declares no graph figures: capture measures its graph as it goes).")
    captured = max(plan.context - 1, 0)
    kept = min(captured, budget // max(graph[0], 1))
    whole = " (the whole prompt)" if kept == captured else ""
    return (f"Exact mode on one rank: {rule}: here about {_gib(budget)} beside the {tier} tier's needs, "
            f"{kept:,} of the prompt's {captured:,} tokens{whole} at {_gib(graph[0])} a token (training "
            f"{'LoRA adapters' if plan.trains == 'lora' else 'every weight'}).")


def _graph_line(plan) -> str:
    trains = "LoRA adapters on a frozen body" if plan.trains == "lora" else "every weight"
    grads = f" and the trained weights' gradients, {_gib(plan.trained_grads)}," if plan.trained_grads else ""
    if plan.replay_graph is None:
        return (f"GPU does not include one replayed member's autograd graph: the {plan.shape.family} family declares "
                f"no figures for it (leave the GPU room for it); it includes{grads or ' no gradients,'} training "
                f"{trains} (--trains).")
    tools = ""
    if plan.tool_tokens:
        tools = (f", with a {plan.tool_tokens:,}-token tool span in steps (its rows and their gradients, "
                 f"{_gib(plan.tool_rows)}, and its steps' start carries, {_gib(plan.tool_carries)}, counted; its "
                 "graph not)" if plan.member_steps else
                 f", with a {plan.tool_tokens:,}-token tool span replayed whole (--member-span-capture)")
    return (f"GPU also includes one replayed member's autograd graph, {_gib(plan.replay_graph)} for a "
            f"{plan.response_tokens:,}-token response (--response-tokens){tools},{grads} training {trains} "
            f"(--trains).")


def _bytes(n):
    for unit, scale in (("TB", 1e12), ("GB", 1e9)):
        if n >= scale / 10:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 1e6:,.1f} MB"


def _render_cp_time(plan, gpu_tflops) -> list:
    """The CP schedules' predicted seconds per phase per rank (ds_longstraw/tools/cp_time.py says how), and the memory
    each schedule adds per rank."""
    lay = plan.cluster
    if lay.cp < 2:
        return []
    times = predict(plan.shape, plan.context, lay.cp, gpu_tflops, plan.inputs_every)
    if times is None:
        return ["", f"(No CP time prediction for {plan.shape.family}: its layers that combine by "
                f"{unmodelled(plan.shape)} have no time model, offload/kind_costs.py.)"]
    if plan.shape.select_layers:
        return _render_sparse_cp_time(plan, gpu_tflops, times)
    before, now = times["before"], times["now"]
    tokens = plan.tokens_per_rank
    scan = gdn_scan_outputs(plan.shape, tokens) if plan.shape.delta_heads else 0
    every = plan.inputs_every
    inputs = layer_inputs_bytes(plan.shape, tokens, every) + recomputed_inputs_bytes(plan.shape, tokens, every)
    held = layer_major_workspace(plan.shape, tokens)
    runs = _prefix_runs(plan)
    return ["", f"## Context parallelism: predicted seconds per rank ({gpu_tflops:g} dense bf16 TFLOPS per GPU)",
            "", "| phase | before: contiguous shards, two-pass GDN scan | now: zigzag, one pass | ratio "
            "| added memory per rank (now) |",
            "|---|---:|---:|---:|---|",
            f"| capture | {before.capture:,.0f} | {now.capture:,.0f} | {now.capture / before.capture:.2f} "
            f"| gdn_scan outputs {_gib(scan)} (cp_scan one_pass) |",
            f"| exact prefix pass, turns | {before.prefix:,.0f} | {times['turns_prefix']:,.0f} | 1.00 | none |",
            f"| exact prefix pass, layer-major | | {now.prefix:,.0f} | {now.prefix / before.prefix:.2f} "
            f"| layer_inputs {_gib(inputs)} on the pages' tier, {_gib(held)} held on the GPU across a layer |", "",
            f"Exact mode here runs the prefix pass {runs.replace('_', '-')} ({_auto_rule(plan)}), keeping every "
            f"{plan.inputs_every}-th layer's input (longstraw.prefix_inputs_every {plan.inputs_every_asked}: auto "
            "takes the smallest k that fits). From BENCHMARKS.md's H200 figures scaled by the GPUs' peaks "
            "(ds_longstraw/tools/cp_time.py); communication and replay not included.", *_layer_major_advice(plan, runs)]


def _prefix_runs(plan) -> str:
    """How exact mode's CP prefix pass runs at this plan's prompt and GPU (offload/auto.layer_major_prefix)."""
    lay = plan.cluster
    return "layer_major" if layer_major_prefix(plan.shape, lay.cp, "exact", plan.cp_prefix, plan.capture_chunk,
                                               plan.keep_attention, plan.inputs_every, plan.tokens_per_rank,
                                               lay.gpu_memory) else "turns"


def _auto_rule(plan) -> str:
    """The "auto" rule of the prefix schedule, in words (offload/auto.layer_major_fits)."""
    return (f"longstraw.cp_prefix {plan.cp_prefix}: layer-major where the layer inputs it adds on the pages' tier "
            f"are at most {LAYER_MAJOR_STATE_RATIO:g}x the transaction's own retained bytes and what it holds on the "
            f"GPU across a layer at most {LAYER_MAJOR_DEVICE_FRACTION:g} of the GPU's memory, "
            "offload/auto.layer_major_fits")


def _inputs_every(text):
    return text if text == "auto" else int(text)


def _span_capture(text):
    return None if text.lower() in ("none", "null") else parse_tokens(text)


def _layer_major_advice(plan, runs) -> list:
    """Where "auto" takes the turns but exact mode's layer-major pass fits these machines anyway (its added bytes
    outweigh the ratio, not the budgets), the line that says so: its tier and longest prompt beside the turns'."""
    if runs != "turns" or plan.cp_prefix != "auto":
        return []

    def exact(prefix):
        return make_plan(plan.shape, plan.context, plan.group_size, "exact", plan.cluster, plan.capture_chunk,
                         plan.keep_attention, None, plan.cp_scan, prefix, plan.inputs_every_asked,
                         plan.response_tokens, plan.trains, plan.tool_tokens, plan.member_span_capture)

    try:
        alternative = exact("layer_major")
    except ValueError:  # a family the layer-major pass does not run
        return []
    tier = recommended_tier(alternative)
    if tier is None:
        return []
    return ["", f"The layer-major pass fits these machines too: \"cp_prefix\": \"layer_major\" runs exact mode on "
            f"the {tier} tier (longest prompt {alternative.max_context[tier]:,} tokens, against "
            f"{exact('turns').max_context[tier]:,} in turns)."]


def _render_sparse_cp_time(plan, gpu_tflops, times) -> list:
    """The CP time table of a model whose layers attend a global top-k selection (cp_time.predict's `times`)."""
    shape = plan.shape
    before, now = times["before"], times["now"]
    tokens, every = plan.tokens_per_rank, plan.inputs_every
    inputs = layer_inputs_bytes(shape, tokens, every) + recomputed_inputs_bytes(shape, tokens, every)
    runs = _prefix_runs(plan)
    return ["", f"## Context parallelism: predicted seconds per rank ({gpu_tflops:g} dense bf16 TFLOPS per GPU)",
            "", "| phase | before: contiguous shards | now: zigzag | ratio | added memory per rank (now) |",
            "|---|---:|---:|---:|---|",
            f"| capture | {before.capture:,.0f} | {now.capture:,.0f} | {now.capture / before.capture:.2f} | none |",
            f"| exact prefix pass, turns | {before.prefix:,.0f} | {times['turns_prefix']:,.0f} | 1.00 | none |",
            f"| exact prefix pass, layer-major | | {now.prefix:,.0f} | {now.prefix / before.prefix:.2f} "
            f"| layer_inputs {_gib(inputs)} on the pages' tier, "
            f"{_gib(layer_major_workspace(shape, tokens))} held on the GPU across a layer |", "",
            f"Exact mode here runs the prefix pass {runs.replace('_', '-')} ({_auto_rule(plan)}), keeping every "
            f"{every}-th layer's input (longstraw.prefix_inputs_every "
            f"{plan.inputs_every_asked}; a base that reuses a selection made in a group below keeps it too). "
            f"{shape.active_params / 1e9:,.1f}B active parameters a token. The selection's scoring is the quadratic "
            "part: zigzag shards give every rank L^2 / 2N of its (query, key) pairs, where contiguous ones give the "
            "last rank (2N - 1) / N^2 of the L^2 / 2. From BENCHMARKS.md's H200 figures scaled by the GPUs' peaks "
            "(ds_longstraw/tools/cp_time.py); communication (the experts' all-to-all included) and replay not "
            "included.",
            *_layer_major_advice(plan, runs)]


def _render_moe(plan) -> list:
    """The routed experts' section (offload/plan.moe_figures): weights per rank, ZeRO-3's gather, all-to-all."""
    m, lay = plan.moe, plan.cluster
    if not m:
        return []
    ep = m["ep"]
    routed_zero3 = int(m["routed_params"] * lay.weight_bytes / lay.gpus)
    lines = ["", "## Routed experts", "",
             f"{m['layers']} MoE layers x {m['experts']} routed experts, top-{m['experts_per_token']}: "
             f"{m['routed_params'] / 1e9:,.1f}B of the {plan.shape.params / 1e9:,.1f}B parameters "
             f"(weights at {lay.weight_bytes:g} B per parameter).", "",
             f"| weights per rank | ZeRO-3 only | EP {ep} + ZeRO-3 |" if ep > 1 else "| weights per rank | ZeRO-3 |",
             "|---|---:|---:|" if ep > 1 else "|---|---:|"]
    where = f"ZeRO-3: / {lay.gpus} GPUs" + (f"; EP: / {ep}, held whole outside ZeRO" if ep > 1 else "")
    other = m["weights_per_rank_zero3"] - routed_zero3  # the same with and without EP
    rows = [(f"routed experts ({where})", routed_zero3, m["routed_weights_per_rank_ep"]),
            (f"other parameters (/ {lay.gpus} GPUs)", other, other),
            ("total", m["weights_per_rank_zero3"], m["weights_per_rank_ep"])]
    for label, zero3, with_ep in rows:
        lines.append(f"| {label} | {_gib(zero3)} | {_gib(with_ep)} |" if ep > 1 else f"| {label} | {_gib(zero3)} |")
    lines += ["", f"ZeRO-3 without EP gathers a MoE block whole on every call, all {m['experts']} experts with the "
              f"router and shared expert: {_bytes(m['zero3_gather_bytes_per_moe_call'])} per call on each rank; "
              f"the capture alone makes {m['capture_moe_calls']:,} such calls (one per MoE layer and capture chunk): "
              f"{_bytes(m['zero3_gather_bytes_capture'])} gathered per rank. With EP the block's ZeRO-3 gather is "
              f"the router and shared expert: {_bytes(m['zero3_gather_bytes_per_moe_call_ep'])} per call "
              f"({_bytes(m['zero3_gather_bytes_capture_ep'])} over the capture)."]
    hidden_bytes = plan.shape.moe.hidden_size * plan.shape.dtype_bytes
    if ep == 1:
        lines.append("With --ep E each rank would hold 1/E of the routed experts whole, outside ZeRO, and send its "
                     "tokens' routed pairs to their experts by all-to-all instead.")
        return lines
    lines += ["", f"EP {ep} all-to-all per MoE layer and token: its {m['experts_per_token']} routed pairs' hidden "
              f"vectors ({plan.shape.moe.hidden_size} x {plan.shape.dtype_bytes} B = {hidden_bytes:,} B) go out and "
              f"come back: {m['alltoall_bytes_per_layer_token']:,} B, of which {ep - 1}/{ep} leaves the rank "
              f"ASSUMING UNIFORM ROUTING (pairs spread evenly over the EP ranks): "
              f"{m['alltoall_leaving_bytes_per_layer_token']:,.0f} B per MoE layer and token. The capture's forward "
              f"over this rank's {plan.tokens_per_rank:,} prompt tokens ({m['layers']} MoE layers) sends "
              f"{_bytes(m['alltoall_leaving_bytes_capture'])} per rank; each further pass over a token (its replay, "
              "exact mode's prefix pass, a backward returning gradients) sends as much again."]
    return lines


def _render_rollout(plan) -> list:
    """Decoding the G samples (offload/plan.rollout_figures): their own state, and the GPU under each tier."""
    r = plan.rollout
    if not r:
        return []
    lines = ["", "## Rollouts (generate)", "",
             f"G = {plan.group_size} samples of up to {r['new_tokens']:,} new tokens, decoded from the captured "
             f"prompt (every CP rank decodes every sample): each keeps its own carry "
             f"({_gib(r['carry_per_sample'])}) and response rows ({plan.shape.bytes_per_token:,} B per token: "
             f"{_gib(r['rows_per_sample'])}); all of them {_gib(r['samples'])} per rank, plus "
             f"{_gib(r['logits'])} of a step's logits. `rollout.zero3_weights: whole` adds "
             f"{_gib(r['whole_weights_extra'])} per rank (the whole weights instead of the ZeRO-3 share).", "",
             "| tier | GPU while decoding, per_call | fits | longest response | GPU, whole | fits | longest response |",
             "|---|---:|---|---:|---:|---|---:|"]

    def fits(value):
        return "-" if value is None else "yes" if value else "no"

    def longest(value):
        return "-" if value is None else f"{value:,}"

    for tier in TIERS:
        cells = []
        for weights in ("per_call", "whole"):
            f = r[weights]
            cells += [_gib(f["gpu"][tier]), fits(f["fits"][tier]), longest(f["longest"][tier])]
        lines.append(f"| {tier} | " + " | ".join(cells) + " |")
    return lines


def as_dict(plan) -> dict:
    return {"model": plan.shape.name, "params": plan.shape.params, "context": plan.context,
            "group_size": plan.group_size, "prefix_grad": plan.prefix_grad, "tokens_per_rank": plan.tokens_per_rank,
            "retained_bytes_per_rank": plan.retained, "weights_per_rank": plan.weights_per_rank,
            "experts": plan.moe or None,
            "budgets": {"gpu": plan.gpu_budget, "host": plan.host_budget, "nvme": plan.nvme_budget},
            "needs": plan.needs, "fits": plan.fits, "staging_depth": plan.depth, "recommended_tier": plan.tier,
            "max_context": plan.max_context, "workspace_bytes": plan.workspace, "rollout": plan.rollout or None,
            "response_tokens": plan.response_tokens, "trains": plan.trains, "replay_graph_bytes": plan.replay_graph,
            "trained_grad_bytes": plan.trained_grads, "tool_tokens": plan.tool_tokens,
            "member_steps": plan.member_steps, "tool_rows_bytes": plan.tool_rows,
            "tool_carry_bytes": plan.tool_carries,
            "groups_per_document": plan.groups_per_document, "replay": plan.replay,
            "gathered_pages_bytes": plan.gathered_pages}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        name, config = load_config(args.model)
        shape = shape_from_config(name, config, args.dtype_bytes)
        detected = []
        gpu_memory = args.gpu_memory
        if gpu_memory is None:
            gpu_memory = _detect_gpu_memory()
            detected.append(f"GPU {_gib(gpu_memory)}" if gpu_memory else "no GPU visible (give --gpu-memory)")
        host_memory = args.host_memory
        if host_memory is None:
            host_memory = _detect_host_memory()
            detected.append(f"host {_gib(host_memory)} ({_detect_cpu()})")
        nvme_free = args.nvme_free
        if nvme_free is None and args.nvme_path:
            nvme_free = shutil.disk_usage(args.nvme_path).free
            detected.append(f"{_gib(nvme_free)} free at {args.nvme_path}")
        cp = args.cp or args.gpus
        cluster = Cluster(gpus=args.gpus, cp=cp, ep=args.ep, gpus_per_node=args.gpus_per_node or min(args.gpus, 8),
                        gpu_memory=gpu_memory, host_memory=host_memory, nvme_free=nvme_free,
                        weights_per_rank=args.weights, weight_bytes=args.weight_bytes,
                        reserve_fraction=args.reserve, host_fraction=args.host_fraction)
        # The stride capture checkpoints at in exact mode, as the transaction computes it (bad values are named).
        longstraw = parse_config({"prefix_grad": args.prefix_grad, "capture_chunk": args.capture_chunk,
                                 "prefix_block": args.prefix_block,
                                 "prefix_keep_attention": KEEP_CHOICES[args.keep_attention],
                                 "cp_size": cp, "cp_scan": args.cp_scan, "cp_prefix": args.cp_prefix,
                                 "cp_replay": args.cp_replay,
                                 "prefix_inputs_every": args.prefix_inputs_every,
                                 "member_span_capture": args.member_span_capture})
        plan = make_plan(shape, args.context, args.group_size, args.prefix_grad, cluster, longstraw.segment_tokens,
                         keeps_attention(longstraw.prefix_keep_attention, args.prefix_grad, cp,
                                         bool(shape.selecting)), args.kept_attention_tier, longstraw.cp_scan,
                         longstraw.cp_prefix, longstraw.prefix_inputs_every, args.response_tokens, args.trains,
                         args.tool_tokens, longstraw.member_span_capture, longstraw.cp_replay)
        if args.groups_per_document < 1:
            raise ValueError(f"--groups-per-document {args.groups_per_document}: at least 1 group asks of a document")
        plan.groups_per_document = args.groups_per_document
        if args.gpu_tflops <= 0:
            raise ValueError(f"--gpu-tflops {args.gpu_tflops}: a GPU's peak is positive")
        if args.new_tokens is not None:
            if args.new_tokens < 1:
                raise ValueError(f"--new-tokens {args.new_tokens}: a response has at least 1 new token")
            plan.rollout = rollout_figures(plan, args.new_tokens)
            plan.tier = recommended_tier(plan)  # decoding must fit too
    except (ValueError, OSError) as error:
        print(f"longstraw plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(as_dict(plan), indent=2) if args.json else render(plan, detected, args.gpu_tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
