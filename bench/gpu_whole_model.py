"""The GPU check's whole-model sections (bench/gpu_check.py runs them; `--dry-run` at toy sizes on the CPU).

    whole_qwen   the whole 64-layer Qwen3.6-27B shape in bfloat16, its body frozen with LoRA adapters (rank 16), the
                 pages on the host tier: GRPO steps detached and exact at growing prompts, each phase timed, the GPU
                 peak and the host peak beside the planner's figures for the same settings (offload/plan.make_plan)
    glm_layer    GLM-5.2's layer shape (64 heads, latent 512 + rope 64, DSA top-2048 over 32 indexer heads of 128):
                 two layers, a full and a shared indexer layer, dense MLPs, through the transaction, detached and
                 exact: the sparse attention's forward (capture, replay) and backward (replay, prefix pass)

A step is skipped, saying so, where its predicted time (the last measured step scaled by the prompt's growth, the
quadratic attention term included) would overrun the section's deadline: the device time is the budget.

Measured: torch.cuda.max_memory_allocated over the whole step (weights included), and the process's host
high-water mark (VmHWM, reset before the step) above its resident set before it. Planned: the weights measured plus
the plan's GPU needs for the tier (pages staged a layer at a time, the carry, the largest workspace, one member's
replay graph for the section's response length, and, training every weight, their gradients), and its host needs
(pages, gradient pages and checkpoints). "gpu_vs_plan" is measured / planned.
"""

import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
GIB = 2 ** 30


def _shape_fields(name, overrides):
    import yaml  # plain YAML: omegaconf (the launcher's reader) need not be installed on the GPU machine

    with open(os.path.join(ROOT, "configs", "models", name)) as handle:
        return {**yaml.safe_load(handle), **overrides}


def build_model(name, overrides, device, dtype, lora):
    """A transformers model of the shape file `name` (random weights) on `device`; with `lora`, peft adapters on a
    frozen body. Returns (model, config, note): note names what trains."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_longstraw.models.modeling import config_from_shape

    config = config_from_shape(_shape_fields(name, overrides))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not lora:
        return model.train(), config, "every weight"
    from ds_longstraw.models.lora import apply_lora

    model = apply_lora(model, r=16, alpha=32, seed=0)
    # peft keeps the adapters in float32 over a bfloat16 body, casting every projection's input to float32 (a
    # profiled 16K step on the H200: a quarter of the device time in copies, float32 GEMMs beside the bf16 ones);
    # the DeepSpeed engine casts every parameter to bf16 (its optimizer keeps the float32 masters), so a trained
    # model runs its adapters in the body's dtype: time that
    model = model.to(dtype)
    return model.train(), config, "LoRA r 16 on a frozen body"


def planned(config, context, group, mode, capture_chunk, tier, weight_bytes, device, response_tokens, trains):
    """The planner's GPU and host figures (bytes) for one step of this model on this machine."""
    import psutil
    import torch

    from ds_longstraw.models.model_shape import shape_from_config
    from ds_longstraw.offload.plan import Cluster, make_plan

    gpu_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    shape = shape_from_config("gpu_check", config, dtype_bytes=2 if device.type == "cuda" else 4, parameters=False)
    cluster = Cluster(gpus=1, cp=1, gpu_memory=gpu_memory, host_memory=psutil.virtual_memory().total,
                    weights_per_rank=weight_bytes)
    plan = make_plan(shape, context, group, mode, cluster, capture_chunk=capture_chunk,
                     response_tokens=response_tokens, trains=trains)
    needs = plan.needs[tier]
    return {"gpu": weight_bytes + needs["gpu"], "host": needs["host"], "fits": plan.fits[tier],
            "retained": sum(v for k, v in plan.retained.items() if k.endswith("_pages"))}


class Steps:
    """Runs GRPO steps of one model and reports a row each, skipping what would overrun the deadline."""

    def __init__(self, report, section, model, config, device, longstraw, deadline, note):
        self.report, self.section, self.model, self.config = report, section, model, config
        self.device, self.longstraw, self.deadline, self.note = device, longstraw, deadline, note
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.timed = {}  # mode -> (prompt, seconds) of the last step measured

    def predict(self, prompt, mode, kernels="auto"):
        """Seconds the step should take: the last measured step of this mode (else of detached, times 3 for exact's
        prefix pass) scaled by the prompt's growth, the attention's quadratic term counted as a tenth of the step;
        the torch kernels at 5x (the Triton kernels' H200 ratios, BENCHMARKS.md)."""
        base = self.timed.get(mode) or self.timed.get("detached")
        if base is None:
            return 0.0
        ratio = prompt / base[0]
        seconds = base[1] * (0.9 * ratio + 0.1 * ratio * ratio)
        return seconds * (3.0 if mode not in self.timed else 1.0) * (5.0 if kernels == "reference" else 1.0)

    def run(self, prompt, mode, kernels="auto", report=True):
        import torch

        from ds_longstraw.grpo.memory import HostPeakUnavailable, host_current_bytes, host_peak_bytes, reset_host_peak
        from ds_longstraw.grpo.transaction import grpo_backward
        from ds_longstraw.models.shapes import synthetic_group
        from ds_longstraw.objective import GRPOObjective

        s = self.longstraw
        row = {"prompt": prompt, "mode": mode, "kernels": kernels, "layers": self.config.num_hidden_layers,
               "G": s["group"], "response": s["response"], "trains": self.note}
        left = self.deadline - time.monotonic()
        predicted = self.predict(prompt, mode, kernels)
        tier = s["tier"]
        plan = planned(self.config, prompt, s["group"], mode, s["capture_chunk"], tier, self.weight_bytes,
                       self.device, s["response"], "lora" if self.note.startswith("LoRA") else "full")
        row.update(planned_gpu_gib=plan["gpu"] / GIB, planned_host_gib=plan["host"] / GIB, plan_fits=plan["fits"])
        # a margin of 1.5: the prediction scales one measured step, and a step that overruns the call loses every
        # figure the call has not written yet (a first H200 call went 60 s past its budget and returned nothing)
        if predicted * 1.5 > left:
            row["seconds"] = f"skipped: predicted {predicted:.0f} s > {max(left, 0):.0f} s left"
            self.report.add(self.section, row)
            return None
        cuda = self.device.type == "cuda"
        self.model.zero_grad(set_to_none=True)
        group = synthetic_group(prompt, s["group"], s["response"], self.config.vocab_size, seed=prompt)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        resident = host_current_bytes()
        try:
            reset_host_peak()
            host_measured = True
        except HostPeakUnavailable:  # no /proc/self/clear_refs: the row says so rather than report an old peak
            host_measured = False
        config = {"prefix_grad": mode, "capture_chunk": s["capture_chunk"], "kernels": kernels,
                  "offload": {"tier": tier}}
        start = time.perf_counter()
        try:
            result = grpo_backward(self.model, group, GRPOObjective(), longstraw=config)
        except torch.cuda.OutOfMemoryError:
            row["seconds"] = "OOM"
            self.report.add(self.section, row)
            return None
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if not report:  # a warm-up: its time holds the kernels' compilation, no figure to predict from
            return result
        if kernels == "auto":
            self.timed[mode] = (prompt, seconds)
        gpu_peak = torch.cuda.max_memory_allocated() if cuda else None
        host_peak = host_peak_bytes() - resident if host_measured else None
        phases = ", ".join(f"{name} {stats.seconds:.1f} s" for name, stats in result.phases.items())
        row.update(seconds=seconds, prompt_tokens_per_s=prompt / seconds, loss=result.loss, phases=phases,
                   gpu_peak_gib=None if gpu_peak is None else gpu_peak / GIB,
                   gpu_vs_plan=None if gpu_peak is None else gpu_peak / plan["gpu"],
                   host_peak_gib=None if host_peak is None else host_peak / GIB,
                   host_vs_plan=host_peak / plan["host"] if plan["host"] and host_peak is not None else None,
                   retained_gib=sum(result.retained_bytes.values()) / GIB,
                   weights_gib=self.weight_bytes / GIB)
        self.report.add(self.section, row)
        return result


def whole_qwen_section(report, device, dtype, sizes, deadline):
    """The whole Qwen3.6-27B shape: a warm-up step (compiles the kernels, not reported), then detached and exact
    at each prompt length, shortest first, while the predicted time fits."""
    started = time.monotonic()
    model, config, note = build_model("qwen3_6_27b.yaml", sizes["shape"], device, dtype, lora=True)
    built = time.monotonic()
    steps = Steps(report, "whole_qwen", model, config, device, sizes, deadline, note)
    steps.run(sizes["warmup"], "detached", report=False)
    warm = time.monotonic()
    steps.run(sizes["warmup"], "exact", report=False)
    # where the section's fixed cost goes (149 s in all on the H200's first run, unsplit there)
    print(f"[gpu_check] whole_qwen: model built in {built - started:.0f} s, detached warm-up {warm - built:.0f} s, "
          f"exact warm-up {time.monotonic() - warm:.0f} s", flush=True)
    if sizes.get("profile"):
        profile_step(steps, sizes["profile"], os.path.join(report.out_dir, "whole_qwen_profile.txt"))
    # every length detached first: the longest prompt's detached step is worth more than the shortest exact one
    for mode in ("detached", "exact"):
        for prompt in sizes["prompts"]:
            steps.run(prompt, mode)
    del model, steps


def profile_step(steps, prompt, path):
    """One detached step of `prompt` tokens under torch.profiler: the operators by their own device time, to say
    where the capture's time goes (it is most of a detached step). Written to `path`; the top rows printed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if steps.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        steps.run(prompt, "detached", report=False)
        if steps.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if steps.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    with open(path, "w") as handle:
        handle.write(f"one detached step, prompt {prompt} tokens, sorted by {key}\n{table}\n")
    print("\n".join(table.splitlines()[:16]), flush=True)


def glm_layer_section(report, device, dtype, sizes, deadline):
    """GLM-5.2's layer shape through the transaction: the fast kernels against the torch ones on the same group
    in detached mode (the torch kernels' exact step would cost minutes of device time), and the fast exact step."""
    model, config, note = build_model("glm_5_2.yaml", sizes["shape"], device, dtype, lora=False)
    steps = Steps(report, "glm_layer", model, config, device, sizes, deadline, note)
    steps.run(sizes["warmup"], "detached", report=False)
    for prompt in sizes["prompts"]:
        steps.run(prompt, "detached")
        steps.run(prompt, "detached", kernels="reference")
        steps.run(prompt, "exact")
    del model, steps


def agent_decode_section(report, device, dtype, sizes, deadline):
    """Agent rollouts on the whole Qwen3.6-27B shape (bench/bench_agent_rollouts.py's configurations, weights frozen,
    no training): G samples taking turns with 8K-token observations after a 16K prompt, and one turn at the context
    each turn starts at; the turns' full-batch decode steps against the one-turn step at the same context (wall
    time: each step ends in a device-to-host copy of the logits, so a step's clock includes its kernels). On the
    CPU's small shape the private observation keys dominate a step; with 27B weights read every step they should
    not: this measures it."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_agent_rollouts import WALL_CLOCK, matched_speed, measure

    model, config, note = build_model("qwen3_6_27b.yaml", sizes["shape"], device, dtype, lora=False)
    model.eval()
    longstraw = {"capture_chunk": sizes["capture_chunk"], "page_tokens": sizes["page_tokens"]}
    shared = dict(prompt=sizes["prompt"], samples=sizes["group"], turns=sizes["turns"],
                  observation=sizes["observation"], actions=sizes["actions"], longstraw=longstraw)
    measure(model, "one_turn", **{**shared, "prompt": sizes["warmup"]})  # compiles the kernels: not reported
    rows, references = [], []
    plan = [("turns", None)] + [("one_turn", k) for k in range(sizes["turns"] + 1)]
    for kind, context_turns in plan:
        if time.monotonic() > deadline:
            report.add("agent_decode", {"kind": kind, "context_turns": context_turns, "seconds": "skipped: budget"})
            continue
        row = measure(model, kind, context_turns=context_turns, **shared)
        row.update(context_turns=context_turns, trains=note)
        (references if kind == "one_turn" else rows).append(row)
        steps = row.pop("steps")
        row["decode_steps"] = len(steps)
        report.add("agent_decode", row)
        row["steps"] = steps
        print(f"[gpu_check] agent_decode {kind} at {row['prompt']:,} tokens: "
              f"{row['full_batch_tokens_per_second']:.1f} tokens/s at a full batch", flush=True)
    if rows and len(references) >= 2:
        ratio = matched_speed(rows[0], references, clock=WALL_CLOCK)
        report.add("agent_decode", {"kind": "summary", "full_batch_speed_vs_one_turn_at_same_context": ratio})
        print(f"[gpu_check] agent_decode: turns at {ratio:.2f}x one turn at the same context (full batch)",
              flush=True)
    del model


def sizes_for(dry_run):
    if dry_run:
        tiny_qwen = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 512}
        tiny_glm = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                    "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
                    "first_k_dense_replace": 2, "indexer_types": ["full", "shared"], "vocab_size": 512}
        return {
            "whole_qwen": {"shape": tiny_qwen, "warmup": 48, "profile": 48, "prompts": [64, 96], "group": 2,
                           "response": 16,
                           "capture_chunk": 32, "tier": "cpu"},
            "glm_layer": {"shape": tiny_glm, "warmup": 48, "prompts": [64], "group": 2, "response": 16,
                          "capture_chunk": 32, "tier": "none"},
            "agent_decode": {"shape": tiny_qwen, "warmup": 32, "prompt": 64, "observation": 32, "turns": 2,
                             "group": 2, "actions": 8, "capture_chunk": 32, "page_tokens": 16},
        }
    return {
        # all 64 layers at the shape file's widths; pages on the host (offload.tier "cpu"), G = 4 as in the paper's
        # smaller group, responses of 512..1,024 tokens
        # profile: one 16K step under torch.profiler (the capture's 1,923 tokens/s at 64K is unexplained)
        "whole_qwen": {"shape": {}, "warmup": 4096, "profile": 16384, "prompts": [65536, 262144, 1048576],
                       "group": 4, "response": 1024, "capture_chunk": 8192, "tier": "cpu"},
        # two layers (a full and a shared indexer layer), dense MLPs: the routed experts are not what this times
        "glm_layer": {"shape": {"num_hidden_layers": 2, "first_k_dense_replace": 2,
                                "indexer_types": ["full", "shared"]},
                      "warmup": 4096, "prompts": [32768], "group": 4, "response": 1024, "capture_chunk": 8192,
                      "tier": "none"},
        # issue 45's sizes: G = 4, 4 turns of 8,192-token observations after a 16,384-token prompt, bf16 weights
        # (54 GB) and the samples' rows on the device
        "agent_decode": {"shape": {}, "warmup": 1024, "prompt": 16384, "observation": 8192, "turns": 4, "group": 4,
                         "actions": 64, "capture_chunk": 8192, "page_tokens": 1024},
    }


def pyplot():
    """matplotlib's pyplot on a file backend, or None, saying so, where it is not installed (the GPU machine's
    packages are its own)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[gpu_check] no plot: matplotlib is not installed", flush=True)
        return None
    return plt


def plot_whole_qwen(report, path):
    """Seconds and GPU peak against prompt tokens, detached and exact, with the planner's GPU figure dashed beside
    each measured peak. Skipped, saying so, without matplotlib or without a measured step."""
    rows = [row for row in report.sections.get("whole_qwen", {}).get("rows", [])
            if isinstance(row.get("seconds"), float)]
    plt = pyplot() if rows else None
    if plt is None:
        return
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("detached", "tab:blue"), ("exact", "tab:red")):
        points = sorted((row["prompt"], row) for row in rows if row["mode"] == mode)
        if not points:
            continue
        prompts = [prompt for prompt, _ in points]
        axes[0].plot(prompts, [row["seconds"] for _, row in points], "o-", color=color, label=mode)
        if points[0][1]["gpu_peak_gib"] is not None:
            axes[1].plot(prompts, [row["gpu_peak_gib"] for _, row in points], "o-", color=color,
                         label=f"{mode}, measured")
        axes[1].plot(prompts, [row["planned_gpu_gib"] for _, row in points], "--", color=color,
                     label=f"{mode}, planned")
    for ax, label in ((axes[0], "step seconds"), (axes[1], "GPU peak, weights included (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    first = rows[0]
    figure.suptitle(f"Qwen3.6-27B shape, {first['layers']} layers, {first['trains']}, host tier, G = {first['G']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"[gpu_check] plot: {path}", flush=True)
