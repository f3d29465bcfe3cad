"""Log-probs of target tokens under softmax(hidden @ weight.T + bias) in Triton, without a [T, V] logits tensor.

Legend: T tokens, C channels (hidden size), V vocabulary, S vocabulary splits of the forward's grid.
hidden_TC, weight_VC (the LM head's rows), bias_V, targets_T; max_ST, sum_ST: each split's running max and sum of
exp(z - max) per token (float32); lse_T, logp_T, dlogp_T float32.

    log p(t) = z[t] - lse,   lse = log sum_v exp(z[v]),   d log p(t) / d z[v] = 1[v = t] - exp(z[v] - lse)

What it is: the computation of kernels/logprobs/chunked.py's `chunked_logprobs` (same signature, same numbers up to
rounding) in the cut-cross-entropy layout:
    forward kernel   one program per (token tile, vocabulary split): walks its split tile by tile, each logits
                     tile [BLOCK_T, BLOCK_V] made by tl.dot over the channels (BLOCK_C at a time) in float32, keeps
                     an online max / sum per token and picks the target's logit where the target lies in its split.
                     The S partial (max, sum) pairs merge on the host into lse (`_merge_splits`, [S, T] numbers).
    backward kernel  one program per (token tile, vocabulary tile) of one vocabulary chunk: recomputes its logits
                     tile once, forms dz = dlogp * (onehot - exp(z - lse)) and adds, C tile by C tile,
                     dz @ weight into d(hidden) and dz^T @ hidden into the chunk's d(weight) rows (float32 atomics),
                     sum_t dz into d(bias). Only the gradients autograd asks for are computed.
Why atomics, not one owner per output row: a row of d(hidden) or d(weight) is C wide (5,120 at the 27B's
shape), too wide for one program's registers, so an owner would read-modify-write it in global memory once per
tile anyway; an owner of d(hidden) rows has only T / BLOCK_T programs (16 at T 1,024) unless the vocabulary is
split, and then needs [S, T, C] partials; and separate d(hidden) and d(weight) kernels recompute the logits twice
(four matmuls instead of three). With atomics each logits tile is recomputed once, the grid is
(T / BLOCK_T) x (chunk / BLOCK_V) programs, and the float32 d(hidden) [T, C] (20 MiB at T 1,024, C 5,120) stays in
L2 while programs that share a weight tile run side by side (the token tile is the grid's fastest axis). The price:
the float32 sums' order depends on scheduling, so gradients are not bitwise reproducible (differences of float32
rounding, below the bfloat16 rounding of the returned gradients).
The risk to measure: the atomic traffic. Every (token tile, vocabulary tile) program adds BLOCK_T x C to d(hidden)
and BLOCK_V x C to d(weight), so one backward makes T x C x (V / BLOCK_V) + V x C x (T / BLOCK_T) float32 atomic
adds: 3.0e10 at T 1,024, C 5,120, V 248,320 with the CUDA tiles below, against about 4 matmuls' worth of tensor-core
work (the torch chunked path on the H200, a large share of whose time is elementwise passes over [T, c]:
BENCHMARKS.md, "Log-probs of a 1,024-token block over a 248,320-id vocabulary"). If
the GPU check shows the atomics dominate, the likelier win is cuBLAS for the chunk matmuls with one fused Triton
pass for the elementwise work (online softmax and target in forward; dz in place in backward).

vocab_chunk: the ids of one vocabulary split in the forward and of one backward launch, rounded up to a multiple
of BLOCK_V. The backward accumulates a chunk's d(weight) rows in a float32 [chunk, C] buffer (160 MiB at 8,192
ids x 5,120 channels) and writes them to d(weight) in the weight's dtype; so neither pass holds a [T, V] tensor,
and the largest float32 buffers are d(hidden) [T, C] and that chunk buffer.

Precision: products in the inputs' dtype (bfloat16 / float16 on tensor cores; float32 at full "ieee" precision),
sums and the softmax in float32; logits are not rounded to the inputs' dtype (the plain path rounds them), dz is,
before the two gradient matmuls (as the plain path's backward). log p is float32. What it is not: a float64 path
(tl.dot has none): `supported` says no, and the caller takes kernels/logprobs/chunked.py's torch paths.
Targets must lie in [0, V); a token whose target does not gets log p = NaN.

Four layers (STYLE.md 2): Triton kernels -> host launchers (`logprobs_forward_triton`, `logprobs_backward_triton`,
the signatures of kernels/logprobs/chunked.py's `_forward` / `_backward`) -> `_TritonLogprobs` -> `triton_logprobs`, the
public function; its torch references are `chunked_logprobs` and `logprobs_reference`. It runs the kernels on
whatever device its tensors are on: the caller decides (kernels.dispatch.fast_path(hidden, "triton") and
`supported`); CPU tensors reach Triton only in the tests, under the Triton interpreter.
"""

import torch

from ..triton_common import dot_precision
from .chunked import check_logprob_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths serve every call (`supported` says so)
    triton = None

# Vocabulary ids per forward split and per backward launch (see the module docstring); chunked_logprobs' default.
VOCAB_CHUNK = 8192

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The partial (max, sum) buffers and d(weight) are written by the kernels / chunk by chunk into uninitialised
# memory; tests poison them (NaN) here.
_uninitialised = torch.empty


def supported(hidden_TC, weight_VC, bias_V=None) -> bool:
    """Whether the kernels take these inputs: triton importable, hidden and weight of one dtype that tl.dot takes
    (float32, bfloat16, float16; not float64), bias (if any) of such a dtype, all on one device."""
    if triton is None or hidden_TC.dtype not in _DTYPES or weight_VC.dtype != hidden_TC.dtype:
        return False
    if weight_VC.device != hidden_TC.device:
        return False
    return bias_V is None or (bias_V.dtype in _DTYPES and bias_V.device == hidden_TC.device)


# -- Triton kernels --------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _span(start, BLOCK: tl.constexpr, limit):
        """(indices start .. start + BLOCK - 1, which of them are < limit)."""
        index = start + tl.arange(0, BLOCK)
        return index, index < limit

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_ok, cols, col_ok, channels, s_ht, s_hc, s_wv, s_wc, s_b,
                     HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
        """z [BLOCK_T, BLOCK_V] float32 = hidden[rows] @ weight[cols].T (+ bias[cols]); 0 (plus bias) where masked."""
        z = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        cols = cols.to(tl.int64)  # V x C may pass 2^31 elements
        for c0 in range(0, channels, BLOCK_C):
            dims, dim_ok = _span(c0, BLOCK_C, channels)
            h = tl.load(h_ptr + rows[:, None] * s_ht + dims[None, :] * s_hc, mask=row_ok[:, None] & dim_ok[None, :],
                        other=0.0)
            w_t = tl.load(w_ptr + dims[:, None] * s_wc + cols[None, :] * s_wv, mask=dim_ok[:, None] & col_ok[None, :],
                          other=0.0)  # [BLOCK_C, BLOCK_V]: weight rows read as columns
            z = tl.dot(h, w_t, z, input_precision=PRECISION)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols * s_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return z

    @triton.jit
    def _forward_kernel(
        h_ptr, w_ptr, b_ptr, tgt_ptr, max_ptr, sum_ptr, zt_ptr,
        tokens, vocab, channels, split_ids,
        s_ht, s_hc, s_wv, s_wc, s_b, s_ms,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        rows, row_ok = _span(tile * BLOCK_T, BLOCK_T, tokens)
        target = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        v_first = split * split_ids  # split_ids is a multiple of BLOCK_V: a tile never crosses two splits
        v_end = tl.minimum(vocab, v_first + split_ids)
        run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_T], tl.float32)
        z_target = tl.zeros([BLOCK_T], tl.float32)
        for v0 in range(v_first, v_end, BLOCK_V):
            cols, col_ok = _span(v0, BLOCK_V, v_end)
            z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_ok, cols, col_ok, channels, s_ht, s_hc, s_wv, s_wc, s_b,
                             HAS_BIAS, PRECISION, BLOCK_T, BLOCK_V, BLOCK_C)
            z = tl.where(col_ok[None, :], z, float("-inf"))
            z_target += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), 1)
            # Every tile holds at least one id (v0 < v_end), so new_max is finite and the first rescale is exp(-inf).
            new_max = tl.maximum(run_max, tl.max(z, 1))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), 1)
            run_max = new_max
        tl.store(max_ptr + split * s_ms + rows, run_max, mask=row_ok)
        tl.store(sum_ptr + split * s_ms + rows, run_sum, mask=row_ok)
        # Each target lies in exactly one split: that program writes its logit (targets outside [0, V) stay NaN).
        tl.store(zt_ptr + rows, z_target, mask=row_ok & (target >= v_first) & (target < v_end))

    @triton.jit
    def _backward_kernel(
        h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, dlogp_ptr, dh_ptr, dw_ptr, db_ptr,
        tokens, vocab, channels, chunk_first,
        s_ht, s_hc, s_wv, s_wc, s_b,
        HAS_BIAS: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        # The token tile is the fastest grid axis: the programs of one vocabulary tile run side by side and share
        # its weight rows and d(weight) rows in L2.
        tile = tl.program_id(0)
        rows, row_ok = _span(tile * BLOCK_T, BLOCK_T, tokens)
        cols, col_ok = _span(chunk_first + tl.program_id(1) * BLOCK_V, BLOCK_V, vocab)
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_ok, cols, col_ok, channels, s_ht, s_hc, s_wv, s_wc, s_b,
                         HAS_BIAS, PRECISION, BLOCK_T, BLOCK_V, BLOCK_C)
        target = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("inf"))  # padding rows: p = 0, not exp(z) = inf
        dlogp = tl.load(dlogp_ptr + rows, mask=row_ok, other=0.0)
        onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        dz = dlogp[:, None] * (onehot - tl.exp(z - lse[:, None]))
        dz = tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)  # padding rows and ids add nothing
        if NEED_B:
            tl.atomic_add(db_ptr + cols, tl.sum(dz, 0), mask=col_ok, sem="relaxed")
        dz = dz.to(h_ptr.dtype.element_ty)  # like the plain path: the logits' gradient in the inputs' dtype
        for c0 in range(0, channels, BLOCK_C):
            dims, dim_ok = _span(c0, BLOCK_C, channels)
            if NEED_H:
                w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * s_wv + dims[None, :] * s_wc,
                            mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
                tl.atomic_add(dh_ptr + rows[:, None] * channels + dims[None, :],
                              tl.dot(dz, w, input_precision=PRECISION), mask=row_ok[:, None] & dim_ok[None, :],
                              sem="relaxed")
            if NEED_W:
                h = tl.load(h_ptr + rows[:, None] * s_ht + dims[None, :] * s_hc,
                            mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
                tl.atomic_add(dw_ptr + (cols - chunk_first)[:, None] * channels + dims[None, :],
                              tl.dot(tl.trans(dz), h, input_precision=PRECISION),
                              mask=col_ok[:, None] & dim_ok[None, :], sem="relaxed")


# -- host launchers --------------------------------------------------------------------------------------------
# (BLOCK_T, BLOCK_V, BLOCK_C, warps, stages) on CUDA: the usual shape of a bfloat16 matmul tile with float32
# accumulation; starting points, not yet measured against other tiles. tl.dot needs every side >= 16.
_FORWARD_TILES = (64, 128, 64, 4, 3)
_BACKWARD_TILES = (64, 128, 64, 8, 2)


def _tiles(kind):
    """(BLOCK_T, BLOCK_V, BLOCK_C, warps, stages) of the "forward" or the "backward" kernel."""
    return _FORWARD_TILES if kind == "forward" else _BACKWARD_TILES


def _chunk_ids(vocab_chunk, block_v):
    """vocab_chunk rounded up to a whole number of vocabulary tiles."""
    return triton.cdiv(vocab_chunk, block_v) * block_v


def _bias_args(bias_V, weight_VC):
    """(pointer, stride) of the bias; without one the weight stands in (HAS_BIAS is off: never read)."""
    return (weight_VC, 0) if bias_V is None else (bias_V, bias_V.stride(0))


def _merge_splits(max_ST, sum_ST):
    """lse_T of the whole vocabulary from each split's (max, sum of exp(z - max)): logsumexp of max + log(sum).
    Every split holds an id, so each max is finite and each sum >= 1."""
    return torch.logsumexp(max_ST + torch.log(sum_ST), dim=0)


def logprobs_forward_triton(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk):
    """(logp_T, lse_T) float32: the Triton forward, kernels/logprobs/chunked.py `_forward`'s signature and result."""
    tokens, channels = hidden_TC.shape
    vocab = weight_VC.shape[0]
    block_t, block_v, block_c, warps, stages = _tiles("forward")
    split_ids = _chunk_ids(vocab_chunk, block_v)
    splits = triton.cdiv(vocab, split_ids)
    device = hidden_TC.device
    max_ST = _uninitialised((splits, tokens), dtype=torch.float32, device=device)
    sum_ST = _uninitialised((splits, tokens), dtype=torch.float32, device=device)
    z_target_T = torch.full((tokens,), float("nan"), dtype=torch.float32, device=device)
    if tokens == 0:
        return z_target_T, z_target_T.clone()
    b_ptr, s_b = _bias_args(bias_V, weight_VC)
    _forward_kernel[(triton.cdiv(tokens, block_t), splits)](
        hidden_TC, weight_VC, b_ptr, targets_T, max_ST, sum_ST, z_target_T,
        tokens, vocab, channels, split_ids,
        *hidden_TC.stride(), *weight_VC.stride(), s_b, max_ST.stride(0),
        HAS_BIAS=bias_V is not None, PRECISION=dot_precision(hidden_TC.dtype),
        BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_C=block_c, num_warps=warps, num_stages=stages,
    )
    lse_T = _merge_splits(max_ST, sum_ST)
    return z_target_T - lse_T, lse_T


def logprobs_backward_triton(hidden_TC, weight_VC, bias_V, targets_T, lse_T, dlogp_T, vocab_chunk, need):
    """Gradients of sum(dlogp * log p) w.r.t. (hidden, weight, bias) in their dtypes, None where not `need`ed:
    the Triton backward, kernels/logprobs/chunked.py `_backward`'s signature and result."""
    need_hidden, need_weight, need_bias = need
    need_bias = need_bias and bias_V is not None
    tokens, channels = hidden_TC.shape
    vocab = weight_VC.shape[0]
    device = hidden_TC.device
    block_t, block_v, block_c, warps, stages = _tiles("backward")
    chunk_ids = _chunk_ids(vocab_chunk, block_v)
    # float32 accumulators the kernel adds into (zeros); d(weight) is written chunk by chunk in the weight's dtype.
    dhidden_TC = torch.zeros((tokens, channels), dtype=torch.float32, device=device) if need_hidden else None
    dbias_V = torch.zeros(vocab, dtype=torch.float32, device=device) if need_bias else None
    dweight_VC = _uninitialised(weight_VC.shape, dtype=weight_VC.dtype, device=device) if need_weight else None
    dweight_cC = torch.empty((min(chunk_ids, vocab), channels), dtype=torch.float32, device=device) \
        if need_weight else None
    if tokens == 0:
        if need_weight:
            dweight_VC.zero_()
    elif need_hidden or need_weight or need_bias:
        lse_T = lse_T.to(torch.float32).contiguous()
        dlogp_T = dlogp_T.to(torch.float32).contiguous()
        b_ptr, s_b = _bias_args(bias_V, weight_VC)
        spare = lse_T  # stands in for the outputs not asked for (their NEED_ flag is off: never touched)
        for v0 in range(0, vocab, chunk_ids):
            v1 = min(vocab, v0 + chunk_ids)
            if need_weight:
                dweight_cC.zero_()
            _backward_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(v1 - v0, block_v))](
                hidden_TC, weight_VC, b_ptr, targets_T, lse_T, dlogp_T,
                spare if dhidden_TC is None else dhidden_TC, spare if dweight_cC is None else dweight_cC,
                spare if dbias_V is None else dbias_V,
                tokens, vocab, channels, v0,
                *hidden_TC.stride(), *weight_VC.stride(), s_b,
                HAS_BIAS=bias_V is not None, NEED_H=need_hidden, NEED_W=need_weight, NEED_B=need_bias,
                PRECISION=dot_precision(hidden_TC.dtype), BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_C=block_c,
                num_warps=warps, num_stages=stages,
            )
            if need_weight:
                dweight_VC[v0:v1] = dweight_cC[:v1 - v0]
    return (None if dhidden_TC is None else dhidden_TC.to(hidden_TC.dtype), dweight_VC,
            None if dbias_V is None else dbias_V.to(bias_V.dtype))


# -- autograd and the public function -------------------------------------------------------------------------
class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk):
        logp_T, lse_T = logprobs_forward_triton(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk)
        ctx.save_for_backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T)
        ctx.vocab_chunk = vocab_chunk
        return logp_T

    @staticmethod
    def backward(ctx, dlogp_T):
        hidden_TC, weight_VC, bias_V, targets_T, lse_T = ctx.saved_tensors
        dhidden, dweight, dbias = logprobs_backward_triton(hidden_TC, weight_VC, bias_V, targets_T, lse_T, dlogp_T,
                                                           ctx.vocab_chunk, ctx.needs_input_grad[:3])
        return dhidden, dweight, dbias, None, None


def triton_logprobs(hidden_TC, weight_VC, targets_T, bias_V=None, vocab_chunk=VOCAB_CHUNK):
    """log softmax(hidden @ weight.T + bias)[t, targets[t]] for each token t, as [T] float32: `chunked_logprobs`'
    signature and numbers, by the Triton kernels above (an online log-sum-exp over vocabulary splits of
    `vocab_chunk` ids in forward; logits recomputed tile by tile in backward), so no [T, V] tensor is ever made.

    Differentiable w.r.t. hidden, weight and bias; gradients are computed only where autograd asks for them.
    Inputs: hidden and weight of one dtype among float32, bfloat16, float16 (`supported`; float64 is not: the
    caller takes the torch path); targets in [0, V) (others give NaN). Runs on the tensors' device: the caller
    decides that Triton may run there (kernels.dispatch.fast_path). Gradients come from float32 atomic sums, so
    they are not bitwise reproducible from run to run.
    """
    check_logprob_inputs(hidden_TC, weight_VC, targets_T, bias_V, vocab_chunk)
    if not supported(hidden_TC, weight_VC, bias_V):
        bias = None if bias_V is None else f"{bias_V.dtype} on {bias_V.device}"
        raise ValueError(f"triton_logprobs does not take hidden {hidden_TC.dtype} on {hidden_TC.device}, weight "
                         f"{weight_VC.dtype} on {weight_VC.device}, bias {bias} (triton importable: "
                         f"{triton is not None}; see `supported`): use chunked_logprobs")
    targets_T = targets_T.to(device=hidden_TC.device, dtype=torch.long).contiguous()
    return _TritonLogprobs.apply(hidden_TC, weight_VC, bias_V, targets_T, int(vocab_chunk))
