"""Partial attention with its log-sum-exp on CUDA, through torch's own flash-attention kernels.

The fast path of `partial._forward` / `partial._backward` where `flash_applies` holds (mode "auto", CUDA
tensors in bfloat16 or float16, a head dim flash tiles, and a mask it expresses); elsewhere those take the fused
CPU or the blockwise torch path. Layouts as partial.py (q_HTD [H, Tq, D], k_KTD / v_KTD [K, Tk, D], lse_HT); flash
reads token-major [T, heads, D] views of the same storage (its kernels take any row and head strides with a unit
last stride), so no copy of the pages is made, and its varlen entry (one sequence) is used because its backward
takes the sequence offsets that the dense entry keeps to itself. Grouped heads are native to flash.

Masks: none, or causal with causal_offset = Tk - Tq (flash aligns the causal diagonal to the bottom right: query i
sees key j iff j <= i + Tk - Tq); other offsets take the torch paths.

Rows that see no key: flash reports lse = +inf for them; the project's convention (and the merge's) is -inf, so
the forward maps it, and the backward maps -inf back to +inf, where exp(s - lse) = 0 for every key.

The lse's gradient: flash's backward takes none; it uses `out` only for delta = rowsum(dout * out). The merged
attention's backward needs delta = rowsum(dout * out) - dlse, so it passes out' = out - dlse * dout / |dout|^2,
whose rowsum with dout is exactly that (rows with dlse != 0 and dout = 0 cannot be folded: the torch path runs).
"""

import torch

from ..dispatch import fast_path

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256


def _causal_flag(causal_offset, tq, tk):
    """False (no mask), True (flash's bottom-right causal mask), or None (a mask flash does not express)."""
    if causal_offset is None:
        return False
    return True if causal_offset == tk - tq else None


def library_takes(q_HTD, k_KTD) -> bool:
    """What both CUDA libraries (flash here, cuDNN in cudnn.py) take, masks aside: mode "auto" on CUDA tensors in
    bfloat16 or float16, a head dim that is a multiple of 8 up to 256, queries and keys."""
    if not fast_path(q_HTD) or q_HTD.dtype not in _FLASH_DTYPES:
        return False
    d = q_HTD.shape[-1]
    return not (d % 8 or d > _MAX_HEAD_DIM or k_KTD.shape[1] == 0 or q_HTD.shape[1] == 0)


def flash_applies(q_HTD, k_KTD, causal_offset) -> bool:
    return library_takes(q_HTD, k_KTD) and _causal_flag(causal_offset, q_HTD.shape[1], k_KTD.shape[1]) is not None


def _token_major(x_HTD):
    x = x_HTD.transpose(0, 1)  # [T, heads, D], a view
    return x if x.stride(-1) == 1 else x.contiguous()


def _offsets(tokens, device):
    return torch.tensor([0, tokens], dtype=torch.int32, device=device)


def _lse_HT(lse, heads, tq):
    """flash's lse as [H, Tq] (varlen returns [H, total_q]; some builds pad a [1, H, Tq'] form)."""
    lse = lse.reshape(-1, lse.shape[-1])[-heads:] if lse.dim() == 3 else lse
    return lse[:, :tq].float()


def flash_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset):
    """(out_HTD, lse_HT float32) through torch's flash forward; the caller has checked `flash_applies`."""
    heads, tq, _ = q_HTD.shape
    tk = k_KTD.shape[1]
    device = q_HTD.device
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _token_major(q_HTD), _token_major(k_KTD), _token_major(v_KTD), _offsets(tq, device), _offsets(tk, device),
        tq, tk, 0.0, _causal_flag(causal_offset, tq, tk), False, scale=scale)
    lse = _lse_HT(lse, heads, tq)
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
    return out.transpose(0, 1), lse


def fold_lse_grad(out_HTD, dout_HTD, dlse_HT):
    """out' with rowsum(dout * out') = rowsum(dout * out) - dlse (module docstring): out itself where there is no lse
    gradient, None where a row has dlse != 0 and dout = 0."""
    if dlse_HT is None or not bool(dlse_HT.any()):
        return out_HTD
    acc = torch.float32
    dout = dout_HTD.to(acc)
    norm = (dout * dout).sum(-1)
    dlse = dlse_HT.to(acc)
    if bool(((norm == 0) & (dlse != 0)).any()):
        return None
    shift = torch.where(norm > 0, dlse / norm.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(norm))
    return (out_HTD.to(acc) - shift.unsqueeze(-1) * dout).to(out_HTD.dtype)


def flash_backward(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, dlse_HT, scale, causal_offset):
    """(dq, dk, dv) of one key set given the MERGED out and lse (attention.blockwise_grads_from_delta's contract)
    through torch's flash backward, or None where the lse's gradient cannot be folded (module docstring)."""
    out_HTD = fold_lse_grad(out_HTD, dout_HTD, dlse_HT)
    if out_HTD is None:
        return None
    heads, tq, _ = q_HTD.shape
    tk = k_KTD.shape[1]
    device = q_HTD.device
    lse = lse_HT.float()
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).contiguous()
    rng_state = torch.zeros(2, dtype=torch.int64, device=device)  # no dropout: never read
    unused = torch.empty(0, device=device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _token_major(dout_HTD.to(q_HTD.dtype)), _token_major(q_HTD), _token_major(k_KTD), _token_major(v_KTD),
        _token_major(out_HTD), lse, _offsets(tq, device), _offsets(tk, device), tq, tk, 0.0,
        _causal_flag(causal_offset, tq, tk), rng_state, unused, scale=scale)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
