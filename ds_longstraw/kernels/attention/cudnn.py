"""Partial attention with its log-sum-exp on CUDA, through cuDNN's fused attention (torch's aten entry).

The second library candidate beside flash.py, with the same contract (layouts as partial.py: q_HTD [H, Tq, D],
k_KTD / v_KTD [K, Tk, D], lse_HT float32). Torch's SDPA reaches cuDNN too but returns no lse, which a merged
attention needs; the aten entry `_scaled_dot_product_cudnn_attention` returns it (compute_log_sumexp=True) and its
backward entry takes (out, lse) as arguments, so, as with flash, the backward of one key set runs from the MERGED
out and lse, and the lse's gradient is folded into out' (flash.fold_lse_grad: the kernel reads out only through
rowsum(dout * out)).

Which library serves is `dispatch.attention_library()`: cuDNN by default, since on the H200 it took 0.55-0.65x
flash's time for a replay block's forward + backward (it is what torch's SDPA picks there, so this closes the
1.6-2x gap to SDPA that flash left; BENCHMARKS.md, "On one H200"). cuDNN is taken only where it applies:
CUDA bfloat16/float16, head dim a multiple of 8 up to 256, at least MIN_QUERIES queries (decode steps stay on
flash), and a mask it expresses without an offset: none, or a causal block over its own keys (Tq == Tk, offset 0;
cuDNN aligns the diagonal top-left, so other causal offsets take flash). Grouped heads are passed as they are
(cuDNN reads K/V heads shared by H/K query heads: it did on the H200); a build that refuses them raises, and the
test on the device (tests/unit/test_cuda_paths.py) says so.
"""

import torch

from ..dispatch import attention_library
from .flash import fold_lse_grad, library_takes


def _causal_flag(causal_offset, tq, tk):
    """False (no mask), True (a block over its own keys), or None (a mask this path does not express)."""
    if causal_offset is None:
        return False
    return True if causal_offset == 0 and tq == tk else None


# Queries per call below which flash serves instead: cuDNN was timed and tested on capture and replay blocks (64 to
# 1,024 queries, BENCHMARKS.md); a decode step's handful of queries stays on flash, whose one-query calls ran there.
MIN_QUERIES = 32


def cudnn_applies(q_HTD, k_KTD, causal_offset) -> bool:
    if attention_library() != "cudnn" or not library_takes(q_HTD, k_KTD) or q_HTD.shape[1] < MIN_QUERIES:
        return False
    return _causal_flag(causal_offset, q_HTD.shape[1], k_KTD.shape[1]) is not None


def _batch(x_HTD):
    return x_HTD.unsqueeze(0).contiguous()  # [1, heads, T, D], the dense layout both entries accept


def cudnn_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset):
    """(out_HTD, lse_HT float32) through cuDNN's forward; the caller has checked `cudnn_applies`."""
    heads, tq, _ = q_HTD.shape
    causal = _causal_flag(causal_offset, tq, k_KTD.shape[1])
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _batch(q_HTD), _batch(k_KTD), _batch(v_KTD), None, True, 0.0, causal, False, scale=scale)
    return out[0], lse.reshape(heads, tq).float()


def cudnn_backward(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, dlse_HT, scale, causal_offset):
    """(dq, dk, dv) of one key set given the MERGED out and lse, or None where the lse's gradient cannot be folded
    (flash.fold_lse_grad)."""
    out_HTD = fold_lse_grad(out_HTD, dout_HTD, dlse_HT)
    if out_HTD is None:
        return None
    heads, tq, _ = q_HTD.shape
    tk = k_KTD.shape[1]
    device = q_HTD.device
    causal = _causal_flag(causal_offset, tq, tk)
    lse = lse_HT.float().reshape(1, heads, tq, 1).contiguous()  # the forward's [B, H, Tq, 1] statistics
    philox = torch.zeros(1, dtype=torch.int64, device=device)  # no dropout: never read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _batch(dout_HTD.to(q_HTD.dtype)), _batch(q_HTD), _batch(k_KTD), _batch(v_KTD), _batch(out_HTD), lse,
        philox, philox, None, None, None, tq, tk, 0.0, causal, scale=scale)  # no bias; a dense batch: no offsets
    return dq[0], dk[0], dv[0]
