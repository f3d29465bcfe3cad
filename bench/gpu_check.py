"""The GPU check: each fast path timed beside its library peer and its torch fallback, GLM-5.2's layer shape through
the transaction, then GRPO steps of the whole 64-layer Qwen3.6-27B shape (LoRA, host tier) detached and exact at
growing prompts beside the planner's figures (bench/gpu_whole_model.py). bench/gpu_check.sh runs it (after the CUDA
parity tests); `--dry-run` runs every section at toy sizes on the CPU, so the script cannot rot unseen.

    python bench/gpu_check.py [--dry-run] [--out DIR] [--budget SECONDS] [--sections a,b,...]

Writes DIR/gpu_check.json (every row, and each section's kernel paths) and DIR/gpu_check.md (the tables for
BENCHMARKS.md) after each section, so a run cut short keeps what it measured; at the end DIR/whole_qwen.png (and
DIR/grpo_step.png where the 4-layer ladder ran). A section that fails records its error and the next one runs.

Timing: CUDA events around forward + backward, the median of `repeats` after one warm-up; memory:
torch.cuda.max_memory_allocated during the op minus what was allocated before it (inputs excluded). On the CPU
(dry run) wall-clock and no memory figure: the dry run proves the code paths, not speed.

Paths per kernel:
    fast       the dispatch's choice (kernels/dispatch.py, mode "auto"): flash / fla / Triton on CUDA
    fast_cudnn the same call with dispatch.attention_library "cudnn" (the second library that returns the lse)
    peer       the library's own public entry where one exists (torch SDPA for attention; full log-softmax)
    reference  mode "reference": the project's plain torch kernel
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (run with -P, which leaves it out)

from gpu_whole_model import (  # noqa: E402
    agent_decode_section,
    glm_layer_section,
    plot_whole_qwen,
    pyplot,
    whole_qwen_section,
)

MIB = 2 ** 20


class Clock:
    """Median seconds of a callable and its peak extra memory on `device`."""

    def __init__(self, device, repeats):
        self.device, self.repeats = device, repeats

    def measure(self, fn):
        import torch

        fn()  # warm-up: compiles Triton kernels, picks cuBLAS algorithms
        times = []
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() - base) / MIB if cuda else None
        return statistics.median(times), peak


class Report:
    def __init__(self, out_dir, dry_run, environment=None):
        self.out_dir, self.dry_run, self.environment = out_dir, dry_run, environment or {}
        self.sections = {}
        os.makedirs(out_dir, exist_ok=True)

    def add(self, section, row):
        self.sections.setdefault(section, {"rows": [], "error": None})["rows"].append(row)
        print(f"[gpu_check] {section}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        self.write()  # after every row: a call cut off at its limit still returns what it measured
        self.write()  # every row on disk at once: a run killed at its time limit keeps what it measured

    def fail(self, section, error):
        self.sections.setdefault(section, {"rows": [], "error": None})["error"] = error
        print(f"[gpu_check] {section} FAILED:\n{error}", flush=True)

    def paths(self, section, taken):
        """The kernel paths the section's calls took (kernels/dispatch.paths_taken): what "fast" really ran."""
        self.sections.setdefault(section, {"rows": [], "error": None})["paths"] = taken

    def write(self):
        from ds_longstraw.kernels.dispatch import format_paths

        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as handle:
            json.dump({"environment": self.environment, "dry_run": self.dry_run, "sections": self.sections}, handle,
                      indent=1)
        lines = [f"Environment: {', '.join(f'{k} {v}' for k, v in self.environment.items())}", ""]
        for name, section in self.sections.items():
            lines.append(f"### {name}")
            rows = section["rows"]
            if rows:
                keys = list(rows[0])
                lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
                lines += ["| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |" for row in rows]
            if section.get("paths"):
                lines.append("\nPaths taken: " + format_paths(section["paths"]))
            if section["error"]:
                lines.append(f"\nFAILED: {section['error'].strip().splitlines()[-1]}")
            lines.append("")
        with open(os.path.join(self.out_dir, "gpu_check.md"), "w") as handle:
            handle.write("\n".join(lines))


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


# ---- kernels ---------------------------------------------------------------------------------------------------

def planned_mib(kernel, tokens, dtype, **widths):
    """The planner's workspace for one forward + backward call of `kernel` over `tokens`
    (offload/plan.kernel_workspace in exact mode), in MiB, beside each measured peak. The measured peak also
    holds what the planner counts elsewhere (the call's inputs' gradients: gradient pages, d(hidden), d(weight)),
    so on the fast path the measured peak should exceed this by about those; a measured peak far above says the
    planner undercounts that kernel's scratch."""
    from ds_longstraw.offload.plan import kernel_workspace
    from ds_longstraw.offload.state_shape import ModelShape

    shape = ModelShape(name="gpu_check", family="kernel", dtype_bytes=dtype.itemsize, **widths)
    return kernel_workspace(shape, capture_chunk=tokens, replay_block=tokens, prefix_grad="exact")[kernel] / MIB


def attention_section(report, clock, device, dtype, sizes):
    """One replay block of queries over a prompt's keys: forward + backward (dq, dk, dv) of partial attention."""
    import torch
    import torch.nn.functional as F

    from ds_longstraw.kernels import partial_attention
    from ds_longstraw.kernels.attention import partial as attention
    from ds_longstraw.kernels.attention import triton_paged as paged
    from ds_longstraw.kernels.dispatch import kernel_mode, use_attention_library

    heads, kv_heads, head_dim, tq = sizes["heads"], sizes["kv_heads"], sizes["head_dim"], sizes["tq"]
    for tk in sizes["tk"]:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(heads, tq, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(kv_heads, tk, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(kv_heads, tk, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        dout = torch.randn(heads, tq, head_dim, device=device, dtype=dtype, generator=gen)

        def ours():
            out, _ = partial_attention(q, k, v, head_dim ** -0.5)
            torch.autograd.grad(out, (q, k, v), dout)

        def reference():
            with kernel_mode("reference"):
                ours()

        def peer():  # torch SDPA: no lse to merge partials with, the speed to match
            out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), dout.unsqueeze(0))

        def ours_constant_keys():  # detached mode's prompt pages: dq only (LIBRARY_KEY_BLOCK-key library calls)
            out, _ = partial_attention(q, k.detach(), v.detach(), head_dim ** -0.5)
            torch.autograd.grad(out, (q,), dout)

        # the same call on tensors stored token-major ([T, heads, D], as flash reads them) and handed over as
        # head-major views: if this row matches the peer, the gap is the strided views of head-major pages
        q_tm, k_tm, v_tm = (x.detach().transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))

        def ours_token_major_storage():
            out, _ = partial_attention(q_tm.transpose(0, 1), k_tm.transpose(0, 1), v_tm.transpose(0, 1),
                                       head_dim ** -0.5)
            torch.autograd.grad(out, (q_tm, k_tm, v_tm), dout)

        def ours_cudnn():  # the second library candidate (kernels/attention/cudnn.py) through the same dispatch
            with use_attention_library("cudnn"):
                ours()

        def ours_cudnn_constant_keys():
            with use_attention_library("cudnn"):
                ours_constant_keys()

        paths = [("fast", ours), ("fast_token_major_storage", ours_token_major_storage),
                 ("fast_constant_keys", ours_constant_keys), ("peer", peer)]
        if device.type == "cuda":  # cuDNN serves CUDA tensors only
            paths += [("fast_cudnn", ours_cudnn), ("fast_cudnn_constant_keys", ours_cudnn_constant_keys)]
        if device.type == "cuda":  # which SDPA backend sets the peer's pace (each alone; a missing one is skipped)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                def forced(backend=getattr(SDPBackend, name)):
                    with sdpa_kernel(backend):
                        peer()
                try:
                    forced()
                except RuntimeError:
                    continue
                paths.append((f"peer_{name.split('_')[0].lower()}", forced))
        # The backward alone on constant keys: the library's LIBRARY_KEY_BLOCK-key calls (flash on CUDA, which
        # computes dK/dV and drops them) against the Triton paged kernel's dq kernel where it runs (dq only, no dK/dV
        # work): the figure that decides which should serve detached mode's prompt pages.
        with torch.no_grad():
            out, lse = partial_attention(q, k, v, head_dim ** -0.5)

        def backward_library_calls():
            attention._backward(q, k, v, out, lse, dout, None, head_dim ** -0.5, None, attention.KEY_BLOCK, False)

        paths += [("backward_constant_keys", backward_library_calls), ("reference", reference)]
        if paged.triton_applies(q, k):  # last: a kernel never compiled before cannot cost the rows above
            def backward_triton_dq():
                paged.segment_backward(q, k, v, out, lse, dout, None, head_dim ** -0.5, None, False)

            paths.append(("backward_constant_keys_triton_dq", backward_triton_dq))
        flops = 4 * heads * tq * tk * head_dim * 2.5  # forward 2 matmuls, backward 5 (in units of 2*m*n*k / 2)
        planned = planned_mib("attention", tq, dtype, attention_heads=heads, attention_head_dim=head_dim,
                              attention_kv_heads=kv_heads)
        for path, fn in paths:
            seconds, peak = clock.measure(fn)
            report.add("attention", {"tq": tq, "tk": tk, "path": path, "ms": seconds * 1e3,
                                     "key_tokens_per_s": tk / seconds, "tflops": flops / seconds / 1e12,
                                     "peak_mib": peak, "planned_mib": planned})
        if device.type == "cuda":
            cudnn_probe(report, clock, q, k, v, dout, out, lse, head_dim ** -0.5, flops)


def cudnn_probe(report, clock, q, k, v, dout, flash_out, flash_lse, scale, flops):
    """cuDNN's attention through its aten entry, which (unlike SDPA) returns the lse a merged attention needs: the
    candidate if SDPA's pace comes from cuDNN (not dispatched). Two rows: K/V heads grouped as the pages hold them,
    and expanded to one per query head (the way round, should the entry refuse groups). Each records its time
    (forward + autograd backward), how its output and lse compare with the flash path's on the same tensors
    (unmasked), and whether its backward entry called directly (as the lse-gradient fold of attention/flash.py
    would call it, with out' in place of out) gives autograd's dq; or the error where the entry refuses."""
    import torch

    group = q.shape[0] // k.shape[0]
    keys = ("ms", "tflops", "peak_mib", "lse_shape", "out_max_diff", "lse_max_diff", "direct_dq_max_diff", "error")
    dout4 = dout.unsqueeze(0)
    for heads in ("grouped", "expanded"):
        row = {"tq": q.shape[1], "tk": k.shape[1], "kv_heads": heads, **dict.fromkeys(keys)}  # every key, every row
        kv = (k, v) if heads == "grouped" else (k.repeat_interleave(group, 0), v.repeat_interleave(group, 0))
        q4, k4, v4 = (x.detach().unsqueeze(0).requires_grad_() for x in (q, *kv))

        def forward(q4=q4, k4=k4, v4=v4):
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, False, False,
                                                                      scale=scale)

        def cudnn(q4=q4, k4=k4, v4=v4, forward=forward):
            torch.autograd.grad(forward()[0], (q4, k4, v4), dout4)

        try:
            out4, lse4, cum_q, cum_k, max_q, max_k, seed, offset, _ = forward()
            row["lse_shape"] = "x".join(map(str, lse4.shape))
            row["out_max_diff"] = (out4[0].float() - flash_out.float()).abs().max().item()
            row["lse_max_diff"] = (lse4.reshape(flash_lse.shape).float() - flash_lse.float()).abs().max().item()
            dq = torch.autograd.grad(out4, q4, dout4)[0]
            direct = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout4, q4.detach(), k4.detach(), v4.detach(), out4.detach(), lse4, seed, offset, None, cum_q,
                cum_k, max_q, max_k, 0.0, False, scale=scale)
            row["direct_dq_max_diff"] = (direct[0].float() - dq.float()).abs().max().item()
            seconds, peak = clock.measure(cudnn)
            row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12, peak_mib=peak)
        except Exception as error:  # noqa: BLE001 -- the probe's answer may be that this entry refuses the case
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        report.add("attention_cudnn_probe", row)


def delta_rule_section(report, clock, device, dtype, sizes):
    """The gated delta rule over T tokens with an initial state: forward + backward."""
    import torch

    from ds_longstraw.kernels import chunk_gated_delta_rule
    from ds_longstraw.kernels.dispatch import kernel_mode

    hk, hv, dk, dv = sizes["hk"], sizes["hv"], sizes["dk"], sizes["dv"]
    for t in sizes["t"]:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k = (torch.randn(1, t, hk, dk, device=device, dtype=dtype, generator=gen).requires_grad_()
                for _ in range(2))
        v = torch.randn(1, t, hv, dv, device=device, dtype=dtype, generator=gen).requires_grad_()
        g = (-torch.rand(1, t, hv, device=device, generator=gen) * 0.1).to(dtype).requires_grad_()
        beta = torch.rand(1, t, hv, device=device, dtype=dtype, generator=gen).requires_grad_()
        h0 = torch.zeros(1, hv, dk, dv, device=device, dtype=torch.float32, requires_grad=True)

        def ours():
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
            torch.autograd.grad(out.float().sum() + final.sum(), (q, k, v, g, beta, h0))

        def reference():
            with kernel_mode("reference"):
                ours()

        def ours_forward():  # capture: no autograd (fla's forward serves where its backward is refused)
            with torch.no_grad():
                chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)

        def reference_forward():
            with kernel_mode("reference"):
                ours_forward()

        planned = planned_mib("delta_rule", t, dtype, delta_heads=hv, delta_head_dims=dk + dv)
        for path, fn in (("fast", ours), ("reference", reference), ("fast_forward", ours_forward),
                         ("reference_forward", reference_forward)):
            seconds, peak = clock.measure(fn)
            report.add("gated_delta", {"tokens": t, "path": path, "ms": seconds * 1e3, "tokens_per_s": t / seconds,
                                       "peak_mib": peak, "planned_mib": planned})


def logprobs_section(report, clock, device, dtype, sizes):
    """Log-probs of one replay block's targets under the LM head: forward + backward (d hidden, and d weight for a
    trained head; a frozen head's d hidden comes from the chunked forward itself). The Triton kernels ("triton")
    run where the dispatch would allow them (CUDA, mode "auto", triton importable)."""
    import torch

    from ds_longstraw.kernels import chunked_logprobs, logprobs_reference
    from ds_longstraw.kernels.dispatch import fast_path
    from ds_longstraw.kernels.logprobs import chunked as logprobs_module
    from ds_longstraw.kernels.logprobs import triton_fused as triton_lp

    tokens, hidden, vocab = sizes["tokens"], sizes["hidden"], sizes["vocab"]
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    paths = [("chunked", chunked_logprobs), ("full_logits", logprobs_reference)]
    if fast_path(h, "triton"):  # last: never compiled before this check
        paths.append(("chunked_triton_steps", chunked_logprobs))  # cuBLAS matmuls, elementwise in one Triton pass
    if fast_path(h, "triton") and triton_lp.supported(h, w):
        paths.append(("triton", triton_lp.triton_logprobs))
    frozen = w.detach()  # a frozen head (LoRA): d(hidden) only, which the chunked forward computes itself
    heads = (("trained", w, (h, w)), ("frozen", frozen, (h,)))
    planned = planned_mib("logprobs", tokens, dtype, vocab_size=vocab, hidden_size=hidden)
    for path, fn in paths:  # path by path: a failing kernel costs only the rows after it
        for head, weight, wanted in heads:
            def step(fn=fn, weight=weight, wanted=wanted, steps=path == "chunked_triton_steps"):
                previous, logprobs_module.USE_TRITON_STEPS = logprobs_module.USE_TRITON_STEPS, steps
                try:  # forward and backward: the backward picks its steps when it runs
                    torch.autograd.grad(fn(h, weight, targets).sum(), wanted)
                finally:
                    logprobs_module.USE_TRITON_STEPS = previous
            seconds, peak = clock.measure(step)
            report.add("logprobs", {"tokens": tokens, "vocab": vocab, "head": head, "path": path,
                                    "ms": seconds * 1e3, "peak_mib": peak, "planned_mib": planned})


def triton_section(report, clock, device, dtype, sizes):
    """The project's Triton kernels ("fast", mode "auto") beside their torch paths (mode "reference"), through the
    functions the adapters call: GLM-5.2's DSA selection and sparse absorbed MLA (forward + backward), and the paged
    partial attention over a page table (forward + backward into gradient pages)."""
    import torch

    from ds_longstraw.kernels import dsa, sparse_latent_attention
    from ds_longstraw.kernels.attention.triton_paged import paged_partial_attention
    from ds_longstraw.kernels.dispatch import kernel_mode

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype, grad=False):
        return torch.randn(*shape, device=device, dtype=dt, generator=gen).requires_grad_(grad)

    t, n, heads, latent, rope, k, index_heads, index_dim = (sizes[key] for key in (
        "queries", "keys", "heads", "latent", "rope", "topk", "index_heads", "index_dim"))
    q, w = randn(t, index_heads, index_dim), randn(t, index_heads, dt=torch.float32)
    keys = [randn(n - t, index_dim), randn(t, index_dim)]
    positions, valid = dsa.dsa_select(q, w, keys, n - t, k, 0.1)
    q_lat, q_rope = randn(t, heads, latent, grad=True), randn(t, heads, rope, grad=True)
    lat = [randn(m, latent, grad=True) for m in (n - t, t)]
    ropes = [randn(m, rope, grad=True) for m in (n - t, t)]
    d_out = randn(t, heads, latent)

    def select():
        dsa.dsa_select(q, w, keys, n - t, k, 0.1)

    def sparse_mla():
        out = sparse_latent_attention(q_lat, q_rope, lat, ropes, positions, valid, 0.06)
        torch.autograd.grad(out, [q_lat, q_rope, *lat, *ropes], d_out)

    def sparse_mla_forward():
        with torch.no_grad():
            sparse_latent_attention(q_lat, q_rope, lat, ropes, positions, valid, 0.06)

    # the prompt piece's gradients by rows, into float32 gradient pages as the device tier keeps them (a replay
    # block's backward in exact mode: kernels/sparse_mla/selected_rows.py, offload/staged_past.py's row sink)
    page_grads = (torch.zeros(n - t, latent, device=device), torch.zeros(n - t, rope, device=device))

    def page_sink(rows, d_latent, d_rope):
        for pages, grad in zip(page_grads, (d_latent, d_rope), strict=True):
            pages.index_add_(0, rows, grad.float())

    def sparse_mla_rows():
        out = sparse_latent_attention(q_lat, q_rope, lat, ropes, positions, valid, 0.06, row_sinks=[page_sink, None])
        torch.autograd.grad(out, [q_lat, q_rope, lat[1], ropes[1]], d_out)

    p_heads, p_kv, p_dim, p_tq, p_tk, page = (sizes[key] for key in (
        "paged_heads", "paged_kv_heads", "paged_dim", "paged_queries", "paged_keys", "page_tokens"))
    pages = p_tk // page + 2
    table = torch.randperm(pages, device=device, generator=gen)[:p_tk // page].to(torch.int32)
    # float32: the case the Triton kernel serves on CUDA (bfloat16 takes flash, BENCHMARKS.md)
    k_pages, v_pages = randn(pages, page, p_kv, p_dim, dt=torch.float32), randn(pages, page, p_kv, p_dim,
                                                                                   dt=torch.float32)
    pq = randn(p_heads, p_tq, p_dim, dt=torch.float32, grad=True)
    grad_pages = (torch.zeros_like(k_pages), torch.zeros_like(v_pages))
    p_dout = randn(p_heads, p_tq, p_dim, dt=torch.float32)

    def paged():
        out, _ = paged_partial_attention(pq, k_pages, v_pages, table, p_tk, p_dim ** -0.5, grad_pages=grad_pages)
        torch.autograd.grad(out, pq, p_dout)

    for name, fn in (("dsa_select", select), ("sparse_mla fwd", sparse_mla_forward), ("sparse_mla fwd+bwd", sparse_mla),
                     ("sparse_mla fwd+bwd, prompt rows to a sink", sparse_mla_rows),
                     ("paged attention fwd+bwd", paged)):
        for path, mode in (("fast", "auto"), ("reference", "reference")):
            with kernel_mode(mode):
                seconds, peak = clock.measure(fn)
            report.add("triton", {"kernel": name, "path": path, "ms": seconds * 1e3, "peak_mib": peak})


# ---- GRPO steps of the Qwen3.6-27B layer shape -------------------------------------------------------------------

def _model(shape_overrides, device, dtype):
    import torch
    import yaml  # the shape file is plain YAML; omegaconf (the launcher's reader) is not needed here
    from transformers import AutoModelForCausalLM

    from ds_longstraw.models.modeling import config_from_shape

    with open(os.path.join(ROOT, "configs", "models", "qwen3_6_27b.yaml")) as handle:
        fields = {**yaml.safe_load(handle), **shape_overrides}
    config = config_from_shape(fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def grpo_section(report, device, dtype, sizes, deadline):
    """Detached GRPO steps at growing prompt lengths (each doubling) until memory runs out or time does; at the
    first length also the torch fallback (kernels "reference") and the conventional full-sequence step."""
    import torch

    from ds_longstraw.grpo.transaction import grpo_backward
    from ds_longstraw.models.shapes import synthetic_group
    from ds_longstraw.objective import GRPOObjective
    from ds_longstraw.tools.baselines import conventional

    model = _model(sizes["shape"], device, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    config = {"prefix_grad": "detached", "capture_chunk": sizes["capture_chunk"], "replay_block": 1024}
    cuda = device.type == "cuda"

    def step(prompt, how):
        model.zero_grad(set_to_none=True)
        group = synthetic_group(prompt, sizes["group"], sizes["response"], vocab, seed=prompt)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        if how == "conventional":
            result = conventional(model, group, GRPOObjective())
        else:
            result = grpo_backward(model, group, GRPOObjective(),
                                   longstraw={**config, "kernels": "reference" if how == "reference" else "auto"})
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - base) / MIB if cuda else None
        # where the step's time went, phase by phase (each CUDA-synchronised at its ends)
        phases = ", ".join(f"{name} {stats.seconds:.2f} s" for name, stats in getattr(result, "phases", {}).items())
        return {"prompt": prompt, "G": sizes["group"], "response": sizes["response"], "how": how,
                "seconds": seconds, "prompt_tokens_per_s": prompt / seconds, "peak_above_weights_mib": peak,
                "loss": result.loss, "weights_mib": weights / MIB, "phases": phases or None}

    lengths = sizes["prompts"]
    step(lengths[0], "default")  # warm-up, not reported: the first call compiles fla's and Triton's kernels
    for how in ("conventional", "reference"):
        try:
            report.add("grpo_step", step(lengths[0], how))
        except torch.cuda.OutOfMemoryError:
            report.add("grpo_step", {"prompt": lengths[0], "how": how, "seconds": None,
                                     "peak_above_weights_mib": "OOM"})
    for prompt in lengths:
        if time.monotonic() > deadline:
            report.add("grpo_step", {"prompt": prompt, "how": "default", "seconds": None,
                                     "peak_above_weights_mib": "skipped: time budget"})
            break
        try:
            report.add("grpo_step", step(prompt, "default"))
        except torch.cuda.OutOfMemoryError:
            report.add("grpo_step", {"prompt": prompt, "how": "default", "seconds": None,
                                     "peak_above_weights_mib": "OOM"})
            break
    model.zero_grad(set_to_none=True)


def plot_grpo_steps(report, path):
    """The GRPO rows as a picture: seconds and peak above the weights against prompt tokens (log-log), the
    default path as a line, conventional and the torch kernels as points. Skipped, saying so, where matplotlib is
    not installed (the GPU machine's packages are its own) or no step was measured."""
    rows = [row for row in report.sections.get("grpo_step", {}).get("rows", []) if row.get("seconds")]
    plt = pyplot() if rows else None
    if plt is None:
        return
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for how, style in (("default", "o-"), ("reference", "s"), ("conventional", "^")):
        points = sorted((row["prompt"], row["seconds"], row["peak_above_weights_mib"]) for row in rows
                        if row["how"] == how)
        if not points:
            continue
        prompts = [prompt for prompt, _, _ in points]
        axes[0].plot(prompts, [seconds for _, seconds, _ in points], style, label=how)
        peaks = [(prompt, peak / 1024) for prompt, _, peak in points if isinstance(peak, (int, float))]
        if peaks:
            axes[1].plot([p for p, _ in peaks], [g for _, g in peaks], style, label=how)
    for ax, label in ((axes[0], "step seconds"), (axes[1], "step peak above the weights (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:  # the dry run measures no GPU memory
            ax.text(0.5, 0.5, "no memory figure (CPU dry run)", transform=ax.transAxes, ha="center")
    first = rows[0]
    figure.suptitle(f"GRPO step, G = {first['G']}, responses of {first['response']} tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"[gpu_check] plot: {path}", flush=True)


# ---- sizes -----------------------------------------------------------------------------------------------------

def sizes_for(dry_run):
    from gpu_whole_model import sizes_for as whole_model_sizes

    return {**kernel_sizes_for(dry_run), **whole_model_sizes(dry_run)}


def kernel_sizes_for(dry_run):
    if dry_run:  # toy sizes: every path once on the CPU, in seconds
        return {
            "attention": {"heads": 4, "kv_heads": 2, "head_dim": 16, "tq": 32, "tk": [64]},
            "gated_delta": {"hk": 2, "hv": 4, "dk": 16, "dv": 16, "t": [96]},
            "logprobs": {"tokens": 32, "hidden": 16, "vocab": 20000},
            "triton": {"queries": 16, "keys": 48, "heads": 2, "latent": 16, "rope": 16, "topk": 8, "index_heads": 2,
                       "index_dim": 16, "paged_heads": 4, "paged_kv_heads": 2, "paged_dim": 16, "paged_queries": 16,
                       "paged_keys": 64, "page_tokens": 16},
            "grpo_step": {"shape": {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 512},
                          "prompts": [64, 96], "group": 2, "response": 16, "capture_chunk": 64},
        }
    return {  # Qwen3.6-27B's per-layer shape (configs/models/qwen3_6_27b.yaml)
        "attention": {"heads": 24, "kv_heads": 4, "head_dim": 256, "tq": 1024, "tk": [8192, 65536, 262144]},
        "gated_delta": {"hk": 16, "hv": 48, "dk": 128, "dv": 128, "t": [8192, 32768]},
        "logprobs": {"tokens": 1024, "hidden": 5120, "vocab": 248320},
        # GLM-5.2's DSA widths (64 heads, latent 512 + rope 64, top-2048 of 16K keys; indexer 32 heads of 128), and
        # paged attention at Qwen3.6's heads
        "triton": {"queries": 1024, "keys": 16384, "heads": 64, "latent": 512, "rope": 64, "topk": 2048,
                   "index_heads": 32, "index_dim": 128, "paged_heads": 24, "paged_kv_heads": 4, "paged_dim": 256,
                   "paged_queries": 1024, "paged_keys": 32768, "page_tokens": 256},
        # 4 layers: 3 Gated DeltaNet + 1 full attention, the 27B's widths and vocabulary
        "grpo_step": {"shape": {"num_hidden_layers": 4}, "prompts": [16384, 65536, 262144, 1048576, 2097152],
                      "group": 4, "response": 1024, "capture_chunk": 8192},
    }


def environment(device):
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for name in ("triton", "fla"):
        try:
            env[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            env[name] = "absent"
    return env


# In the order they run: the whole model before the kernels that only add rows beside earlier sessions' figures.
SECTIONS = ("attention", "logprobs", "whole_qwen", "glm_layer", "triton", "gated_delta")
# Seconds a section is expected to take on the H200, its kernels' compilation included (the sessions' logs): a model
# section's steps stop early enough to leave these to the sections after it.
# The last ones are re-measurements of earlier sessions' figures: cut short, they cost least.
RESERVE = {"attention": 40, "logprobs": 30, "glm_layer": 45, "triton": 40, "gated_delta": 30, "grpo_step": 90,
           "whole_qwen": 240, "agent_decode": 240}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_check"))
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole script")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="of " + ", ".join(SECTIONS + ("grpo_step", "agent_decode")) + " (grpo_step: the 4-layer "
                        "ladder; agent_decode: issue 45's turns on the whole 27B shape)")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible (use --dry-run on a CPU machine)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    clock = Clock(device, repeats=1 if args.dry_run else 5)
    sizes = sizes_for(args.dry_run)
    env = environment(device)
    report = Report(args.out, args.dry_run, env)
    print(f"[gpu_check] {env}", flush=True)
    models = {"grpo_step": grpo_section, "whole_qwen": whole_qwen_section, "glm_layer": glm_layer_section,
              "agent_decode": agent_decode_section}
    kernels = {"attention": attention_section, "gated_delta": delta_rule_section, "logprobs": logprobs_section,
               "triton": triton_section}
    from ds_longstraw.kernels.dispatch import paths_taken, reset_paths_taken

    names = args.sections.split(",")
    for index, name in enumerate(names):
        section_start = time.monotonic()
        reset_paths_taken()
        try:
            if name in models:
                later = sum(RESERVE.get(after, 0) for after in names[index + 1:])
                models[name](report, device, dtype, sizes[name], deadline=started + args.budget - later)
            else:
                kernels[name](report, clock, device, dtype, sizes[name])
        except Exception:  # noqa: BLE001 -- a failed section is recorded and the check goes on
            report.fail(name, traceback.format_exc())
        finally:
            report.paths(name, paths_taken())
            gc.collect()  # a model section's modules hold reference cycles: free its weights before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[gpu_check] {name}: {time.monotonic() - section_start:.1f} s", flush=True)
        report.write()
    plot_grpo_steps(report, os.path.join(args.out, "grpo_step.png"))
    plot_whole_qwen(report, os.path.join(args.out, "whole_qwen.png"))
    failed = [name for name, section in report.sections.items() if section["error"]]
    print(f"[gpu_check] done in {time.monotonic() - started:.0f} s; failed sections: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:  # installed (the GPU machine installs the project with --target): use that copy
        import ds_longstraw.kernels  # noqa: F401
    except ImportError:
        sys.path.insert(0, ROOT)
    sys.exit(main())
