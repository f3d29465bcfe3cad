"""DSA selection in Triton: the indexer's scores of a query block over its visible keys, then the canonical top-k.

Legend: T queries, I indexer heads, D indexer head dim, N keys (all pieces), W the keys a query block scores (those
up to its causal horizon), k the candidates kept. Layouts: q_TID [T, I, D]; weights_TI [T, I]; keys: token-major
pieces [N_s, D] (any row stride, unit column stride); scores_TW float32 [Tq, W]; candidates (scores [T, k] float32,
positions [T, k] int64) in canonical order.

What it is: the selection of selection.py (`dsa_select`, `extend_candidates`), same
signatures, same result. `_scores_kernel` computes score(t, j) = sum_i w_i(t) * relu(scale * q_i(t) . k(j)) for a
tile of (queries, keys), -inf where j > t (causal) or outside the keys, and writes it into the query block's score
row at the key's column, piece by piece (no concatenated keys). Dot products take bfloat16 / float16 operands as
they are (exact products, float32 accumulation) and float32 ones at full "ieee" precision; mixed dtypes are
upcast to float32.

The top-k is not fused into the kernel: a per-query running top-k of GLM-5's 2048 in registers is impractical
in Triton. It is `torch.topk` over one int64 key per score that orders like (score descending, position
ascending): the float32 score's bits mapped to an order-preserving int32 (negative floats have their magnitude
bits flipped; -0.0 is made +0.0 first so that the zeros tie) in the high 32 bits, and 2^32 - 1 - column in the
low 32. Every key is distinct, so topk's order is total and equals the stable descending sort the torch code uses
(`merge_candidates`): the same set and order, ties included, whenever the scores are equal. What it is not:
bit-identical scores. The torch path sums the heads in another order, so two keys whose scores differ by a
rounding error may swap between the paths (exact ties, the relu's zeros and repeated keys, stay exact). On an
H200 (T 1024, 16K keys, I 32, D 128, k 2048, random bfloat16) it selected the same set as the torch path, with the
order of a few near-tied positions swapped; its time beside the torch path's: BENCHMARKS.md, "The Triton kernels
on the H200 (bf16)".

Gradient-free, as the model defines the selection (the indexer's weights get no gradient from the LM loss).
Memory: a query block's scores [Tq, W] float32 and its int64 keys (with one temporary as large), Tq * W at most
BLOCK_ELEMENTS.
"""

import torch
import torch.nn.functional as F

from ..triton_common import pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch functions serve every call (fast_path says so)
    triton = None

# Elements of one query block's scores [Tq, W]: 2^24 is 64 MiB of float32 scores and 128 MiB of int64 keys.
BLOCK_ELEMENTS = 1 << 24


def supported(q_TID, weights_TI, keys):
    """Whether the kernel takes these inputs: scores in float32 (inputs in float32, bfloat16 or float16), one
    device, unit column stride."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if triton is None or q_TID.dtype not in dtypes:
        return False
    return all(x.dtype in dtypes and x.device == q_TID.device and (x.shape[0] == 0 or x.stride(-1) == 1)
               for x in (weights_TI, *keys))


if triton is not None:

    @triton.jit
    def _scores_kernel(Q, W, KEYS, OUT, tokens, n_keys, D, scale, key_first, query_first,
                       s_qt, s_qi, s_wt, s_wi, s_kn, s_ot, out_col,
                       HEADS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        t_in, n_in, d_in = t < tokens, n < n_keys, d < D
        keys = tl.load(KEYS + n[:, None] * s_kn + d[None, :], mask=n_in[:, None] & d_in[None, :], other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for i in tl.static_range(HEADS):
            q = tl.load(Q + t[:, None] * s_qt + i * s_qi + d[None, :], mask=t_in[:, None] & d_in[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(W + t * s_wt + i * s_wi, mask=t_in, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
            acc += w[:, None] * tl.maximum(s, 0.0)
        hidden = ~n_in[None, :]
        if CAUSAL:
            hidden = hidden | ((key_first + n)[None, :] > (query_first + t)[:, None])
        acc = tl.where(hidden, float("-inf"), acc)
        tl.store(OUT + t[:, None] * s_ot + out_col + n[None, :], acc, mask=t_in[:, None] & (n < n_keys)[None, :])


def index_scores(q_TID, weights_TI, keys, key_start, query_start, scale, width):
    """scores [T, width] float32 of the queries (at positions query_start .., or None: after every key) over the
    keys at positions key_start .. key_start + width - 1, taken from the pieces `keys` (in position order from
    key_start; keys past width are not scored); -inf where a key is beyond the query's horizon."""
    tokens, heads, dim = q_TID.shape
    out = torch.empty(tokens, width, dtype=torch.float32, device=q_TID.device)
    if tokens == 0 or width == 0:
        return out
    upcast = any(x.dtype != q_TID.dtype for x in keys) or q_TID.dtype == torch.float32
    precision = "ieee" if upcast else None
    block_t, block_n = 16, 64 if q_TID.device.type == "cuda" else 16
    column = 0
    for piece in keys:
        if column == width:
            break
        n = min(piece.shape[0], width - column)
        if n == 0:  # an empty piece
            continue
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(n, block_n))
        _scores_kernel[grid](
            q_TID, weights_TI, piece, out, tokens, n, dim, float(scale), key_start + column,
            0 if query_start is None else query_start,
            q_TID.stride(0), q_TID.stride(1), weights_TI.stride(0), weights_TI.stride(1), piece.stride(0),
            out.stride(0), column, HEADS=heads, CAUSAL=query_start is not None, UPCAST=upcast, PRECISION=precision,
            BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=pow2(dim))
        column += n
    assert column == width, "the pieces cover the scored keys"
    return out


def canonical_topk(scores_TW, k):
    """Columns [T, k] of the k best scores in canonical order (score descending, then column ascending), and those
    scores: torch.topk over int64 keys that are all distinct (see the module docstring)."""
    scores = torch.where(scores_TW == 0, torch.zeros_like(scores_TW), scores_TW)  # -0.0 -> +0.0: zeros tie
    keys = scores.view(torch.int32).to(torch.int64)
    del scores
    keys.bitwise_xor_((keys < 0).to(torch.int64).mul_(0x7FFFFFFF))  # negative floats: int order == float order
    columns = torch.arange(scores_TW.shape[1], dtype=torch.int64, device=scores_TW.device)
    keys.bitwise_left_shift_(32).bitwise_or_(0xFFFFFFFF - columns)  # in place: [Tq, W] int64 once
    top = torch.topk(keys, k, dim=-1, sorted=True).indices
    return top, scores_TW.gather(-1, top)


def _pad(tensors, value):
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def candidates(q_TID, weights_TI, keys, key_start, query_start, topk, scale, block_elements=None):
    """Canonical candidates (scores [T, k] float32, positions [T, k] int64) of the queries at positions
    query_start .. (None: after every key) over the pieces `keys` at positions key_start ..: for each query block
    the keys up to its horizon are scored and the min(topk, scored keys) best kept (-inf marks a key the query
    cannot see)."""
    tokens = q_TID.shape[0]
    device = q_TID.device
    total = sum(piece.shape[0] for piece in keys)
    block_elements = block_elements or BLOCK_ELEMENTS
    block = max(1, min(tokens, block_elements // max(1, total)))
    out_scores, out_pos = [], []
    with torch.no_grad():
        for q0 in range(0, tokens, block):
            q1 = min(tokens, q0 + block)
            width = total if query_start is None else max(0, min(total, query_start + q1 - key_start))
            if width == 0:
                out_scores.append(torch.full((q1 - q0, 0), float("-inf"), device=device))
                out_pos.append(torch.zeros((q1 - q0, 0), dtype=torch.long, device=device))
                continue
            scores = index_scores(q_TID[q0:q1], weights_TI[q0:q1], keys, key_start,
                                  None if query_start is None else query_start + q0, scale, width)
            columns, best = canonical_topk(scores, min(topk, width))
            out_scores.append(best)
            out_pos.append(columns + key_start)
    if not out_scores:
        return (torch.full((tokens, 0), float("-inf"), device=device),
                torch.zeros((tokens, 0), dtype=torch.long, device=device))
    return _pad(out_scores, float("-inf")), _pad(out_pos, 0)
