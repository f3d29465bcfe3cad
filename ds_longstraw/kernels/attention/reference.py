"""The plain torch forms of partial attention and of its key-set gradients, shared by every fast path's tests and
fallbacks (partial.py's blockwise path, triton_paged.py's references). Layouts and masking as
partial.py's docstring: q_HTD [H, Tq, D]; k_KTD, v_KTD [K, Tk, D]; lse_HT [H, Tq]; query i sees key j iff
j <= i + causal_offset (None: every key).
"""

import torch

KEY_BLOCK = 2048


def grouped_heads(q_HTD, kv_heads):
    heads, tq, d = q_HTD.shape
    return q_HTD.reshape(kv_heads, heads // kv_heads, tq, d)


def block_mask(tq, k0, k1, causal_offset, device):
    if causal_offset is None:
        return None
    rows = torch.arange(tq, device=device).unsqueeze(1)
    cols = torch.arange(k0, k1, device=device).unsqueeze(0)
    return cols > rows + causal_offset  # True where masked


def partial_attention_reference(q_HTD, k_KTD, v_KTD, scale, causal_offset=None):
    """Dense softmax attention over all keys at once (plain autograd)."""
    kv_heads, tk, _ = k_KTD.shape
    q_KRTD = grouped_heads(q_HTD, kv_heads)
    s = torch.einsum("krtd,ksd->krts", q_KRTD, k_KTD) * scale
    mask = block_mask(q_HTD.shape[1], 0, tk, causal_offset, q_HTD.device)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("krts,ksd->krtd", p, v_KTD)
    return out.reshape(q_HTD.shape), lse.reshape(q_HTD.shape[:2])


def accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def blockwise_grads_from_delta(q_HTD, k_KTD, v_KTD, lse_HT, dout_HTD, delta_HT, scale, causal_offset=None,
                               key_block=KEY_BLOCK, need_kv=True):
    """One key set's share of the gradients of an attention whose key sets were merged, given the MERGED lse and
    delta = <dout, out> - dlse (out the merged output). Returns (dq share, dk, dv) in accumulation precision
    (float64 for float64 inputs, else float32); dk/dv are None when need_kv is False.

    With p = exp(s - lse): dv = p^T dout; dp = dout v^T; ds = p * (dp - delta). Because p uses the merged lse and
    delta the merged out, each key set's share is exact on its own; memory is O(Tq * key_block) per head.
    """
    kv_heads, tk, _ = k_KTD.shape
    acc = accumulation_dtype(q_HTD.dtype)
    q = grouped_heads(q_HTD, kv_heads).to(acc)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k_KTD.shape, dtype=acc, device=k_KTD.device) if need_kv else None
    dv = torch.zeros(v_KTD.shape, dtype=acc, device=v_KTD.device) if need_kv else None
    tq = q.shape[2]
    if tk == 0 or tq == 0:
        return dq.reshape(q_HTD.shape), dk, dv
    dout = grouped_heads(dout_HTD, kv_heads).to(acc)
    lse_K = lse_HT.reshape(q.shape[:-1]).to(acc)
    safe_lse = torch.where(torch.isinf(lse_K), torch.zeros_like(lse_K), lse_K)
    delta = delta_HT.reshape(q.shape[:-1]).to(acc)
    for k0 in range(0, tk, key_block):
        k1 = min(tk, k0 + key_block)
        if causal_offset is not None and k0 > tq - 1 + causal_offset:
            break
        kb, vb = k_KTD[:, k0:k1].to(acc), v_KTD[:, k0:k1].to(acc)
        s = torch.einsum("krtd,ksd->krts", q, kb) * scale
        mask = block_mask(tq, k0, k1, causal_offset, q.device)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        p = torch.exp(s - safe_lse.unsqueeze(-1))
        if need_kv:
            dv[:, k0:k1] = torch.einsum("krts,krtd->ksd", p, dout)
        ds = p * (torch.einsum("krtd,ksd->krts", dout, vb) - delta.unsqueeze(-1)) * scale
        dq += torch.einsum("krts,ksd->krtd", ds, kb)
        if need_kv:
            dk[:, k0:k1] = torch.einsum("krts,krtd->ksd", ds, q)
    return dq.reshape(q_HTD.shape), dk, dv


def attention_delta(out_HTD, dout_HTD, dlse_HT):
    """delta = rowsum(dout * out) - dlse, in accumulation precision."""
    acc = accumulation_dtype(out_HTD.dtype)
    delta = (dout_HTD.to(acc) * out_HTD.to(acc)).sum(-1)
    return delta if dlse_HT is None else delta - dlse_HT.to(acc)
