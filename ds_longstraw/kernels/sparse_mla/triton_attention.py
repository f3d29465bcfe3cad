"""Sparse absorbed MLA in Triton: each query attends over its K selected latent rows, read by index from the pieces.

Legend: T queries, H query heads, R kv_lora_rank (the latent), E qk_rope_head_dim, K selected positions per query,
N rows in all the pieces together, P pieces. Layouts:
    q_lat_THR [T, H, R], q_rope_THE [T, H, E]; positions_TK int64 [T, K], valid_TK bool [T, K] (as dsa_select gives
    them); latents / ropes: lists of P token-major pieces [N_p, R] / [N_p, E] in position order from 0 (any row
    stride, unit column stride); out_THR [T, H, R]; lse_TH, delta_TH [T, H] float32;
    d_lat_MR, d_rope_ME [M, R] / [M, E] float32: the rows' gradients (M: the selected rows, or every row by position).

What it is: the same function as attention.py's `sparse_latent_attention`
(score = scale * (q_lat . c + q_rope . k_rope) over the valid selected rows, softmax, o_lat = P @ c), with its
(o_lat, lse) and its gradients. One program per (query, block of heads) walks the query's K slots in blocks:
it finds each slot's piece by a binary search over the pieces' first positions, and loads the row from that piece
through an element offset from the first piece's address (no gathered [T, K, R] copy, no concatenated pieces).
Scores, softmax and the output accumulate in float32 (an online softmax); the dot products take the inputs'
dtype (bfloat16 operands, float32 accumulation; float32 operands at full "ieee" precision); P and dS enter their
dot products in the inputs' dtype, as in flash attention. A query with no valid slot gets (0, -inf).

The backward takes the MERGED lse and delta = rowsum(d_out * o_lat) - d_lse (the ring-attention form, as
`page_grads`), so the same kernel serves the whole attention and one page's share of it. It recomputes each
block's scores and probabilities (nothing [T, K, ...] is saved) and writes d_q_lat, d_q_rope per program; the rows'
gradients go into float32 buffers, one row per selected row (selected_rows.py; by position for a page's share),
with ATOMIC adds: many queries select the same row (DSA's popular
rows, the first tokens), and a deterministic alternative needs the inverse of the selection (a sort of the T*K
positions) and a second, key-major pass that recomputes every probability again. The price is the summation
order: d(latent rows) and d(rope rows) may differ between runs in the last bits of float32 (they are cast once to
the pieces' dtype after the sum); d_q_lat, d_q_rope, o_lat and lse are deterministic.

Its times on an H200 against the torch path's: BENCHMARKS.md, "The Triton kernels on the H200 (bf16)" (no tuning
yet beyond the block sizes below).

What it is not: a kernel for float64 (the torch path serves it), nor for inputs of mixed dtypes (q_lat, q_rope and
every piece share one dtype; `supported` says which calls it takes).

Four layers (STYLE.md 2): `_forward_kernel` / `_backward_kernel` -> host launchers `sparse_mla_forward` /
`sparse_mla_grads` -> `_TritonSparseLatentAttention` -> `sparse_latent_attention` (and `page_partial`,
`page_grads`), with the signatures of the torch functions in attention.py, which keep the checks and call
here only where `kernels.dispatch.fast_path(q, "triton")` says so.
"""

import torch

from ..triton_common import pow2
from .selected_rows import hand_out, select_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch functions serve every call (fast_path says so)
    triton = None
else:
    from ..triton_common import online_softmax_finish, online_softmax_start, online_softmax_step

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(q_lat, q_rope, pieces):
    """Whether the kernels take these inputs: one dtype among DTYPES, unit column stride, one device."""
    if triton is None or q_lat.dtype not in DTYPES:
        return False
    return all(x.dtype == q_lat.dtype and x.device == q_lat.device and (x.shape[0] == 0 or x.stride(-1) == 1)
               for x in (q_rope, *pieces))


if triton is not None:

    @triton.jit
    def _row_addresses(pos, STARTS, OFFSETS, STRIDES, P, LOG_P: tl.constexpr):
        """Element address (from the first piece's) of row `pos` [BK]: the last piece whose first position is
        <= pos (a binary search over the P pieces' first positions) owns it."""
        piece = tl.zeros_like(pos)
        for step in tl.static_range(LOG_P):
            cand = piece + (1 << (LOG_P - 1 - step))
            first = tl.load(STARTS + cand, mask=cand < P, other=0)
            piece = tl.where((cand < P) & (first <= pos), cand, piece)
        first = tl.load(STARTS + piece)
        return tl.load(OFFSETS + piece) + (pos - first) * tl.load(STRIDES + piece)

    @triton.jit
    def _selected_rows(t, k0, POS, VALID, LAT, ROPE, STARTS, LAT_OFF, LAT_STRIDE, ROPE_OFF, ROPE_STRIDE, K, P,
                       s_pt, s_vt, r, e, r_in, e_in, LOG_P: tl.constexpr, BLOCK_K: tl.constexpr):
        """(ok, pos, rows, ropes) of query t's slots k0 .. k0 + BLOCK_K - 1: which are valid, their positions (0
        where not), their latent rows [BK, BR] and rope rows [BK, BE] (0 where not valid)."""
        k = k0 + tl.arange(0, BLOCK_K)
        ok = (tl.load(VALID + t * s_vt + k, mask=k < K, other=0) != 0) & (k < K)
        pos = tl.load(POS + t * s_pt + k, mask=ok, other=0)
        lat_at = _row_addresses(pos, STARTS, LAT_OFF, LAT_STRIDE, P, LOG_P)
        rope_at = _row_addresses(pos, STARTS, ROPE_OFF, ROPE_STRIDE, P, LOG_P)
        rows = tl.load(LAT + lat_at[:, None] + r[None, :], mask=ok[:, None] & r_in[None, :], other=0.0)
        ropes = tl.load(ROPE + rope_at[:, None] + e[None, :], mask=ok[:, None] & e_in[None, :], other=0.0)
        return ok, pos, rows, ropes

    @triton.jit
    def _scores(q_lat, q_rope, rows, ropes, PRECISION: tl.constexpr):
        """q_lat . c + q_rope . k_rope [BH, BK], float32, before the scale."""
        s = tl.dot(q_lat, tl.trans(rows), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(ropes), input_precision=PRECISION)
        return s

    @triton.jit
    def _forward_kernel(Q_LAT, Q_ROPE, POS, VALID, LAT, ROPE, STARTS, LAT_OFF, LAT_STRIDE, ROPE_OFF, ROPE_STRIDE,
                        OUT, LSE, scale, H, R, E, K, P,
                        s_qlt, s_qlh, s_qrt, s_qrh, s_pt, s_vt, s_ot, s_oh, s_lt,
                        LOG_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_E: tl.constexpr, PRECISION: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        h_in, r_in, e_in = h < H, r < R, e < E
        q_lat = tl.load(Q_LAT + t * s_qlt + h[:, None] * s_qlh + r[None, :], mask=h_in[:, None] & r_in[None, :],
                        other=0.0)
        q_rope = tl.load(Q_ROPE + t * s_qrt + h[:, None] * s_qrh + e[None, :], mask=h_in[:, None] & e_in[None, :],
                         other=0.0)
        m, l_sum, acc = online_softmax_start(BLOCK_H, BLOCK_R)
        for k0 in range(0, K, BLOCK_K):
            ok, pos, rows, ropes = _selected_rows(t, k0, POS, VALID, LAT, ROPE, STARTS, LAT_OFF, LAT_STRIDE, ROPE_OFF,
                                                  ROPE_STRIDE, K, P, s_pt, s_vt, r, e, r_in, e_in, LOG_P, BLOCK_K)
            s = _scores(q_lat, q_rope, rows, ropes, PRECISION)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m, l_sum, acc = online_softmax_step(s, rows, m, l_sum, acc, PRECISION)
        out, lse = online_softmax_finish(m, l_sum, acc)
        tl.store(OUT + t * s_ot + h[:, None] * s_oh + r[None, :], out.to(OUT.dtype.element_ty),
                 mask=h_in[:, None] & r_in[None, :])
        tl.store(LSE + t * s_lt + h, lse, mask=h_in)

    @triton.jit
    def _backward_kernel(Q_LAT, Q_ROPE, POS, VALID, LAT, ROPE, STARTS, LAT_OFF, LAT_STRIDE, ROPE_OFF, ROPE_STRIDE,
                         LSE, DOUT, DELTA, DQ_LAT, DQ_ROPE, SLOTS, D_LAT, D_ROPE, scale, H, R, E, K, P,
                         s_qlt, s_qlh, s_qrt, s_qrh, s_pt, s_vt, s_lt, s_dot, s_doh, s_dlt, s_st,
                         LOG_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_E: tl.constexpr, PRECISION: tl.constexpr, ROW_GRADS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        h_in, r_in, e_in = h < H, r < R, e < E
        hr, he = h_in[:, None] & r_in[None, :], h_in[:, None] & e_in[None, :]
        q_lat = tl.load(Q_LAT + t * s_qlt + h[:, None] * s_qlh + r[None, :], mask=hr, other=0.0)
        q_rope = tl.load(Q_ROPE + t * s_qrt + h[:, None] * s_qrh + e[None, :], mask=he, other=0.0)
        d_o = tl.load(DOUT + t * s_dot + h[:, None] * s_doh + r[None, :], mask=hr, other=0.0).to(q_lat.dtype)
        lse = tl.load(LSE + t * s_lt + h, mask=h_in, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # a query with no row anywhere: p = 0, not nan
        delta = tl.load(DELTA + t * s_dlt + h, mask=h_in, other=0.0)
        d_q_lat = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        d_q_rope = tl.zeros([BLOCK_H, BLOCK_E], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok, pos, rows, ropes = _selected_rows(t, k0, POS, VALID, LAT, ROPE, STARTS, LAT_OFF, LAT_STRIDE, ROPE_OFF,
                                                  ROPE_STRIDE, K, P, s_pt, s_vt, r, e, r_in, e_in, LOG_P, BLOCK_K)
            s = _scores(q_lat, q_rope, rows, ropes, PRECISION)
            live = h_in[:, None] & ok[None, :]
            p = tl.where(live, tl.exp(s * scale - lse[:, None]), 0.0)  # [BH, BK]
            d_p = tl.dot(d_o, tl.trans(rows), input_precision=PRECISION)
            d_s = (p * (d_p - delta[:, None]) * scale).to(rows.dtype)
            d_q_lat += tl.dot(d_s, rows, input_precision=PRECISION)
            d_q_rope += tl.dot(d_s, ropes, input_precision=PRECISION)
            if ROW_GRADS:
                d_rows = tl.dot(tl.trans(d_s), q_lat, input_precision=PRECISION)
                d_rows += tl.dot(tl.trans(p.to(rows.dtype)), d_o, input_precision=PRECISION)
                d_ropes = tl.dot(tl.trans(d_s), q_rope, input_precision=PRECISION)
                # each slot's gradient row: its index among the selected rows (or its position, for a page's dense
                # gradient)
                slot = tl.load(SLOTS + t * s_st + k0 + tl.arange(0, BLOCK_K), mask=ok, other=0)
                tl.atomic_add(D_LAT + slot[:, None] * R + r[None, :], d_rows, mask=ok[:, None] & r_in[None, :])
                tl.atomic_add(D_ROPE + slot[:, None] * E + e[None, :], d_ropes, mask=ok[:, None] & e_in[None, :])
        tl.store(DQ_LAT + t * (H * R) + h[:, None] * R + r[None, :], d_q_lat, mask=hr)
        tl.store(DQ_ROPE + t * (H * E) + h[:, None] * E + e[None, :], d_q_rope, mask=he)


# -- host launchers --------------------------------------------------------------------------------------------------
def _piece_tables(latents, ropes):
    """(base latent, base rope, starts, lat offsets, lat strides, rope offsets, rope strides, P, total) of the
    non-empty pieces: each piece's first position and the element offset of its row 0 from the first piece's."""
    keep = [i for i, lat in enumerate(latents) if lat.shape[0] > 0]
    starts, position = [], 0
    for _i, lat in enumerate(latents):
        if lat.shape[0] > 0:
            starts.append(position)
        position += lat.shape[0]
    device = latents[0].device

    def table(pieces):
        base = pieces[keep[0]]
        size = base.element_size()
        offsets = []
        for i in keep:
            delta = pieces[i].data_ptr() - base.data_ptr()
            assert delta % size == 0, "pieces of one dtype lie at element-aligned addresses"
            offsets.append(delta // size)
        strides = [pieces[i].stride(0) for i in keep]
        return (base, torch.tensor(offsets, dtype=torch.int64, device=device),
                torch.tensor(strides, dtype=torch.int64, device=device))

    lat_base, lat_off, lat_stride = table(latents)
    rope_base, rope_off, rope_stride = table(ropes)
    return (lat_base, rope_base, torch.tensor(starts, dtype=torch.int64, device=device), lat_off, lat_stride,
            rope_off, rope_stride, len(keep), position)


def _blocks(q_lat, q_rope, positions):
    heads, rank, rope = q_lat.shape[1], q_lat.shape[2], q_rope.shape[2]
    block_h = pow2(min(heads, 32))
    block_k = 16 if rank > 256 or q_lat.device.type != "cuda" else 32
    return dict(BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_R=pow2(rank), BLOCK_E=pow2(rope),
                PRECISION="ieee" if q_lat.dtype == torch.float32 else None,
                num_warps=8 if rank >= 256 else 4), triton.cdiv(heads, block_h)


def _log2_pieces(pieces):
    return max(1, (pieces - 1).bit_length())


def sparse_mla_forward(q_lat, q_rope, latents, ropes, positions, valid, scale, out_dtype=None):
    """(o_lat [T, H, R] in out_dtype (default q_lat's), lse [T, H] float32) over the valid selected rows; positions
    count from the first piece's first row."""
    tokens, heads, rank = q_lat.shape
    out = torch.empty(tokens, heads, rank, dtype=out_dtype or q_lat.dtype, device=q_lat.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q_lat.device)
    k = positions.shape[1]
    if not any(lat.shape[0] for lat in latents) or k == 0 or tokens == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    lat, rope, starts, lat_off, lat_stride, rope_off, rope_stride, pieces, _ = _piece_tables(latents, ropes)
    q_lat, q_rope = q_lat.contiguous(), q_rope.contiguous()
    positions, valid = positions.contiguous(), valid.contiguous().view(torch.uint8)
    meta, head_blocks = _blocks(q_lat, q_rope, positions)
    _forward_kernel[(tokens, head_blocks)](
        q_lat, q_rope, positions, valid, lat, rope, starts, lat_off, lat_stride, rope_off, rope_stride, out, lse,
        float(scale), heads, rank, q_rope.shape[2], k, pieces,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), positions.stride(0), valid.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), LOG_P=_log2_pieces(pieces), **meta)
    return out, lse


def sparse_mla_grads(q_lat, q_rope, latents, ropes, positions, valid, lse, d_out, delta, scale, row_grads=True,
                     selected=None):
    """(d_q_lat [T, H, R], d_q_rope [T, H, E], d_lat [M, R], d_rope [M, E]), all float32, of the attention over the
    valid selected rows given the MERGED lse [T, H] and delta [T, H] (see the module docstring). The rows'
    gradients: with `selected` (selected_rows.SelectedRows of these positions), those of the selected rows only
    (M = max(U, 1), in selected.rows' order); without, by position (M = N, every row of the pieces, empty pieces
    included). row_grads=False leaves d_lat and d_rope None (and skips their atomics)."""
    tokens, heads, rank = q_lat.shape
    rope_dim = q_rope.shape[2]
    device = q_lat.device
    total = sum(lat.shape[0] for lat in latents)
    rows = total if selected is None else max(1, selected.rows.numel())
    slots = (positions if selected is None else selected.slots).contiguous()
    d_q_lat = torch.zeros(tokens, heads, rank, dtype=torch.float32, device=device)
    d_q_rope = torch.zeros(tokens, heads, rope_dim, dtype=torch.float32, device=device)
    d_lat = torch.zeros(rows, rank, dtype=torch.float32, device=device) if row_grads else None
    d_rope = torch.zeros(rows, rope_dim, dtype=torch.float32, device=device) if row_grads else None
    k = positions.shape[1]
    if total == 0 or k == 0 or tokens == 0:
        return d_q_lat, d_q_rope, d_lat, d_rope
    lat, rope, starts, lat_off, lat_stride, rope_off, rope_stride, pieces, _ = _piece_tables(latents, ropes)
    q_lat, q_rope, d_out = q_lat.contiguous(), q_rope.contiguous(), d_out.contiguous()
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    positions, valid = positions.contiguous(), valid.contiguous().view(torch.uint8)
    meta, head_blocks = _blocks(q_lat, q_rope, positions)
    _backward_kernel[(tokens, head_blocks)](
        q_lat, q_rope, positions, valid, lat, rope, starts, lat_off, lat_stride, rope_off, rope_stride,
        lse, d_out, delta, d_q_lat, d_q_rope, slots, d_lat if row_grads else d_q_lat,
        d_rope if row_grads else d_q_rope, float(scale), heads, rank, rope_dim, k, pieces,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), positions.stride(0), valid.stride(0),
        lse.stride(0), d_out.stride(0), d_out.stride(1), delta.stride(0), slots.stride(0),
        LOG_P=_log2_pieces(pieces), ROW_GRADS=row_grads, **meta)
    return d_q_lat, d_q_rope, d_lat, d_rope


# -- autograd and the public functions ----------------------------------------------------------------------------
# Both autograd Functions of sparse MLA (attention.py's torch `_SparseLatentAttention` and the Triton one below)
# take (q_lat, q_rope, positions, valid, scale, n_pieces, *latents, *ropes), save the same tensors and return the
# same gradients: these three functions are that shared part.
# The pieces' place among the Functions' inputs (q_lat, q_rope, positions, valid, scale, n_pieces, sinks, *pieces)
PIECES_AT = 7


def save_inputs(ctx, scale, n_pieces, sinks, q_lat, q_rope, positions, valid, out, lse, pieces):
    """Forward's end: keep the inputs, o_lat and lse (nothing [T, K, ...]) for a backward that recomputes, and the
    pieces' row sinks (None, or per piece None or a selected_rows.RowSink)."""
    ctx.scale, ctx.n_pieces, ctx.sinks = scale, n_pieces, sinks
    ctx.save_for_backward(q_lat, q_rope, positions, valid, out, lse, *pieces)


def saved_inputs(ctx):
    """Backward's start: (q_lat, q_rope, positions, valid, out, lse, latents, ropes) as `save_inputs` kept them
    (latents and ropes as lists)."""
    q_lat, q_rope, positions, valid, out, lse, *pieces = ctx.saved_tensors
    return q_lat, q_rope, positions, valid, out, lse, pieces[:ctx.n_pieces], pieces[ctx.n_pieces:]


def input_grads(ctx, q_lat, q_rope, d_q_lat, d_q_rope, d_pieces):
    """Backward's result: the gradients of forward's inputs, d_q_lat / d_q_rope in q_lat's / q_rope's dtypes where
    needed, None for positions, valid, scale, n_pieces and sinks, then the pieces' (d_pieces, None where not needed
    or where a sink took them)."""
    needs = ctx.needs_input_grad
    return (d_q_lat.to(q_lat.dtype) if needs[0] else None, d_q_rope.to(q_rope.dtype) if needs[1] else None,
            None, None, None, None, None, *d_pieces)


class _TritonSparseLatentAttention(torch.autograd.Function):
    """Saves the inputs, o_lat and lse (nothing [T, K, ...]); backward recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q_lat, q_rope, positions, valid, scale, n_pieces, sinks, *pieces):
        out, lse = sparse_mla_forward(q_lat, q_rope, list(pieces[:n_pieces]), list(pieces[n_pieces:]), positions,
                                      valid, scale)
        save_inputs(ctx, scale, n_pieces, sinks, q_lat, q_rope, positions, valid, out, lse, pieces)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q_lat, q_rope, positions, valid, out, lse, latents, ropes = saved_inputs(ctx)
        needs = ctx.needs_input_grad[PIECES_AT:]
        delta = (d_out.float() * out.float()).sum(-1)
        if d_lse is not None:
            delta = delta - d_lse.float()
        row_grads = any(needs)
        # the rows' gradients of the selected rows only, handed to the pieces or their row sinks (selected_rows.py)
        selected = select_rows(positions, valid, sum(piece.shape[0] for piece in latents)) if row_grads else None
        d_q_lat, d_q_rope, d_lat, d_rope = sparse_mla_grads(
            q_lat, q_rope, latents, ropes, positions, valid, lse, d_out, delta, ctx.scale, row_grads, selected)
        d_pieces = [None] * (len(latents) + len(ropes))
        if row_grads:
            d_pieces = hand_out(selected, d_lat, d_rope, latents, ropes, needs, ctx.sinks)
        return input_grads(ctx, q_lat, q_rope, d_q_lat, d_q_rope, d_pieces)


def sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, scale, row_sinks=None):
    """(o_lat [T, H, R] in q_lat's dtype, lse [T, H] float32): attention.py's `_SparseLatentAttention`
    in Triton, differentiable in q_lat, q_rope and every piece (positions count from the first piece's first row;
    the caller has checked the shapes and applied any offset); row_sinks as attention.py's."""
    return _TritonSparseLatentAttention.apply(q_lat, q_rope, positions, valid, scale, len(latents), row_sinks,
                                              *latents, *ropes)


def page_partial(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid, scale):
    """attention.page_partial in Triton: (o_lat [T, H, R], lse [T, H]), both float32, over the selected
    rows that lie in the page at positions page_start ..; (0, -inf) for a query with none there. No autograd."""
    inside = valid & (positions >= page_start) & (positions < page_start + latent_page.shape[0])
    with torch.no_grad():
        return sparse_mla_forward(q_lat, q_rope, [latent_page], [rope_page], positions - page_start, inside, scale,
                                  out_dtype=torch.float32)


def page_grads(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid, lse, d_out, delta, scale):
    """attention.page_grads in Triton: (d_q_lat, d_q_rope, d_latent_page, d_rope_page), float32, the
    page's share of the gradients given the merged lse and delta."""
    inside = valid & (positions >= page_start) & (positions < page_start + latent_page.shape[0])
    with torch.no_grad():
        return sparse_mla_grads(q_lat, q_rope, [latent_page], [rope_page], positions - page_start, inside, lse,
                                d_out, delta, scale)
