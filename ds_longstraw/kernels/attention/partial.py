"""Partial softmax attention returning (out, lse), and attention of a query block over paged past keys.

Legend: H query heads, K key/value heads (H % K == 0, head h reads kv head h // (H // K)), Tq queries, Tk keys,
D head dim. Layouts: q_HTD [H, Tq, D]; k_KTD, v_KTD [K, Tk, D]; out_HTD [H, Tq, D]; lse_HT [H, Tq].

`partial_attention` is memory-bounded: the forward walks key blocks with an online softmax, and the backward
recomputes each block's probabilities from the saved (out, lse) instead of keeping a [Tq, Tk] score matrix alive.
That is what lets a prompt chunk attend to millions of past keys with autograd on (exact-mode prefix pass).
`partial_attention_reference` is the plain dense version with the same signature; tests compare the two.

Masking: with `causal_offset=None` every query sees every key. Otherwise query i sees key j iff
j <= i + causal_offset (0 for a block attending to itself). Queries that see no key get out = 0, lse = -inf.
"""

import torch

from ..dispatch import fast_path, record
from ..lse import merge_partials
from .cudnn import cudnn_applies, cudnn_backward, cudnn_forward
from .flash import flash_applies, flash_backward, flash_forward
from .reference import (
    KEY_BLOCK,
    accumulation_dtype,
    attention_delta,
    block_mask,
    blockwise_grads_from_delta,
    grouped_heads,
    partial_attention_reference,
)

# Forward through PyTorch's fused CPU flash kernel where it applies; the blockwise torch loop below is both the
# fallback and the path the fused one is tested against (set False to force it).
USE_FUSED = True

# Keys per call of a library backward (flash on CUDA, the fused CPU kernel) over an unmasked key set. Those kernels
# return dK/dV for every key they see: where the caller needs none (detached mode's constant prompt pages), whole
# calls would hold a prompt-sized dK/dV for nothing (8 GiB at 262,144 keys of Qwen3.6-27B's attention on the H200,
# BENCHMARKS.md), and where dK/dV go to gradient pages (sinks) 2,048-key calls would leave flash mostly idle. Flash
# computes grouped heads' dK/dV per query head before summing them, so one call holds 2 x (H + K) x keys x D
# numbers: 448 MiB at 16,384 keys of that shape (24 query and 4 KV heads of 256, bf16), which the planner counts;
# on the H200 flash's time per key changed by about 1.3x between 8,192 and 262,144 keys (BENCHMARKS.md, "Partial
# attention: a 1,024-token replay block over a prompt's keys"). On CPU the call length
# does not matter (a 32K-key sink backward took the same time with 2,048- to 32,768-key calls), so the sinks keep
# key_block there.
LIBRARY_KEY_BLOCK = 16384


def _fused_cpu_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset):
    """PyTorch's fused CPU flash attention, which also returns the lse; None where it does not apply.

    It masks causally only for a block attending to itself (Tq == Tk, offset 0). Grouped heads: with no mask the
    query heads of one kv head stack into one longer query sequence; the causal self block repeats its (chunk-
    sized) keys instead.
    """
    fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is None or q_HTD.device.type != "cpu" or q_HTD.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return None
    heads, tq, d = q_HTD.shape
    kv_heads, tk, _ = k_KTD.shape
    if causal_offset is None:
        q = q_HTD.reshape(1, kv_heads, (heads // kv_heads) * tq, d)
        out, lse = fused(q, k_KTD.unsqueeze(0), v_KTD.unsqueeze(0), 0.0, False, scale=scale)
    elif causal_offset == 0 and tq == tk:
        rep = heads // kv_heads
        k = k_KTD.repeat_interleave(rep, dim=0).unsqueeze(0)
        v = v_KTD.repeat_interleave(rep, dim=0).unsqueeze(0)
        out, lse = fused(q_HTD.unsqueeze(0), k, v, 0.0, True, scale=scale)
    else:
        return None
    return out.reshape(heads, tq, d), lse.reshape(heads, tq)


def _blockwise_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block):
    """Online-softmax forward over key blocks (no autograd inside)."""
    kv_heads, tk, _ = k_KTD.shape
    q_KRTD = grouped_heads(q_HTD, kv_heads)
    tq = q_HTD.shape[1]
    acc = accumulation_dtype(q_HTD.dtype)
    out = torch.zeros(q_KRTD.shape, dtype=acc, device=q_HTD.device)
    run_max = torch.full(q_KRTD.shape[:-1], float("-inf"), dtype=acc, device=q_HTD.device)
    run_sum = torch.zeros_like(run_max)
    for k0 in range(0, tk, key_block):
        k1 = min(tk, k0 + key_block)
        if causal_offset is not None and k0 > tq - 1 + causal_offset:
            break  # every later key is masked for every query
        s = torch.einsum("krtd,ksd->krts", q_KRTD, k_KTD[:, k0:k1]).to(acc) * scale
        mask = block_mask(tq, k0, k1, causal_offset, q_HTD.device)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        rescale = torch.exp(run_max - safe_max)
        p = torch.exp(s - safe_max.unsqueeze(-1))
        run_sum = run_sum * rescale + p.sum(-1)
        out = out * rescale.unsqueeze(-1) + torch.einsum("krts,ksd->krtd", p, v_KTD[:, k0:k1].to(acc))
        run_max = new_max
    safe_max = torch.where(torch.isinf(run_max), torch.zeros_like(run_max), run_max)
    lse = torch.where(run_sum > 0, safe_max + torch.log(run_sum), torch.full_like(run_sum, float("-inf")))
    out = torch.where(run_sum.unsqueeze(-1) > 0, out / run_sum.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(out))
    return out.to(q_HTD.dtype).reshape(q_HTD.shape), lse.reshape(q_HTD.shape[:2])


def _triton_paged(q_HTD, k_KTD):
    """The Triton kernels (triton_paged.py) where they apply, else None. Checked after flash: they take
    the CUDA cases flash does not (float32, any causal offset, an lse gradient flash cannot fold); CPU tensors
    never get here (the dispatch's fast_path is False for them, before triton is imported)."""
    if not fast_path(q_HTD, "triton"):
        return None
    from . import triton_paged  # imports triton: loaded on first use, on CUDA only

    return triton_paged if triton_paged.triton_applies(q_HTD, k_KTD) else None


def _forward(q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block):
    if cudnn_applies(q_HTD, k_KTD, causal_offset):  # CUDA, where cuDNN is the chosen library (cudnn.py)
        record("attention forward", "cudnn")
        return cudnn_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset)
    if flash_applies(q_HTD, k_KTD, causal_offset):  # CUDA: torch's flash kernels (flash.py)
        record("attention forward", "flash")
        return flash_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset)
    paged = _triton_paged(q_HTD, k_KTD)
    if paged is not None:  # CUDA, where flash does not apply
        record("attention forward", "triton_paged")
        return paged.segment_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset)
    fused = _fused_cpu_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset) if USE_FUSED else None
    if fused is not None:
        record("attention forward", "torch_fused_cpu")
        return fused[0], fused[1].to(accumulation_dtype(q_HTD.dtype))
    record("attention forward", "torch_blockwise")
    return _blockwise_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block)


def _blockwise_backward(q_HTD, k_KTD, v_KTD, out, lse, dout_HTD, dlse_HT, scale, causal_offset, key_block, need_kv):
    delta = attention_delta(out, dout_HTD, dlse_HT)
    dq, dk, dv = blockwise_grads_from_delta(q_HTD, k_KTD, v_KTD, lse, dout_HTD, delta, scale, causal_offset,
                                            key_block, need_kv)
    dq = dq.to(q_HTD.dtype)
    if not need_kv:  # constant pages (detached mode): no key/value gradient is computed or held
        return dq, None, None
    return dq, dk.to(k_KTD.dtype), dv.to(v_KTD.dtype)


def _fused_cpu_backward(q_HTD, k_KTD, v_KTD, out, lse, dout_HTD, scale, causal_offset):
    """PyTorch's fused CPU flash backward for one key set of a merged attention (no lse gradient); None where it
    does not apply."""
    fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fused is None or q_HTD.device.type != "cpu":
        return None
    heads, tq, d = q_HTD.shape
    kv_heads, tk, _ = k_KTD.shape
    rep = heads // kv_heads
    lse = lse.to(torch.float64 if q_HTD.dtype == torch.float64 else torch.float32)
    if causal_offset is None:
        shape = (1, kv_heads, rep * tq, d)
        dq, dk, dv = fused(dout_HTD.reshape(shape).contiguous(), q_HTD.reshape(shape).contiguous(),
                           k_KTD.unsqueeze(0).contiguous(), v_KTD.unsqueeze(0).contiguous(),
                           out.reshape(shape).contiguous(), lse.reshape(1, kv_heads, rep * tq).contiguous(),
                           0.0, False, scale=scale)
        return dq.reshape(heads, tq, d), dk[0], dv[0]
    if causal_offset == 0 and tq == tk:
        k = k_KTD.repeat_interleave(rep, dim=0).unsqueeze(0)
        v = v_KTD.repeat_interleave(rep, dim=0).unsqueeze(0)
        dq, dk, dv = fused(dout_HTD.unsqueeze(0).contiguous(), q_HTD.unsqueeze(0).contiguous(), k, v,
                           out.unsqueeze(0).contiguous(), lse.unsqueeze(0).contiguous(), 0.0, True, scale=scale)
        return dq[0], dk[0].reshape(kv_heads, rep, tk, d).sum(1), dv[0].reshape(kv_heads, rep, tk, d).sum(1)
    return None


def _backward(q, k, v, out, lse, dout, dlse, scale, causal_offset, key_block, need_kv):
    if not need_kv and causal_offset is None and k.shape[1] > LIBRARY_KEY_BLOCK:
        # dq only, from a long unmasked key set: one library call per LIBRARY_KEY_BLOCK keys. Each block's share of
        # dq is exact on its own (the MERGED out and lse), so the shares add up to the whole set's dq.
        dq = None
        for k0 in range(0, k.shape[1], LIBRARY_KEY_BLOCK):
            k1 = min(k.shape[1], k0 + LIBRARY_KEY_BLOCK)
            share = _backward_call(q, k[:, k0:k1], v[:, k0:k1], out, lse, dout, dlse, scale, None, key_block, False)[0]
            dq = share if dq is None else dq + share
        return dq, None, None
    return _backward_call(q, k, v, out, lse, dout, dlse, scale, causal_offset, key_block, need_kv)


def key_set_grads(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, scale, causal_offset=None, key_block=KEY_BLOCK):
    """(dq share, dK, dV) of one key set of a merged attention, from the MERGED out and lse (no lse gradient),
    through the first kernel that applies (as a segment's backward does); the plain form is
    blockwise_grads_from_delta."""
    return _backward(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, None, scale, causal_offset, key_block, True)


def sink_block(q_HTD, k_KTD, key_block):
    """Keys per sink call of a prompt segment's backward: LIBRARY_KEY_BLOCK where flash serves the calls, else
    key_block (see LIBRARY_KEY_BLOCK)."""
    library = flash_applies(q_HTD, k_KTD, None) or cudnn_applies(q_HTD, k_KTD, None)
    return LIBRARY_KEY_BLOCK if library else key_block


def _backward_call(q, k, v, out, lse, dout, dlse, scale, causal_offset, key_block, need_kv):
    """One key set's (dq, dk, dv) through the first kernel that applies: cuDNN where it is the chosen library, flash
    (CUDA), the Triton paged kernel (CUDA, where neither applies), the fused CPU kernel, the blockwise torch loop."""
    for name, applies, backward in (("cudnn", cudnn_applies, cudnn_backward),
                                    ("flash", flash_applies, flash_backward)):
        grads = backward(q, k, v, out, lse, dout, dlse, scale, causal_offset) if applies(q, k, causal_offset) else None
        if grads is not None:  # None: an lse gradient the library cannot fold (the next path takes it)
            record("attention backward", name)
            dq, dk, dv = grads
            return dq, (dk if need_kv else None), (dv if need_kv else None)
    paged = _triton_paged(q, k)
    if paged is not None:
        record("attention backward", "triton_paged")
        return paged.segment_backward(q, k, v, out, lse, dout, dlse, scale, causal_offset, need_kv)
    if USE_FUSED and (dlse is None or not dlse.any()):
        fused = _fused_cpu_backward(q, k, v, out, lse, dout, scale, causal_offset)
        if fused is not None:
            record("attention backward", "torch_fused_cpu")
            dq, dk, dv = fused
            return dq, (dk if need_kv else None), (dv if need_kv else None)
    record("attention backward", "torch_blockwise")
    return _blockwise_backward(q, k, v, out, lse, dout, dlse, scale, causal_offset, key_block, need_kv)


class _PartialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block):
        ctx.scale, ctx.causal_offset, ctx.key_block = scale, causal_offset, key_block
        out, lse = _forward(q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block)
        ctx.save_for_backward(q_HTD, k_KTD, v_KTD, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout_HTD, dlse_HT):
        q_HTD, k_KTD, v_KTD, out, lse = ctx.saved_tensors
        if dout_HTD is None:
            dout_HTD = torch.zeros_like(out)
        need_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dq, dk, dv = _backward(q_HTD, k_KTD, v_KTD, out, lse, dout_HTD, dlse_HT, ctx.scale, ctx.causal_offset,
                               ctx.key_block, need_kv)
        return dq, dk, dv, None, None, None


class _AttentionWithPast(torch.autograd.Function):
    """Causal attention of a block over earlier key sets plus itself, merged in forward; the backward walks the
    key sets one at a time with the MERGED out and lse (ring-attention style), never holding more than one key
    set's scores."""

    @staticmethod
    def forward(ctx, q_HTD, scale, key_block, sinks, known, remote, *kv_sets):
        pairs = list(zip(kv_sets[0::2], kv_sets[1::2], strict=True))  # the last pair is the block itself (causal)
        out, lse = None, None
        if known is not None:  # the result, computed before from the same inputs: only record what backward needs
            out, lse = (x.clone() for x in known)
            pairs = []
        elif remote is not None:  # the remote keys' owners work while the local key sets are attended below
            remote.post_forward(q_HTD.detach())
        for index, (k_KTD, v_KTD) in enumerate(pairs):
            causal = 0 if index == len(pairs) - 1 else None
            if k_KTD.shape[1] == 0:
                continue
            o, lse_part = _forward(q_HTD, k_KTD, v_KTD, scale, causal, key_block)
            out, lse = (o, lse_part) if out is None else merge_partials(out, lse, o, lse_part.to(lse.dtype))
        if remote is not None and known is None:
            o, lse_part = remote.collect_forward()
            out, lse = merge_partials(out, lse, o.to(out.dtype), lse_part.to(lse.dtype))
        ctx.scale, ctx.key_block, ctx.count, ctx.sinks = scale, key_block, len(kv_sets) // 2, sinks
        ctx.remote = remote
        ctx.save_for_backward(q_HTD, out, lse, *kv_sets)
        return out, lse

    @staticmethod
    def backward(ctx, dout_HTD, dlse_HT):
        q_HTD, out, lse, *kv_sets = ctx.saved_tensors
        if dout_HTD is None:
            dout_HTD = torch.zeros_like(out)
        if ctx.remote is not None:  # the remote keys' share of dq (from the merged out and lse), computed meanwhile
            ctx.remote.post_backward(q_HTD, out, lse, dout_HTD, dlse_HT)
        dq_total = torch.zeros_like(q_HTD)
        grads = []
        for index in range(ctx.count):
            k_KTD, v_KTD = kv_sets[2 * index], kv_sets[2 * index + 1]
            need_kv = ctx.needs_input_grad[6 + 2 * index] or ctx.needs_input_grad[7 + 2 * index]
            if k_KTD.shape[1] == 0:
                grads += [torch.zeros_like(k_KTD) if need_kv else None] * 2
                continue
            causal = 0 if index == ctx.count - 1 else None
            sink = ctx.sinks[index] if index < len(ctx.sinks) else None
            if sink is not None:  # earlier pages: key block by key block, each block's dK/dV straight to the sink
                block = sink_block(q_HTD, k_KTD, ctx.key_block)
                for k0 in range(0, k_KTD.shape[1], block):
                    k1 = min(k_KTD.shape[1], k0 + block)
                    dq, dk, dv = _backward(q_HTD, k_KTD[:, k0:k1], v_KTD[:, k0:k1], out, lse, dout_HTD, dlse_HT,
                                           ctx.scale, None, ctx.key_block, True)
                    dq_total += dq
                    sink(k0, dk, dv)
                grads += [None, None]
                continue
            dq, dk, dv = _backward(q_HTD, k_KTD, v_KTD, out, lse, dout_HTD, dlse_HT, ctx.scale, causal,
                                   ctx.key_block, need_kv)
            dq_total += dq
            grads += [dk, dv]
        if ctx.remote is not None:
            dq_total += ctx.remote.collect_backward().to(dq_total.dtype)
        return (dq_total, None, None, None, None, None, *grads)


def partial_attention(q_HTD, k_KTD, v_KTD, scale, causal_offset=None, key_block=KEY_BLOCK):
    """Softmax attention of queries over one set of keys, returning (out_HTD, lse_HT).

    Exact (not approximate) attention; memory is O(Tq * key_block) per head in forward and backward.
    An empty key set returns out = 0 and lse = -inf.
    """
    if q_HTD.dim() != 3 or k_KTD.dim() != 3 or k_KTD.shape != v_KTD.shape[:2] + k_KTD.shape[2:]:
        raise ValueError(f"expected q [H,Tq,D], k/v [K,Tk,D]; got {tuple(q_HTD.shape)}, {tuple(k_KTD.shape)}")
    if q_HTD.shape[0] % k_KTD.shape[0]:
        raise ValueError(f"query heads {q_HTD.shape[0]} not a multiple of kv heads {k_KTD.shape[0]}")
    if k_KTD.shape[1] == 0:
        out = q_HTD.new_zeros(q_HTD.shape[:2] + (v_KTD.shape[-1],))
        lse = torch.full(q_HTD.shape[:2], float("-inf"),
                         dtype=torch.float32 if q_HTD.dtype != torch.float64 else q_HTD.dtype, device=q_HTD.device)
        return out, lse
    return _PartialAttention.apply(q_HTD, k_KTD, v_KTD, scale, causal_offset, key_block)


def attention_with_past(q_HTD, past, k_new_KTD, v_new_KTD, scale, key_block=KEY_BLOCK, sinks=None, known=None,
                        remote=None):
    """Causal attention of a query block over earlier segments plus itself, returning (out_HTD, lse_HT).

    `past` is a sequence of (k_KTD, v_KTD) segments that lie entirely before the block (prompt pages, earlier
    response blocks); every query sees all of them, and sees the block's own keys causally. Partials merge by
    LSE; the backward reuses the merged out and lse. `attention_with_past_reference` composes the same result
    from `partial_attention` and `merge_partials` with plain autograd.

    sinks: None, or one entry per past segment: None, or a callable sink(offset, dk_KTD, dv_KTD) that takes the
    segment's key/value gradient one key block at a time (offset: the block's first key in the segment). Those
    segments get no autograd gradient: a prompt's pages (gradient pages accumulate them) never have their whole
    dK/dV alive at once.

    known: None, or the (out_HTD, lse_HT) this same call returned before (exact mode keeps the capture's): the
    forward then skips the attention and only records what backward needs; gradients are unchanged.

    remote: None, or keys held by other processes, as a request that runs while the local key sets are attended
    (context parallelism's prefix pass, grpo/cp/prefix_turns.RemoteKeys): post_forward(q) then collect_forward() ->
    their (out, lse), merged in (not with `known`, which is merged over them already); post_backward(q, out, lse,
    dout, dlse) with the MERGED result, then collect_backward() -> their share of dq (their own key gradients go
    where they live).
    """
    flat = []
    for k_KTD, v_KTD in past:
        flat += [k_KTD, v_KTD]
    sinks = tuple(sinks) if sinks is not None else ()
    return _AttentionWithPast.apply(q_HTD, scale, key_block, sinks, known, remote, *flat, k_new_KTD, v_new_KTD)


def attention_with_past_reference(q_HTD, past, k_new_KTD, v_new_KTD, scale):
    out, lse = partial_attention_reference(q_HTD, k_new_KTD, v_new_KTD, scale, causal_offset=0)
    for k_KTD, v_KTD in past:
        o2, l2 = partial_attention_reference(q_HTD, k_KTD, v_KTD, scale)
        out, lse = merge_partials(out, lse, o2, l2.to(lse.dtype))
    return out, lse
