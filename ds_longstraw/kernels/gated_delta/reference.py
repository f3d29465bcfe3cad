"""Gated delta rule (the recurrence of Gated DeltaNet layers), chunked, beside a token-by-token reference.

Legend: B batch, T tokens, Hk/Hv key/value heads (Hv % Hk == 0), dk/dv head dims.
q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log decay, <= 0) and beta [B, T, Hv]; state S [B, Hv, dk, dv].

Per token:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (q_t / sqrt(dk)).

`chunk_gated_delta_rule` (chunked.py) is the fast path the layers run: the chunked form below with a
hand-derived backward. All three keep float64 inputs in float64 (so gradients can be checked against float64
autograd to 1e-8) and compute lower precisions in float32, as the recurrent state is kept in float32 for bf16
models. Signatures match transformers' torch fallbacks, so any of them can stand in for them.
"""

import torch
import torch.nn.functional as F


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel):
    acc = _acc_dtype(query)
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, b, gg = (x.transpose(1, 2).to(acc) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, b, gg


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **kwargs):
    """Plain reference: one token at a time."""
    q, k, v, b, gg = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    batch, heads, t, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=q.dtype, device=q.device)
             if initial_state is None else initial_state.to(q.dtype))
    outs = []
    for i in range(t):
        state = state * gg[:, :, i].exp()[..., None, None]
        kv_mem = (state * k[:, :, i, :, None]).sum(-2)
        u = (v[:, :, i] - kv_mem) * b[:, :, i, None]
        state = state + k[:, :, i, :, None] * u[:, :, None, :]
        outs.append((state * q[:, :, i, :, None]).sum(-2))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2).to(query.dtype), (state if output_final_state else None)


def chunk_gated_delta_rule_autograd(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                    output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Chunked form under plain autograd: within a chunk the delta-rule updates are solved as one unit-triangular
    system (WY form), across chunks the state is carried. Same results as the token loop up to rounding. The
    reference of `chunked.chunk_gated_delta_rule`, which computes the same with a hand-derived
    backward."""
    q, k, v, b, gg = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    batch, heads, t, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (c - t % c) % c
    # Padded tokens have beta = 0 and g = 0: they write nothing and decay nothing.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    b, gg = (F.pad(x, (0, pad)) for x in (b, gg))
    n = (t + pad) // c
    q, k, v = (x.reshape(batch, heads, n, c, x.shape[-1]) for x in (q, k, v))
    b, gg = b.reshape(batch, heads, n, c), gg.reshape(batch, heads, n, c)

    cum = gg.cumsum(-1)  # log of the decay from the chunk start to each position (inclusive)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay_ij = exp(cum_i - cum_j) for j <= i; masked before exp so it never overflows.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta, v_beta = k * b.unsqueeze(-1), v * b.unsqueeze(-1)
    # (I + strictly-lower part) u = v_beta - ...; solve_triangular(unitriangular) reads only the strict lower part.
    system = k_beta @ k.transpose(-1, -2) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                                unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = (torch.zeros(batch, heads, dk, dv, dtype=q.dtype, device=q.device)
             if initial_state is None else initial_state.to(q.dtype))
    outs = []
    # unbind once: indexing chunk i inside the loop would make every step's backward scatter into a zeros tensor
    # of the whole sequence (quadratic in the number of chunks); unbind's backward is a single stack.
    per_chunk = zip(*(x.unbind(2)
                      for x in (new_values, state_reads, q_decayed, intra, chunk_decay, k_to_end)), strict=True)
    for values_i, reads_i, q_i, intra_i, decay_i, k_end_i in per_chunk:
        u = values_i - reads_i @ state
        outs.append(q_i @ state + intra_i @ u)
        state = state * decay_i + k_end_i.transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(batch, heads, n * c, dv)[:, :, :t]
    return out.transpose(1, 2).to(query.dtype), (state if output_final_state else None)
