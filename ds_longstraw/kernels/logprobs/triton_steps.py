"""The per-chunk elementwise steps of kernels/logprobs/chunked.py's chunked log-probs as one Triton pass each.

Legend as chunked.py: z_Tc one vocabulary chunk's logits (ids v0 .. v0 + c - 1, bias added) in the inputs' dtype,
targets_T, and the running state max_T, sum_T, target_T in the accumulation dtype (float32; float64 for float64).

Why: the chunked path's matmuls run in cuBLAS, but the torch steps between them pass over each [T, c] chunk
several times in float32 (a cast, the max, the shift, exp, the sum, the gather; in backward the shift, exp, the
scale, the scatter and a cast back). On the H200 those passes were a large share of the chunked path's time at
248K ids (BENCHMARKS.md, "Log-probs of a 1,024-token block over a 248,320-id vocabulary"). Here each step reads
the chunk in its own dtype once (twice where p is written) and computes in the state's dtype:
    forward_step   folds the chunk into (max, sum, target logit) in place, returns exp(old max - new max) and,
                   with want_p, p = exp(z - new max) in the inputs' dtype (a frozen head's direction)
    backward_step  dz = dlogp * (onehot(target) - exp(z - lse)), written over z in the inputs' dtype
The torch steps of the same signatures (`chunked.forward_step_reference`, `chunked.backward_step_reference`) are
the reference; chunked.py takes these only where `chunked.USE_TRITON_STEPS` and the dispatch allow.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # chunked.py's torch steps serve every call
    triton = None

# Tokens per program and columns per loaded tile: a [16, 1024] tile of float32 is 64 KiB, in registers across a
# program's warps; on CPU (the interpreter) small tiles keep the tests quick.
_TILES = {"cuda": (16, 1024), "cpu": (4, 64)}


if triton is not None:
    @triton.jit
    def _forward_step_kernel(Z, s_zt, TARGETS, MAX, SUM, TARGET, RESCALE, P, s_pt, tokens, cols, v0,
                             WANT_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_in = t < tokens
        old_max = tl.load(MAX + t, mask=t_in, other=0.0)
        old_sum = tl.load(SUM + t, mask=t_in, other=0.0)
        column = tl.load(TARGETS + t, mask=t_in, other=-1) - v0
        chunk_max = tl.full([BLOCK_T], float("-inf"), old_max.dtype)
        chunk_sum = tl.zeros([BLOCK_T], old_max.dtype)
        picked = tl.zeros([BLOCK_T], old_max.dtype)
        for c0 in range(0, cols, BLOCK_V):
            c = c0 + tl.arange(0, BLOCK_V)
            z = tl.load(Z + t[:, None] * s_zt + c[None, :], mask=t_in[:, None] & (c < cols)[None, :],
                        other=float("-inf")).to(old_max.dtype)
            z = tl.where(t_in[:, None], z, 0.0)  # rows past the tokens: finite, never stored
            new_max = tl.maximum(chunk_max, tl.max(z, axis=1))
            chunk_sum = chunk_sum * tl.exp(chunk_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
            chunk_max = new_max
            picked += tl.sum(tl.where(c[None, :] == column[:, None], z, 0.0), axis=1)
        # The first chunk meets max -inf and sum 0: exp(-inf) = 0 drops the empty state.
        new_max = tl.maximum(old_max, chunk_max)
        rescale = tl.exp(old_max - new_max)
        tl.store(SUM + t, old_sum * rescale + chunk_sum * tl.exp(chunk_max - new_max), mask=t_in)
        tl.store(MAX + t, new_max, mask=t_in)
        tl.store(RESCALE + t, rescale, mask=t_in)
        inside = (column >= 0) & (column < cols)
        tl.store(TARGET + t, picked, mask=t_in & inside)
        if WANT_P:
            for c0 in range(0, cols, BLOCK_V):
                c = c0 + tl.arange(0, BLOCK_V)
                ok = t_in[:, None] & (c < cols)[None, :]
                z = tl.load(Z + t[:, None] * s_zt + c[None, :], mask=ok, other=0.0).to(old_max.dtype)
                p = tl.exp(z - new_max[:, None])
                tl.store(P + t[:, None] * s_pt + c[None, :], p.to(P.dtype.element_ty), mask=ok)

    @triton.jit
    def _backward_step_kernel(Z, s_zt, TARGETS, LSE, DLOGP, tokens, cols, v0,
                              BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_in = t < tokens
        lse = tl.load(LSE + t, mask=t_in, other=0.0)
        dlogp = tl.load(DLOGP + t, mask=t_in, other=0.0).to(lse.dtype)
        column = tl.load(TARGETS + t, mask=t_in, other=-1) - v0
        for c0 in range(0, cols, BLOCK_V):
            c = c0 + tl.arange(0, BLOCK_V)
            ok = t_in[:, None] & (c < cols)[None, :]
            z = tl.load(Z + t[:, None] * s_zt + c[None, :], mask=ok, other=0.0).to(lse.dtype)
            dz = -dlogp[:, None] * tl.exp(z - lse[:, None])
            dz = tl.where(c[None, :] == column[:, None], dz + dlogp[:, None], dz)
            tl.store(Z + t[:, None] * s_zt + c[None, :], dz.to(Z.dtype.element_ty), mask=ok)


def _tiles(z_Tc):
    return _TILES["cuda" if z_Tc.device.type == "cuda" else "cpu"]


def _rows(z_Tc):
    """z with unit column stride (a matmul's output already is)."""
    return z_Tc if z_Tc.stride(-1) == 1 else z_Tc.contiguous()


def forward_step(z_Tc, targets_T, v0, max_T, sum_T, target_T, want_p):
    """Fold one chunk into the running (max, sum, target logit) in place; returns (p_Tc or None, rescale_T):
    p = exp(z - new max) in z's dtype where want_p, rescale = exp(old max - new max)."""
    z_Tc = _rows(z_Tc)
    tokens, cols = z_Tc.shape
    rescale_T = torch.empty_like(max_T)
    p_Tc = torch.empty_like(z_Tc) if want_p else None
    block_t, block_v = _tiles(z_Tc)
    assert all(x.is_contiguous() for x in (max_T, sum_T, target_T)), "the running state is the loop's own buffers"
    _forward_step_kernel[(triton.cdiv(tokens, block_t),)](
        z_Tc, z_Tc.stride(0), targets_T.contiguous(), max_T, sum_T, target_T, rescale_T, z_Tc if p_Tc is None else p_Tc,
        0 if p_Tc is None else p_Tc.stride(0), tokens, cols, v0, WANT_P=want_p, BLOCK_T=block_t, BLOCK_V=block_v)
    return p_Tc, rescale_T


def backward_step(z_Tc, targets_T, v0, lse_T, dlogp_T):
    """dz = dlogp * (onehot(target) - exp(z - lse)) of one chunk, written over z_Tc (its dtype) and returned."""
    z_Tc = _rows(z_Tc)
    tokens, cols = z_Tc.shape
    block_t, block_v = _tiles(z_Tc)
    _backward_step_kernel[(triton.cdiv(tokens, block_t),)](
        z_Tc, z_Tc.stride(0), targets_T.contiguous(), lse_T.contiguous(), dlogp_T.contiguous(), tokens, cols, v0,
        BLOCK_T=block_t, BLOCK_V=block_v)
    return z_Tc
