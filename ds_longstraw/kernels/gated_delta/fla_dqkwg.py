"""fla's gated delta rule backward where fla refuses it: its `chunk_bwd_dqkwg` step, in torch, through fla's own
backend registry.

fla 0.6 raises at the first backward with Triton >= 3.4 and < 3.7.1 on Hopper (H20, H100, H200): that compiler
builds one of its backward kernels, `chunk_bwd_dqkwg`, wrongly (fla issue #640; seen on an H200 with Triton 3.6).
The rest of the backward is unaffected, and fla's own remedy swaps only that step: it registers a TileLang build of
it in `fla.backends` (which needs tilelang and nvcc). This module registers one more candidate for the same entry
point, taken where fla's Triton build is refused and no earlier backend (TileLang) serves: the same per-chunk
algebra as batched torch matmuls over every chunk at once. The step has no recurrence (each chunk's state h and
state gradient dh come in computed), so there is no loop; everything else in fla's backward stays fla's.

What the step computes, per chunk of BT tokens and value head (q, k of the value head's key head; v the
delta-corrected values; g the gate's cumulative log2 within the chunk, g_last its value on the chunk's last row;
h, dh the chunk's state and state gradient, [K, V]; all products below are over that chunk):
    dq = exp2(g) * (do @ h^T) * scale + ds @ k            ds = tril(do @ v^T * exp2(g_i - g_j)) * scale
    dk = exp2(g_last - g) * (v @ dh^T) + ds^T @ q
    dw = -(dv @ h^T)                                     (the delta rule's w, where fla passes one)
    dg = rowsum(dq * q) - rowsum(dk * k), plus, on the chunk's last row,
         exp2(g_last) * sum(h * dh) + sum(exp2(g_last - g) * (v @ dh^T) * k)
dq and dk are then summed over the value heads sharing a key head. fla's kernel rounds ds to the inputs' dtype
before its two last products; this computes everything in float32 and rounds only the results, and sums dg so
that its terms which cancel exactly do so in float32 too (where fla's kernel leaves an ulp or two).
Legend (fla's layout): q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K]; g [B, T, HV];
h, dh [B, NT, HV, K, V] ([.., V, K] with state_v_first).
"""

from functools import cache

import torch

from ..dispatch import record

# fla's TileLang remedy registers at priority 5; a larger number is tried after it
_PRIORITY = 6
# Chunks per batch of matmuls. A slice's float32 scratch is about 6 x HV x 128 floats per token plus its chunks'
# states: ~250 MiB for 1,024 tokens of Qwen3.6's 48 value heads of 128, whatever the call's length (under the
# planner's delta-rule workspace for a capture chunk, offload/plan.py).
SLICE_CHUNKS = 16


def chunk_bwd_dqkwg_torch(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                          state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla's `chunk_bwd_dqkwg` (fla.ops.common.chunk_o), same arguments and results, for the gated case on
    equal-length sequences (module docstring). Returns dq, dk [B, T, H, K] and dw (None without w) in the inputs'
    dtypes and dg [B, T, HV] in float32 (fla reverse-cumsums it afterwards), each contiguous: fla's kernels that
    take them next address them by raw strides. Computed SLICE_CHUNKS chunks at a time."""
    if not serves(g, g_gamma, cu_seqlens):
        raise ValueError("chunk_bwd_dqkwg_torch serves the gated case (g given, no g_gamma) without cu_seqlens")
    batch, tokens, key_heads, key_dim = k.shape
    value_heads = v.shape[2]
    chunks = -(-tokens // chunk_size)
    scale = key_dim ** -0.5 if scale is None else scale
    dq, dk = (torch.empty(batch, tokens, key_heads, key_dim, dtype=q.dtype, device=q.device) for _ in range(2))
    dw = None if w is None else torch.empty(w.shape, dtype=w.dtype, device=w.device)
    dg = torch.empty(batch, tokens, value_heads, dtype=torch.float32, device=g.device)
    states, state_grads = (x.view(batch, chunks, value_heads, *x.shape[-2:]) for x in (h, dh))
    for first in range(0, chunks, SLICE_CHUNKS):
        last = min(first + SLICE_CHUNKS, chunks)
        rows = slice(first * chunk_size, min(last * chunk_size, tokens))
        dq[:, rows], dk[:, rows], dg[:, rows], slice_dw = _dqkwg_slice(
            q[:, rows], k[:, rows], v[:, rows], do[:, rows], None if w is None else dv[:, rows], g[:, rows],
            states[:, first:last], state_grads[:, first:last], scale, state_v_first, chunk_size)
        if dw is not None:
            dw[:, rows] = slice_dw
    return dq, dk, dw, dg


def _dqkwg_slice(q, k, v, do, dv, g, h, dh, scale, state_v_first, chunk_size):
    """The step over whole chunks of one slice (its last chunk may be short), in float32: dq, dk [B, t, H, K],
    dg [B, t, HV], dw [B, t, HV, K] (None without dv). Value heads are kept as [H, G] (value head h * G + j reads
    key head h, as in fla), so a key head's q and k are read once for its G value heads, never copied G times."""
    batch, tokens, key_heads, key_dim = k.shape
    group = v.shape[2] // key_heads
    chunks = h.shape[1]
    pad = chunks * chunk_size - tokens

    def chunked(x):  # [B, t, heads, D] -> float32 [B, n, BT, heads, D] (or [.., H, G, D]), zero rows past the end
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad))
        x = x.view(batch, chunks, chunk_size, *x.shape[2:])
        return x if x.shape[3] == key_heads else x.view(*x.shape[:3], key_heads, group, x.shape[-1])

    q_, k_ = chunked(q), chunked(k)  # [B, n, BT, H, K]
    v_, do_ = chunked(v), chunked(do)  # [B, n, BT, H, G, V]
    h_, dh_ = (x.float().transpose(-1, -2) if state_v_first else x.float() for x in (h, dh))
    h_, dh_ = (x.view(batch, chunks, key_heads, group, key_dim, -1) for x in (h_, dh_))  # [B, n, H, G, K, V]
    gate = torch.nn.functional.pad(g.float(), (0, 0, 0, pad)).view(batch, chunks, chunk_size, key_heads, group)
    last_row = torch.arange(chunks, device=g.device) * chunk_size + chunk_size - 1
    last_row[-1] = tokens - 1  # the last chunk may be short
    gate_last = g.float()[:, last_row].view(batch, chunks, key_heads, group)

    # products with the chunk's state; padded rows are zero in do, v, q and k, so they contribute nothing
    dq = torch.einsum("bnihgv,bnhgkv->bnihgk", do_, h_) * (torch.exp2(gate) * scale).unsqueeze(-1)
    dk = torch.einsum("bnihgv,bnhgkv->bnihgk", v_, dh_) * torch.exp2(gate_last.unsqueeze(2) - gate).unsqueeze(-1)
    # rowsum(dk * k) of the state part enters dg twice: subtracted on its row, and summed into the chunk's last
    # row; one tensor for both, so that the two cancel exactly where they must (one token without a state)
    dk_k = (dk * k_.unsqueeze(4)).sum(-1)  # [B, n, BT, H, G]
    dg_last = (h_ * dh_).sum((-2, -1)) * torch.exp2(gate_last) + dk_k.sum(2)

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp2(gate.unsqueeze(3) - gate.unsqueeze(2))  # [B, n, BT(i), BT(j), H, G]
    ds = torch.einsum("bnihgv,bnjhgv->bnijhg", do_, v_) * decay * scale
    ds = ds.masked_fill(~causal[:, :, None, None], 0.0)

    # dg = rowsum(dq * q) - rowsum(dk * k). The ds parts of dq and dk contribute rowsum(M) - colsum(M) with
    # M = ds * (q k^T): summed that way they cancel exactly where they must (a chunk of one token has dg = 0
    # there), instead of leaving the rounding of two large, nearly equal rowsums.
    scores = torch.einsum("bnihk,bnjhk->bnijh", q_, k_)
    weighted = ds * scores.unsqueeze(-1)  # M, [B, n, BT(i), BT(j), H, G]
    dg = (dq * q_.unsqueeze(4)).sum(-1) - dk_k + weighted.sum(3) - weighted.sum(2)  # [B, n, BT, H, G]
    dq = dq + torch.einsum("bnijhg,bnjhk->bnihgk", ds, k_)
    dk = dk + torch.einsum("bnijhg,bnihk->bnjhgk", ds, q_)

    dg = dg.reshape(batch, chunks * chunk_size, key_heads * group)
    dg[:, last_row] += dg_last.view(batch, chunks, -1)
    dw = None
    if dv is not None:
        dw = -torch.einsum("bnihgv,bnhgkv->bnihgk", chunked(dv), h_)
        dw = dw.reshape(batch, chunks * chunk_size, key_heads * group, key_dim)[:, :tokens]

    def per_key_head(x):  # [B, n, BT, H, G, K] -> [B, t, H, K], summing the value heads of each key head
        return x.sum(4).reshape(batch, chunks * chunk_size, key_heads, key_dim)[:, :tokens]

    return per_key_head(dq), per_key_head(dk), dg[:, :tokens], dw


def dqkwg_refused(device) -> bool:
    """Whether fla's Triton `chunk_bwd_dqkwg` refuses to run on `device` (`refused_by_fla`)."""
    if device.type != "cuda":
        return False
    return _refused_on(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _refused_on(device_index: int) -> bool:
    import triton

    return refused_by_fla(torch.cuda.get_device_capability(device_index)[0], triton.__version__)


def refused_by_fla(capability_major: int, triton_version: str) -> bool:
    """fla 0.6's own condition: a Hopper GPU (compute capability 9.x) and Triton >= 3.4 and < 3.7.1. A version
    part that is not a plain number ends the comparison ("3.7.1rc1" reads as 3.7: refused, the safe side)."""
    version = []
    for part in triton_version.split("+")[0].split(".")[:3]:
        if not part.isdigit():
            break
        version.append(int(part))
    return capability_major == 9 and (3, 4, 0) <= tuple(version) < (3, 7, 1)


def register_backend(accept=None) -> bool:
    """Registers `chunk_bwd_dqkwg_torch` with fla's backend registry for `chunk_bwd_dqkwg`, taken where
    `accept(q, k, g, g_gamma, cu_seqlens)` holds (default: the gated, equal-length case on a device where fla's
    Triton build is refused). Registering again replaces the previous registration (fla keys backends by type).
    Returns False, registering nothing, where fla has no backend registry (before 0.6; the extra pins 0.6.0) or its
    dispatch is turned off (FLA_DISABLE_BACKEND_DISPATCH=1, read at fla's import): there fla's backward keeps
    refusing, and `fla_applies` keeps autograd calls on the project's kernel."""
    try:
        from fla import backends
    except ImportError:
        return False
    if not hasattr(backends, "register") or getattr(backends, "_DISPATCH_DISABLED", False):
        return False
    import fla.ops.common.chunk_o  # noqa: F401 -- the entry point, whose import creates the "common" registry

    accept = accept or _default_accept

    class TorchDqkwgBackend(backends.BaseBackend):
        backend_type = "ds_longstraw_torch"
        priority = _PRIORITY

        def chunk_bwd_dqkwg_verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                                     state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
            if accept(q, k, g, g_gamma, cu_seqlens):
                return True, None
            return False, "taken only where fla's Triton chunk_bwd_dqkwg is refused (gated, equal lengths)"

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            record("fla backward step dqkwg", "torch")
            return chunk_bwd_dqkwg_torch(*args, **kwargs)

    backends.register("common")(TorchDqkwgBackend)
    return True


def serves(g, g_gamma, cu_seqlens) -> bool:
    """The calls `chunk_bwd_dqkwg_torch` computes: gated (g given, no g_gamma), equal-length sequences."""
    return g is not None and g_gamma is None and cu_seqlens is None


def _default_accept(q, k, g, g_gamma, cu_seqlens) -> bool:
    return serves(g, g_gamma, cu_seqlens) and dqkwg_refused(q.device)


@cache
def ensure_registered() -> bool:
    """`register_backend()` once per process; whether the backend is in place."""
    return register_backend()
