"""Partial softmax attention of a query block over keys/values that stay on their pages, read through a page table.

Legend: H query heads, K key/value heads (H % K == 0, head h reads kv head h // (H // K)), Tq queries, Tk keys
(`tokens`), D head dim, P page tokens, N pages in the page tensor, M pages named by the table.
Layouts (token-major, as offload/pages.py stores a layer's "k"/"v" streams [tokens, K, D] cut into pages of P):
    q_HTD, out_HTD, dout_HTD [H, Tq, D]; lse_HT, delta_HT [H, Tq] (float32; float64 in the torch reference);
    k_NPKD, v_NPKD [N, P, K, D]: the page tensor (any strides; a pool's arena [N * P, K, D] viewed as pages);
    table_M int32 [M]: key t of the attended sequence is row t % P of page table_M[t // P]; keys t >= tokens are
    not there (the last named page may be partial);
    dk_NPKD, dv_NPKD [N', P, K, D]: gradient pages, addressed through `grad_table_M` (default: the same table).

What it is: exact attention (no causal mask by default: prompt pages lie entirely before the query block; with
`causal_offset` query i sees key j iff j <= i + causal_offset), returning the partial (out, lse) that
kernels/lse.merge_partials combines with other key sets. A query that sees no key gets out = 0, lse = -inf.
The forward is an online softmax with float32 accumulation that loads each key block straight from its pages (no
gathered [Tk, D] copy). The backward takes the MERGED out and lse (delta = rowsum(dout * out) - dlse, as
kernels/attention/reference.blockwise_grads_from_delta), so this key set's share of the gradients is exact on its own:
    dq kernel     one program per (query block, query head), walks the key blocks;
    dK/dV kernel  one program per (key block, kv head), walks the query heads of its group and the query blocks,
                  then adds its dK/dV rows to the gradient pages (read, add, write): each gradient row has one owner,
                  so no atomics and no [Tk, D] dense gradient alive. The table must not name a page twice.
What it is not: a fused dq/dK/dV backward (scores are recomputed once per kernel), nor a kernel for the block's
causal attention over itself (kernels/attention/partial.py keeps that).

Four layers (STYLE.md 2): Triton kernels -> host launchers (`paged_attention_forward_triton`,
`paged_grads_from_delta_triton`) -> `_PagedPartialAttention` -> `paged_partial_attention`, the public function. The
torch references (`paged_attention_forward_reference` = `paged_partial_attention_reference`,
`paged_grads_from_delta_reference`) have the same signatures: they gather the pages and call
`partial_attention_reference` / `blockwise_grads_from_delta`. The Triton path is taken only where
`kernels.dispatch.fast_path(q, "triton")` says so (a CUDA tensor, mode "auto"); CPU tensors never reach Triton
outside the tests, which run the kernels under the Triton interpreter.
"""

import torch

from ..dispatch import available, fast_path
from ..triton_common import dot_precision
from .reference import attention_delta, blockwise_grads_from_delta, partial_attention_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference serves every call (fast_path says so)
    triton = None
else:
    from ..triton_common import online_softmax_finish, online_softmax_start, online_softmax_step


def _pages_shape_check(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens):
    """Internal invariants of the layouts above (the public function raises ValueError before this)."""
    assert q_HTD.dim() == 3 and k_NPKD.dim() == 4 and v_NPKD.shape == k_NPKD.shape
    assert q_HTD.shape[0] % k_NPKD.shape[2] == 0 and q_HTD.shape[2] == k_NPKD.shape[3]
    assert 0 <= tokens <= page_table_M.numel() * k_NPKD.shape[1]


# -- torch reference -------------------------------------------------------------------------------------------
def gather_pages(pages_NPKD, page_table_M, tokens):
    """[K, tokens, D]: the keys (or values) the table names, in order (a copy; differentiable into the pages)."""
    _, page_tokens, kv_heads, d = pages_NPKD.shape
    rows = pages_NPKD[page_table_M.long()].reshape(-1, kv_heads, d)[:tokens]
    return rows.transpose(0, 1)


def paged_attention_forward_reference(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset=None):
    """(out_HTD, lse_HT) of q over the paged keys: gather, then `partial_attention_reference` (plain autograd)."""
    _pages_shape_check(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens)
    return partial_attention_reference(q_HTD, gather_pages(k_NPKD, page_table_M, tokens),
                                       gather_pages(v_NPKD, page_table_M, tokens), scale, causal_offset)


paged_partial_attention_reference = paged_attention_forward_reference


def _token_rows(page_table_M, tokens, page_tokens):
    t = torch.arange(tokens, device=page_table_M.device)
    return page_table_M.long()[t // page_tokens], t % page_tokens


def paged_grads_from_delta_reference(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, lse_HT, dout_HTD, delta_HT,
                                     scale, dk_NPKD=None, dv_NPKD=None, grad_table_M=None, causal_offset=None):
    """This key set's share of dq (returned, accumulation precision) given the MERGED lse and delta; dK/dV are
    added to the gradient pages dk_NPKD / dv_NPKD (rows named by grad_table_M, default page_table_M) when given."""
    _pages_shape_check(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens)
    need_kv = dk_NPKD is not None
    dq, dk_KTD, dv_KTD = blockwise_grads_from_delta(
        q_HTD, gather_pages(k_NPKD, page_table_M, tokens), gather_pages(v_NPKD, page_table_M, tokens), lse_HT,
        dout_HTD, delta_HT, scale, causal_offset, need_kv=need_kv)
    if need_kv and tokens:
        pages, slots = _token_rows(page_table_M if grad_table_M is None else grad_table_M, tokens, k_NPKD.shape[1])
        dk_NPKD.index_put_((pages, slots), dk_KTD.transpose(0, 1).to(dk_NPKD.dtype), accumulate=True)
        dv_NPKD.index_put_((pages, slots), dv_KTD.transpose(0, 1).to(dv_NPKD.dtype), accumulate=True)
    return dq


# -- Triton kernels --------------------------------------------------------------------------------------------
if triton is not None:
    # Strides come as tuples, named for their tensor's layout: s_HTD (q, out, dout, dq), s_NPKD (k, v and gradient
    # pages), s_HT (lse; delta shares its strides).

    @triton.jit
    def _page_rows(table_ptr, cols, tokens, page_tokens):
        """(page, row in page) of keys `cols` (int64, page 0 for keys past the end: they are masked)."""
        page = tl.load(table_ptr + cols // page_tokens, mask=cols < tokens, other=0).to(tl.int64)
        return page, (cols % page_tokens).to(tl.int64)

    @triton.jit
    def _span(start, BLOCK: tl.constexpr, limit):
        """(indices start .. start + BLOCK - 1, which of them are < limit)."""
        index = start + tl.arange(0, BLOCK)
        return index, index < limit

    @triton.jit
    def _page_tile(ptr, page, slot, kv_head, dims, s_NPKD):
        """Addresses [BLOCK_N, BLOCK_D] of kv head `kv_head`'s rows (page, slot) in a page tensor."""
        return (ptr + page[:, None] * s_NPKD[0] + slot[:, None] * s_NPKD[1] + kv_head * s_NPKD[2]
                + dims[None, :] * s_NPKD[3])

    @triton.jit
    def _head_tile(ptr, head, rows, dims, s_HTD):
        """Addresses [BLOCK_M, BLOCK_D] of query rows `rows` of head `head` in a [H, Tq, D] tensor."""
        return ptr + head * s_HTD[0] + rows[:, None] * s_HTD[1] + dims[None, :] * s_HTD[2]

    @triton.jit
    def _load_kv(k_ptr, v_ptr, table_ptr, cols, col_ok, dims, dim_ok, kv_head, tokens, page_tokens, sk_NPKD,
                 sv_NPKD):
        """(k, v) [BLOCK_N, BLOCK_D] of keys `cols`, read from their pages through the table (0 where masked)."""
        page, slot = _page_rows(table_ptr, cols, tokens, page_tokens)
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(_page_tile(k_ptr, page, slot, kv_head, dims, sk_NPKD), mask=kv_mask, other=0.0)
        v = tl.load(_page_tile(v_ptr, page, slot, kv_head, dims, sv_NPKD), mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _load_grad_rows(q_ptr, dout_ptr, lse_ptr, delta_ptr, head, rows, row_ok, dims, dim_ok, sq_HTD, sdo_HTD,
                        s_HT):
        """(q, dout, lse, delta) of query rows `rows` of head `head`: what both backward kernels read per row."""
        tile = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(_head_tile(q_ptr, head, rows, dims, sq_HTD), mask=tile, other=0.0)
        dout = tl.load(_head_tile(dout_ptr, head, rows, dims, sdo_HTD), mask=tile, other=0.0)
        lse = tl.load(lse_ptr + head * s_HT[0] + rows * s_HT[1], mask=row_ok, other=float("-inf"))
        delta = tl.load(delta_ptr + head * s_HT[0] + rows * s_HT[1], mask=row_ok, other=0.0)
        return q, dout, lse, delta

    @triton.jit
    def _query_program(tq, group, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """What a program over (query block, query head) starts from: (block, head, its kv head, the block's query
        rows and which are < tq, the head dims and which are < D)."""
        block = tl.program_id(0)
        head = tl.program_id(1)
        rows, row_ok = _span(block * BLOCK_M, BLOCK_M, tq)
        dims, dim_ok = _span(0, BLOCK_D, D)
        return block, head, head // group, rows, row_ok, dims, dim_ok

    @triton.jit
    def _key_end(block, tokens, causal_offset, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """Keys a query block walks: all `tokens`, or with CAUSAL none past the last query's horizon."""
        end = tokens
        if CAUSAL:
            end = tl.minimum(tokens, tl.maximum(block * BLOCK_M + BLOCK_M + causal_offset, 0))
        return end

    @triton.jit
    def _scores(q, k, rows, cols, row_ok, col_ok, scale, causal_offset, CAUSAL: tl.constexpr,
                PRECISION: tl.constexpr):
        """(s, seen) of one (query block, key block) tile: the scaled scores and which keys each query sees."""
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + causal_offset)
        return s, seen

    @triton.jit
    def _probabilities(q, k, rows, cols, row_ok, col_ok, lse, scale, causal_offset,
                       CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
        """p = exp(s - lse) of one (query block, key block) tile with the MERGED lse; 0 where a key is not seen."""
        s, seen = _scores(q, k, rows, cols, row_ok, col_ok, scale, causal_offset, CAUSAL, PRECISION)
        safe_lse = tl.where(lse == float("-inf"), 0.0, lse)
        return tl.where(seen, tl.exp(s - safe_lse[:, None]), 0.0)

    @triton.jit
    def _paged_forward_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, lse_ptr, tokens, page_tokens, tq, group, scale, causal_offset,
        sq_HTD, sk_NPKD, sv_NPKD, so_HTD, sl_HT,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    ):
        block, head, kv_head, rows, row_ok, dims, dim_ok = _query_program(tq, group, D, BLOCK_D, BLOCK_M)
        tile = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(_head_tile(q_ptr, head, rows, dims, sq_HTD), mask=tile, other=0.0)
        run_max, run_sum, acc = online_softmax_start(BLOCK_M, BLOCK_D)
        for start in range(0, _key_end(block, tokens, causal_offset, BLOCK_M, CAUSAL), BLOCK_N):
            cols, col_ok = _span(start, BLOCK_N, tokens)
            k, v = _load_kv(k_ptr, v_ptr, table_ptr, cols, col_ok, dims, dim_ok, kv_head, tokens, page_tokens,
                            sk_NPKD, sv_NPKD)
            s, seen = _scores(q, k, rows, cols, row_ok, col_ok, scale, causal_offset, CAUSAL, PRECISION)
            run_max, run_sum, acc = online_softmax_step(tl.where(seen, s, float("-inf")), v, run_max, run_sum, acc,
                                                        PRECISION)
        out, lse = online_softmax_finish(run_max, run_sum, acc)
        tl.store(_head_tile(out_ptr, head, rows, dims, so_HTD), out.to(out_ptr.dtype.element_ty), mask=tile)
        tl.store(lse_ptr + head * sl_HT[0] + rows * sl_HT[1], lse, mask=row_ok)

    @triton.jit
    def _paged_dq_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lse_ptr, dout_ptr, delta_ptr, dq_ptr, tokens, page_tokens, tq, group, scale,
        causal_offset, sq_HTD, sk_NPKD, sv_NPKD, sdo_HTD, sl_HT, sdq_HTD,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    ):
        block, head, kv_head, rows, row_ok, dims, dim_ok = _query_program(tq, group, D, BLOCK_D, BLOCK_M)
        q, dout, lse, delta = _load_grad_rows(q_ptr, dout_ptr, lse_ptr, delta_ptr, head, rows, row_ok, dims, dim_ok,
                                              sq_HTD, sdo_HTD, sl_HT)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, _key_end(block, tokens, causal_offset, BLOCK_M, CAUSAL), BLOCK_N):
            cols, col_ok = _span(start, BLOCK_N, tokens)
            k, v = _load_kv(k_ptr, v_ptr, table_ptr, cols, col_ok, dims, dim_ok, kv_head, tokens, page_tokens,
                            sk_NPKD, sv_NPKD)
            p = _probabilities(q, k, rows, cols, row_ok, col_ok, lse, scale, causal_offset, CAUSAL, PRECISION)
            dp = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None]) * scale
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(_head_tile(dq_ptr, head, rows, dims, sdq_HTD), dq, mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit
    def _paged_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lse_ptr, dout_ptr, delta_ptr, dk_ptr, dv_ptr, grad_table_ptr,
        tokens, page_tokens, tq, group, scale, causal_offset, sq_HTD, sk_NPKD, sv_NPKD, sdo_HTD, sl_HT, sdk_NPKD,
        sdv_NPKD, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    ):
        block = tl.program_id(0)
        kv_head = tl.program_id(1)
        cols, col_ok = _span(block * BLOCK_N, BLOCK_N, tokens)
        dims, dim_ok = _span(0, BLOCK_D, D)
        k, v = _load_kv(k_ptr, v_ptr, table_ptr, cols, col_ok, dims, dim_ok, kv_head, tokens, page_tokens,
                        sk_NPKD, sv_NPKD)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        first = 0
        if CAUSAL:  # queries before the block's first key minus the offset see none of it
            first = tl.maximum(block * BLOCK_N - causal_offset, 0) // BLOCK_M * BLOCK_M
        for member in range(0, group):  # the query heads that read this kv head: no atomics across programs
            head = kv_head * group + member
            for start in range(first, tq, BLOCK_M):
                rows, row_ok = _span(start, BLOCK_M, tq)
                q, dout, lse, delta = _load_grad_rows(q_ptr, dout_ptr, lse_ptr, delta_ptr, head, rows, row_ok, dims,
                                                      dim_ok, sq_HTD, sdo_HTD, sl_HT)
                p = _probabilities(q, k, rows, cols, row_ok, col_ok, lse, scale, causal_offset, CAUSAL, PRECISION)
                dv += tl.dot(tl.trans(p.to(dout.dtype)), dout, input_precision=PRECISION)
                dp = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None]) * scale
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        grad_page, grad_slot = _page_rows(grad_table_ptr, cols, tokens, page_tokens)
        dk_at = _page_tile(dk_ptr, grad_page, grad_slot, kv_head, dims, sdk_NPKD)
        dv_at = _page_tile(dv_ptr, grad_page, grad_slot, kv_head, dims, sdv_NPKD)
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        old_dk = tl.load(dk_at, mask=kv_mask, other=0.0).to(tl.float32)
        old_dv = tl.load(dv_at, mask=kv_mask, other=0.0).to(tl.float32)
        tl.store(dk_at, (old_dk + dk).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_at, (old_dv + dv).to(dv_ptr.dtype.element_ty), mask=kv_mask)


# -- host launchers --------------------------------------------------------------------------------------------
def _block_d(d):
    return max(16, triton.next_power_of_2(d))


# (BLOCK_M, BLOCK_N, warps, stages) by row width (head dim x bytes per element / 2: float32 rows count double),
# the best of 6-7 candidates each on an H200 in bfloat16 (H=16 K=2 D=256 and H=32 K=8 D=128, Tq=2048, Tk=16384,
# 256-token pages). Width 512 (float32 D=256) takes the small tiles that fit. Against torch's flash kernels on the
# same keys these tiles are slower, in backward most (BENCHMARKS.md, "The Triton kernels on the H200 (bf16)");
# hence partial.py tries flash first.
_FORWARD_TILES = {64: (128, 64, 4, 3), 128: (128, 64, 4, 3), 256: (128, 64, 8, 2), 512: (32, 32, 8, 1)}
_BACKWARD_TILES = {64: (64, 64, 4, 2), 128: (128, 64, 8, 2), 256: (64, 64, 8, 2), 512: (32, 32, 8, 1)}


def _tiles(width, blocks, kind):
    """(BLOCK_M queries, BLOCK_N keys, warps, stages) of the "forward" or the "backward" kernels: powers of two >= 16
    (tl.dot's smallest tile), those of the smallest measured width >= `width`. blocks: None, or (BLOCK_M,
    BLOCK_N[, warps[, stages]]) to use instead."""
    if blocks is not None:
        return tuple(blocks) + (4, 1)[len(blocks) - 2:]
    table = _FORWARD_TILES if kind == "forward" else _BACKWARD_TILES
    return table[min(key for key in table if key >= min(width, 512))]


def _width(q_HTD):
    return q_HTD.shape[-1] * q_HTD.element_size() // 2


def _launch_args(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset, blocks, kind):
    """What every kernel here is launched with: (sizes, the size arguments tokens, page_tokens, tq, group, scale,
    causal_offset; meta, the compile-time arguments and launch options of the "forward" or "backward" tiles)."""
    _pages_shape_check(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens)
    heads, tq, d = q_HTD.shape
    causal, offset = (False, 0) if causal_offset is None else (True, int(causal_offset))
    block_m, block_n, warps, stages = _tiles(_width(q_HTD), blocks, kind)
    sizes = (tokens, k_NPKD.shape[1], tq, heads // k_NPKD.shape[2], float(scale), offset)
    meta = dict(D=d, BLOCK_D=_block_d(d), BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                PRECISION=dot_precision(q_HTD.dtype), num_warps=warps, num_stages=stages)
    return sizes, meta


def paged_attention_forward_triton(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset=None, *,
                                   blocks=None):
    """The Triton forward; same signature and result as `paged_attention_forward_reference` (lse in float32).
    blocks: None, or the tiles (BLOCK_M, BLOCK_N[, warps[, stages]]) instead of the head dim's (see `_tiles`)."""
    sizes, meta = _launch_args(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset, blocks, "forward")
    heads, tq, _ = q_HTD.shape
    out_HTD = torch.empty_like(q_HTD)
    lse_HT = torch.empty((heads, tq), dtype=torch.float32, device=q_HTD.device)
    if tq == 0:
        return out_HTD, lse_HT
    _paged_forward_kernel[(triton.cdiv(tq, meta["BLOCK_M"]), heads)](
        q_HTD, k_NPKD, v_NPKD, page_table_M, out_HTD, lse_HT, *sizes,
        q_HTD.stride(), k_NPKD.stride(), v_NPKD.stride(), out_HTD.stride(), lse_HT.stride(), **meta)
    return out_HTD, lse_HT


def paged_grads_from_delta_triton(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, lse_HT, dout_HTD, delta_HT, scale,
                                  dk_NPKD=None, dv_NPKD=None, grad_table_M=None, causal_offset=None, *, blocks=None):
    """The Triton backward; same signature and effect as `paged_grads_from_delta_reference` (dq in float32)."""
    sizes, meta = _launch_args(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset, blocks, "backward")
    heads, kv_heads = q_HTD.shape[0], k_NPKD.shape[2]
    dq_HTD = torch.zeros(q_HTD.shape, dtype=torch.float32, device=q_HTD.device)
    if q_HTD.shape[1] == 0 or tokens == 0:
        return dq_HTD
    lse_HT = lse_HT.to(torch.float32)
    delta_HT = delta_HT.to(torch.float32).contiguous()
    if lse_HT.stride() != delta_HT.stride():
        lse_HT = lse_HT.contiguous()
    dout_HTD = dout_HTD.to(q_HTD.dtype)
    inputs = (q_HTD, k_NPKD, v_NPKD, page_table_M, lse_HT, dout_HTD, delta_HT)
    strides = (q_HTD.stride(), k_NPKD.stride(), v_NPKD.stride(), dout_HTD.stride(), lse_HT.stride())
    _paged_dq_kernel[(triton.cdiv(q_HTD.shape[1], meta["BLOCK_M"]), heads)](
        *inputs, dq_HTD, *sizes, *strides, dq_HTD.stride(), **meta)
    if dk_NPKD is not None:
        grad_table_M = page_table_M if grad_table_M is None else grad_table_M
        _paged_dkdv_kernel[(triton.cdiv(tokens, meta["BLOCK_N"]), kv_heads)](
            *inputs, dk_NPKD, dv_NPKD, grad_table_M, *sizes, *strides, dk_NPKD.stride(), dv_NPKD.stride(), **meta)
    return dq_HTD


# -- one contiguous key set as a single page (kernels/attention/partial.py's CUDA path where flash does not apply)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256  # larger heads would spill the [BLOCK, D] float32 accumulators out of registers


def triton_applies(q_HTD, k_KTD) -> bool:
    """Whether partial.py's `_forward` / `_backward` may run a key set [K, Tk, D] through these kernels: the
    dispatch's fast path (CUDA, mode "auto", triton importable), a dtype tl.dot takes, a head dim it tiles."""
    return (uses_triton(q_HTD) and q_HTD.dtype in _TRITON_DTYPES and k_KTD.dtype == q_HTD.dtype
            and q_HTD.shape[-1] <= _MAX_HEAD_DIM)


def _one_page(x_KTD):
    """[1, Tk, K, D]: a key set as one token-major page (a view: no copy)."""
    return x_KTD.transpose(0, 1).unsqueeze(0)


def segment_forward(q_HTD, k_KTD, v_KTD, scale, causal_offset):
    """(out_HTD, lse_HT float32) of q over one key set [K, Tk, D] (any strides), the set read as one page."""
    table = torch.zeros(1, dtype=torch.int32, device=q_HTD.device)
    return paged_attention_forward_triton(q_HTD, _one_page(k_KTD), _one_page(v_KTD), table, k_KTD.shape[1], scale,
                                          causal_offset)


def segment_backward(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, dlse_HT, scale, causal_offset, need_kv):
    """(dq, dk, dv) of one key set given the MERGED out and lse (attention.blockwise_grads_from_delta's contract),
    in the inputs' dtypes; dk/dv are None without need_kv."""
    tokens = k_KTD.shape[1]
    table = torch.zeros(1, dtype=torch.int32, device=q_HTD.device)
    delta_HT = attention_delta(out_HTD, dout_HTD, dlse_HT)
    dk_1TKD = dv_1TKD = None
    if need_kv:
        dk_1TKD, dv_1TKD = (torch.zeros((1, tokens) + k_KTD.shape[::2], dtype=torch.float32, device=k_KTD.device)
                            for _ in range(2))
    dq = paged_grads_from_delta_triton(q_HTD, _one_page(k_KTD), _one_page(v_KTD), table, tokens, lse_HT, dout_HTD,
                                       delta_HT, scale, dk_1TKD, dv_1TKD, None, causal_offset)
    if not need_kv:
        return dq.to(q_HTD.dtype), None, None
    return dq.to(q_HTD.dtype), dk_1TKD[0].transpose(0, 1).to(k_KTD.dtype), dv_1TKD[0].transpose(0, 1).to(v_KTD.dtype)


# -- autograd and the public function -------------------------------------------------------------------------
def uses_triton(q_HTD) -> bool:
    """Whether `paged_partial_attention` takes the Triton path for queries q (the dispatch decides)."""
    return triton is not None and fast_path(q_HTD, "triton") and available("triton")


class _PagedPartialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset, grad_pages, grad_table_M):
        triton_path = uses_triton(q_HTD)
        forward = paged_attention_forward_triton if triton_path else paged_attention_forward_reference
        with torch.no_grad():
            out_HTD, lse_HT = forward(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset)
        ctx.triton_path, ctx.tokens, ctx.scale, ctx.causal_offset = triton_path, tokens, scale, causal_offset
        ctx.grad_pages = grad_pages
        ctx.save_for_backward(q_HTD, k_NPKD, v_NPKD, page_table_M, grad_table_M, out_HTD, lse_HT)
        return out_HTD, lse_HT

    @staticmethod
    def backward(ctx, dout_HTD, dlse_HT):
        q_HTD, k_NPKD, v_NPKD, page_table_M, grad_table_M, out_HTD, lse_HT = ctx.saved_tensors
        if dout_HTD is None:
            dout_HTD = torch.zeros_like(out_HTD)
        delta_HT = attention_delta(out_HTD, dout_HTD, dlse_HT)
        dk_NPKD = dv_NPKD = None
        if ctx.grad_pages is not None:  # the gradient pages take d(pages); autograd returns none for them
            dk_NPKD, dv_NPKD = ctx.grad_pages
        elif ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dk_NPKD, dv_NPKD = torch.zeros_like(k_NPKD), torch.zeros_like(v_NPKD)
            grad_table_M = None
        grads = paged_grads_from_delta_triton if ctx.triton_path else paged_grads_from_delta_reference
        dq_HTD = grads(q_HTD, k_NPKD, v_NPKD, page_table_M, ctx.tokens, lse_HT, dout_HTD, delta_HT, ctx.scale,
                       dk_NPKD, dv_NPKD, grad_table_M, ctx.causal_offset)
        returned = (None, None) if ctx.grad_pages is not None else (dk_NPKD, dv_NPKD)
        return dq_HTD.to(q_HTD.dtype), *returned, None, None, None, None, None, None


def paged_partial_attention(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset=None,
                            grad_pages=None, grad_table_M=None):
    """Softmax attention of q_HTD over `tokens` keys read through a page table, returning (out_HTD, lse_HT).

    k_NPKD, v_NPKD: page tensors [N, P, K, D] (token-major pages, as the pools store K/V); page_table_M: int tensor
    naming the pages in key order (the last may be partial; no page twice). Exact attention; every query sees every
    key unless `causal_offset` is given (query i sees key j iff j <= i + causal_offset); a query that sees no key
    gets out = 0, lse = -inf. lse is float32 (float64 for float64 inputs on the reference path).

    grad_pages: None, or (dk_NPKD, dv_NPKD) gradient pages (rows named by grad_table_M, default the same table)
    that backward adds d(pages) to; the pages then get no autograd gradient. Without it, pages that require grad
    get a page-shaped gradient through autograd.

    On CUDA with mode "auto" (kernels.dispatch) the Triton kernels run; elsewhere the torch reference.
    """
    if q_HTD.dim() != 3 or k_NPKD.dim() != 4 or v_NPKD.shape != k_NPKD.shape:
        raise ValueError(f"expected q [H,Tq,D], k/v pages [N,P,K,D]; got {tuple(q_HTD.shape)}, "
                         f"{tuple(k_NPKD.shape)}, {tuple(v_NPKD.shape)}")
    if q_HTD.shape[0] % k_NPKD.shape[2] or q_HTD.shape[2] != k_NPKD.shape[3]:
        raise ValueError(f"query heads/dim {tuple(q_HTD.shape[::2])} do not fit kv pages {tuple(k_NPKD.shape)}")
    if page_table_M.dim() != 1 or page_table_M.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page table: expected a 1-d int32/int64 tensor, got {page_table_M.dtype} "
                         f"{tuple(page_table_M.shape)}")
    if not 0 <= tokens <= page_table_M.numel() * k_NPKD.shape[1]:
        raise ValueError(f"tokens={tokens}: the table names {page_table_M.numel()} pages of {k_NPKD.shape[1]}")
    if grad_pages is not None and (len(grad_pages) != 2 or grad_pages[0].shape[1:] != k_NPKD.shape[1:]):
        raise ValueError("grad_pages: expected (dk_NPKD, dv_NPKD) pages shaped like k/v pages [*, P, K, D]")
    if grad_table_M is not None and grad_table_M.shape != page_table_M.shape:
        raise ValueError("grad_table_M: expected one gradient page per page of page_table_M")
    page_table_M = page_table_M.to(torch.int32)
    if grad_table_M is not None:
        grad_table_M = grad_table_M.to(torch.int32)
    return _PagedPartialAttention.apply(q_HTD, k_NPKD, v_NPKD, page_table_M, tokens, scale, causal_offset,
                                        grad_pages, grad_table_M)
