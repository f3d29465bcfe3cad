"""Sparse absorbed MLA over selected latent rows, in torch (GLM's attention after the DSA selection).

Legend: T queries of a segment, H query heads, R kv_lora_rank (the latent), E qk_rope_head_dim, K the selected
positions per query (min(index_topk, keys)). Rows come as "pieces": what precedes and includes the segment, a list
of token-major tensors in position order starting at position 0 (the prompt's pages, earlier replay blocks, the
segment itself): latents [N_s, R], rope keys [N_s, E].

Attention (absorbed MLA): the query's no-RoPE part is mapped into the latent space through W_UK (q_lat [T, H, R]),
so for each head score(t, j) = scale * (q_lat(t) . c(j) + q_rope(t) . k_rope(j)) over the selected j only,
softmax, and the result stays in the latent space (o_lat = P @ c [T, H, R]); the caller maps it back through W_UV.
Nothing per head is materialised for the keys: each query block gathers its selected rows [Tq, K, R + E] once.

`sparse_latent_attention` keeps memory bounded in backward too: it saves its inputs and its output (no gathered
rows, no probabilities) and recomputes each query block's rows and probabilities in backward. Forward, where the
queries select at least as many rows as there are, lays the pieces side by side in one row table [N, R + E]
(latent | rope key); backward lays out only the U rows some query selected (selected_rows.py: no O(N (R + E))
pass over rows nobody reads), so that a query block's rows are one gather and their gradients one index_add_,
into a workspace reused by every block; the rows' gradients go to the pieces, or to a piece's row sink (the
prompt pages' gradient pages take only the selected rows).
`sparse_latent_attention_reference` is the plain autograd version with the same signature; tests compare the two.

Context parallelism (the rows split over ranks, each read page by page): `page_partial` is the attention over
the selected rows that lie in one page, (o_lat, lse), and `page_grads` that page's share of the gradients given the
merged (o_lat, lse) (tests/distributed/test_glm_cp.py holds both, merged over ranks and pages, to the plain references).

Fast path: where `kernels.dispatch.fast_path(q, "triton")` says so (a CUDA tensor, mode "auto") and the kernels
take the inputs (float32 / bfloat16 / float16), `sparse_latent_attention`, `page_partial` and `page_grads` run
triton_attention.py; every other call (CPU tensors, float64) takes the torch code below, unchanged.
"""

import torch

from ..dispatch import fast_path, record
from . import triton_attention
from .selected_rows import compact_table, hand_out, select_rows

# Elements of one query block's gathered rows [Tq, K, R + E]: the unit that bounds the transient memory of the
# attention. 2^20 elements are 4 MiB in float32: small enough that a block's rows stay in the CPU's cache between
# the gather and the products that read them (on the small GLM shape, 25 queries a block, the attention took half
# the CPU time of 2^24's 409, whose 64 MiB of rows went through memory each time; BENCHMARKS.md, issue 46).
BLOCK_ELEMENTS = 1 << 20


def _query_block(per_query, tokens):
    return max(1, min(tokens, BLOCK_ELEMENTS // max(1, per_query)))


# -- gathering rows from pieces ---------------------------------------------------------------------------------
def _offsets(pieces):
    offsets, total = [], 0
    for piece in pieces:
        offsets.append(total)
        total += piece.shape[0]
    return offsets, total


def gather_rows(pieces, positions):
    """Rows of `pieces` (token-major, in position order from 0) at `positions` (any shape of int64) ->
    [*positions.shape, *row shape]. Differentiable (plain indexing); the reference path uses it."""
    offsets, total = _offsets(pieces)
    flat = positions.reshape(-1)
    out = None
    for offset, piece in zip(offsets, pieces, strict=True):
        if piece.shape[0] == 0:
            continue
        inside = (flat >= offset) & (flat < offset + piece.shape[0])
        rows = piece[(flat - offset).clamp(0, piece.shape[0] - 1)]
        mask = inside.view(-1, *([1] * (rows.dim() - 1)))
        out = torch.where(mask, rows, torch.zeros_like(rows) if out is None else out)
    return out.reshape(*positions.shape, *pieces[0].shape[1:])


def _gather_into(pieces, offsets, flat):
    """Rows at positions `flat` [n] without autograd. Each piece is gathered densely at clamped indices and
    blended in where it owns the position: a few dense index_selects (pieces are few: the prompt's pages, earlier
    blocks, the segment) instead of boolean-mask indexing, which was most of the attention's time."""
    out = None
    for offset, piece in zip(offsets, pieces, strict=True):
        if piece.shape[0] == 0:
            continue
        rows = piece.index_select(0, (flat - offset).clamp(0, piece.shape[0] - 1))
        if out is None:
            out = rows  # the first piece starts at position 0: it owns every position below the next offset
        else:
            mine = (flat >= offset).view(-1, *([1] * (rows.dim() - 1)))
            out = torch.where(mine, rows, out)
    return out


# -- sparse absorbed attention ----------------------------------------------------------------------------------
def _block_scores(q_lat, q_rope, rows_lat, rows_rope, valid, scale, acc):
    """Scores [Tq, H, K] in the accumulation dtype, -inf where not selected."""
    s = torch.einsum("thr,tkr->thk", q_lat.to(acc), rows_lat.to(acc))
    s = s + torch.einsum("the,tke->thk", q_rope.to(acc), rows_rope.to(acc))
    return (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finite(lse):
    """The log-sum-exp with -inf (a query none of whose selected rows is here) replaced by 0, so that
    exp(-inf - it) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _row_table(latents, ropes, acc):
    """The pieces laid side by side: [N, R + E] in the accumulation dtype, latent then rope-key columns, one row
    per position from 0."""
    return torch.cat([torch.cat(list(latents)).to(acc), torch.cat(list(ropes)).to(acc)], dim=-1)


def _block_positions(positions, valid, full=False):
    """A query block's selected positions [Tq * K], those of unselected slots replaced by 0: their value is never
    read (p = 0 there), they are only kept in range. full: every slot of the block is selected, so its positions
    are read as they are (a view: the replacement cost a tenth of the prefix pass's attention on the small shape)."""
    if full:
        return positions.reshape(-1)
    return torch.where(valid, positions, torch.zeros((), dtype=positions.dtype, device=positions.device)).reshape(-1)


def _selected(valid, block):
    """Per query block of `block` queries: whether every slot of it is selected (its scores need no -inf mask), as
    a list read without a tensor op per block (most blocks of a prompt are: only queries that see fewer than K
    keys have unselected slots)."""
    full = valid.all(dim=1)
    tokens = full.shape[0]
    pad = (-tokens) % block
    if pad:
        full = torch.cat([full, full.new_ones(pad)])
    return full.view(-1, block).all(dim=1).tolist()


def _forward_table(q_lat, q_rope, latents, ropes, positions, valid, scale, block, out_dtype=None):
    """(o_lat, lse) of `_SparseLatentAttention`, each query block one gather from the row table into a workspace
    reused by every block (a fresh [Tq, K, R + E] tensor per block is paid again in page faults) and two batched
    products. The softmax takes one exponential: p = exp(s - max) unnormalised, o = (p @ rows) / sum(p) and
    lse = max + log(sum(p)) (a query with nothing selected: sum 0, so o = 0 and lse = -inf)."""
    tokens, heads, rank = q_lat.shape
    acc, k = _acc(q_lat.dtype), positions.shape[1]
    table = _row_table(latents, ropes, acc)
    width = table.shape[-1]
    q = torch.cat([q_lat.to(acc), q_rope.to(acc)], dim=-1)  # [T, H, R + E]
    full = _selected(valid, block)
    out = q_lat.new_empty(tokens, heads, rank, dtype=out_dtype or q_lat.dtype)
    lse = torch.empty(tokens, heads, dtype=acc, device=q_lat.device)
    rows_buf = table.new_empty(min(block, tokens) * k, width)
    scores_buf = table.new_empty(min(block, tokens), heads, k)
    out_buf = table.new_empty(min(block, tokens), heads, rank)
    tiny = torch.finfo(acc).tiny
    for i, q0 in enumerate(range(0, tokens, block)):
        q1 = min(tokens, q0 + block)
        flat = _block_positions(positions[q0:q1], valid[q0:q1], full[i])
        rows = torch.index_select(table, 0, flat, out=rows_buf[:flat.shape[0]]).view(q1 - q0, k, width)
        s = torch.bmm(q[q0:q1], rows.transpose(1, 2), out=scores_buf[:q1 - q0]).mul_(scale)  # [Tq, H, K]
        if not full[i]:
            s.masked_fill_(~valid[q0:q1].unsqueeze(1), float("-inf"))
        top = _finite(s.amax(dim=-1))  # [Tq, H]
        p = s.sub_(top.unsqueeze(-1)).exp_()
        total = p.sum(dim=-1)  # [Tq, H], 0 for a query with nothing selected
        o = torch.bmm(p, rows[..., :rank], out=out_buf[:q1 - q0])
        out[q0:q1] = o.div_(total.clamp_min(tiny).unsqueeze(-1))
        lse[q0:q1] = total.log_().add_(top)
    return out, lse


def _forward_pieces(q_lat, q_rope, latents, ropes, positions, valid, scale, block):
    """(o_lat, lse) of `_SparseLatentAttention`, each query block gathered piece by piece (_gather_into): no
    O(N) table, for a few queries over many rows."""
    offsets, _ = _offsets(latents)
    tokens, heads, rank = q_lat.shape
    acc = _acc(q_lat.dtype)
    out = q_lat.new_empty(tokens, heads, rank)
    lse = torch.empty(tokens, heads, dtype=acc, device=q_lat.device)
    for q0 in range(0, tokens, block):
        q1 = min(tokens, q0 + block)
        flat = positions[q0:q1].reshape(-1)
        rows_lat = _gather_into(latents, offsets, flat).view(q1 - q0, -1, rank)
        rows_rope = _gather_into(ropes, offsets, flat).view(q1 - q0, -1, q_rope.shape[-1])
        s = _block_scores(q_lat[q0:q1], q_rope[q0:q1], rows_lat, rows_rope, valid[q0:q1], scale, acc)
        lse[q0:q1] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(lse[q0:q1]).unsqueeze(-1))
        out[q0:q1] = torch.einsum("thk,tkr->thr", p, rows_lat.to(acc)).to(out.dtype)
    return out, lse


class _SparseLatentAttention(torch.autograd.Function):
    """Forward and backward walk query blocks; backward re-gathers each block's rows and recomputes its
    probabilities from the saved log-sum-exp (nothing [T, K, ...] is saved). Outputs (o_lat, lse); a query with no
    valid position gets (0, -inf)."""

    @staticmethod
    def forward(ctx, q_lat, q_rope, positions, valid, scale, n_pieces, sinks, *pieces):
        latents, ropes = list(pieces[:n_pieces]), list(pieces[n_pieces:])
        tokens, _, rank = q_lat.shape
        block = _query_block(positions.shape[1] * (rank + q_rope.shape[-1]), tokens)
        # The table costs a copy of the N rows, the piece-by-piece gather T K rows per non-empty piece: the table
        # for a segment or a replay block over its past, the pieces for a few queries over a long one (decode).
        filled = sum(1 for piece in latents if piece.shape[0])
        if sum(piece.shape[0] for piece in latents) <= filled * tokens * positions.shape[1]:
            out, lse = _forward_table(q_lat, q_rope, latents, ropes, positions, valid, scale, block)
        else:
            out, lse = _forward_pieces(q_lat, q_rope, latents, ropes, positions, valid, scale, block)
        triton_attention.save_inputs(ctx, scale, n_pieces, sinks, q_lat, q_rope, positions, valid, out, lse, pieces)
        ctx.block = block
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q_lat, q_rope, positions, valid, out, lse, latents, ropes = triton_attention.saved_inputs(ctx)
        needs = ctx.needs_input_grad[triton_attention.PIECES_AT:]
        row_grads = any(needs)
        # Only the rows some query selected: their table [U, R + E] and their gradients, handed to the pieces (the
        # prompt pages' row sinks take just those rows; selected_rows.py)
        selected = select_rows(positions, valid, sum(piece.shape[0] for piece in latents))
        table = compact_table(selected, latents, ropes, _acc(q_lat.dtype))
        d_q_lat, d_q_rope, d_table = _backward_blocks(q_lat, q_rope, table, selected.slots, valid, out, lse, d_out,
                                                      d_lse, ctx.scale, ctx.block, row_grads)
        d_pieces = [None] * (2 * ctx.n_pieces)
        if row_grads:
            rank = q_lat.shape[-1]
            d_pieces = hand_out(selected, d_table[:, :rank], d_table[:, rank:], latents, ropes, needs, ctx.sinks)
        return triton_attention.input_grads(ctx, q_lat, q_rope, d_q_lat, d_q_rope, d_pieces)


def _backward_blocks(q_lat, q_rope, table, index, valid, out, lse, d_out, d_lse, scale, block, row_grads,
                     delta=None):
    """The torch backward of an attention over selected rows: (d_q_lat [T, H, R], d_q_rope [T, H, E], d_table
    [M, R + E] or None), in the accumulation dtype. table [M, R + E] (in that dtype): the rows the slots read,
    latent then rope-key columns; index [T, K]: each slot's row in it (any value where the slot is not valid);
    d_table: each table row's gradient. The autograd Function passes the selected rows only (selected_rows.py:
    M = U), page_grads one page's rows (M = the page's length).

    A query block's rows are one gather from the table and their gradients one index_add_ at the same rows: nothing
    per piece. The queries carry the table's layout (q = [q_lat | q_rope], d_o padded with zeros over the rope
    columns), so that each block is three batched products: scores and d_p together, d_q, and the rows' gradients
    d_row(t, k) = sum_h d_s(t, h, k) q(t, h) + p(t, h, k) d_o(t, h)."""
    tokens, heads, rank = q_lat.shape
    acc = _acc(q_lat.dtype)
    k = index.shape[1]
    width = table.shape[-1]
    q = torch.cat([q_lat.to(acc), q_rope.to(acc)], dim=-1)  # [T, H, R + E]
    d_o = d_out.to(acc)
    if delta is not None:
        delta_all = delta.to(acc).unsqueeze(-1)
    else:
        delta_all = (d_o * out.to(acc)).sum(-1, keepdim=True)  # [T, H, 1]
        if d_lse is not None:
            delta_all = delta_all - d_lse.to(acc).unsqueeze(-1)
    lse_finite = _finite(lse.to(acc))
    d_o = torch.nn.functional.pad(d_o, (0, width - rank))  # [T, H, R + E], zeros over the rope columns
    full = _selected(valid, block)
    d_q = torch.empty_like(q)
    d_table = torch.zeros_like(table) if row_grads else None
    # One workspace per call, reused by every block: a fresh [Tq, K, R + E] tensor per block is paid again in page
    # faults (it is tens of MiB, so malloc maps it anew), which cost more than the gather or the product filling it.
    rows_buf = table.new_empty(min(block, tokens) * k, width)
    d_rows_buf = table.new_empty(min(block, tokens), k, width) if row_grads else None
    scores_buf = table.new_empty(min(block, tokens), 2 * heads, k)
    for i, q0 in enumerate(range(0, tokens, block)):
        q1 = min(tokens, q0 + block)
        flat = _block_positions(index[q0:q1], valid[q0:q1], full[i])
        rows = torch.index_select(table, 0, flat, out=rows_buf[:flat.shape[0]]).view(q1 - q0, k, width)
        q_and_d_o = torch.cat([q[q0:q1], d_o[q0:q1]], dim=1)  # [Tq, 2H, R + E]
        # [s | d_p] [Tq, 2H, K], then in place [p | d_s]: p = exp(s - lse), d_s = p (d_p - delta) scale
        p_and_d_s = torch.bmm(q_and_d_o, rows.transpose(1, 2), out=scores_buf[:q1 - q0])
        p, d_s = p_and_d_s[:, :heads], p_and_d_s[:, heads:]
        p.mul_(scale)
        if not full[i]:
            p.masked_fill_(~valid[q0:q1].unsqueeze(1), float("-inf"))
        p.sub_(lse_finite[q0:q1].unsqueeze(-1)).exp_()
        d_s.sub_(delta_all[q0:q1]).mul_(p).mul_(scale)
        torch.bmm(d_s, rows, out=d_q[q0:q1])
        if row_grads:
            d_o_and_q = torch.cat([d_o[q0:q1], q[q0:q1]], dim=1)  # pairs p with d_o and d_s with q
            d_rows = torch.bmm(p_and_d_s.transpose(1, 2), d_o_and_q, out=d_rows_buf[:q1 - q0])  # [Tq, K, R + E]
            d_table.index_add_(0, flat, d_rows.view(-1, width))
    return d_q[..., :rank], d_q[..., rank:], d_table


def _check(q_lat, q_rope, latents, ropes, positions, valid, row_sinks=None):
    if len(latents) != len(ropes) or not latents:
        raise ValueError("sparse_latent_attention: give one rope-key piece per latent piece (at least one)")
    if row_sinks is not None and len(row_sinks) != len(latents):
        raise ValueError(f"sparse_latent_attention: row_sinks has {len(row_sinks)} entries for {len(latents)} pieces "
                         "(one per piece, None where autograd takes the piece's gradient)")
    if q_lat.dim() != 3 or q_rope.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"sparse_latent_attention: q_lat {tuple(q_lat.shape)} and q_rope {tuple(q_rope.shape)} "
                         "must be [T, H, R] and [T, H, E]")
    if positions.shape != valid.shape or positions.shape[0] != q_lat.shape[0]:
        raise ValueError(f"sparse_latent_attention: positions {tuple(positions.shape)} and valid "
                         f"{tuple(valid.shape)} must both be [T, K] with T = {q_lat.shape[0]}")
    for lat, rope in zip(latents, ropes, strict=True):
        if lat.shape[0] != rope.shape[0]:
            raise ValueError("sparse_latent_attention: a latent piece and its rope-key piece differ in length")


def sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, scale, offset=0, with_lse=False,
                            row_sinks=None):
    """Absorbed MLA over selected latent rows (see the module docstring).

    q_lat [T, H, R] (the no-RoPE query mapped through W_UK), q_rope [T, H, E]; latents / ropes: lists of [N_s, R] /
    [N_s, E] pieces in position order from `offset`; positions, valid [T, K] from dsa_select. Selected positions
    below `offset` are not here (context parallelism: rows on other ranks, whose partial is merged by the caller)
    and are left out. Returns o_lat [T, H, R] = softmax(scale * scores over the selected rows here) @ latent rows,
    and with_lse also its log-sum-exp [T, H] (max(float32, dtype); -inf, with o_lat 0, for a query none of whose
    selected rows is here). Differentiable in q_lat, q_rope and every piece (and through the lse); memory per query
    block [Tq, K, R + E], in forward and in backward alike. row_sinks: None, or per latent piece None or a sink
    (selected_rows.RowSink) that takes the piece's selected rows' gradients in backward instead of autograd taking
    the piece's dense gradient (the prompt pages' gradient pages: offload/staged_past.py).
    """
    _check(q_lat, q_rope, latents, ropes, positions, valid, row_sinks)
    if offset:
        valid = valid & (positions >= offset)
        positions, valid = _rows_here(torch.where(valid, positions - offset, torch.zeros_like(positions)), valid)
    if fast_path(q_lat, "triton") and triton_attention.supported(q_lat, q_rope, [*latents, *ropes]):
        record("sparse MLA", "triton")
        out, lse = triton_attention.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, scale,
                                                            row_sinks)
        return (out, lse) if with_lse else out
    record("sparse MLA", "torch")
    out, lse = _SparseLatentAttention.apply(q_lat, q_rope, positions, valid, scale, len(latents), row_sinks,
                                            *latents, *ropes)
    return (out, lse) if with_lse else out


def _rows_here(positions, valid):
    """The slots of rows that are here, each query's first (in their order), cut to the most any query has (at
    least one): under context parallelism a replayed block's own rows are a few of its K selected slots (the rest
    lie on the prompt's ranks), and the products over K slots ran at K's width for them (as many multiply-adds as
    the whole one-process attention, on every rank)."""
    counts = valid.sum(-1)
    most = max(int(counts.max()) if counts.numel() else 0, 1)
    if most >= valid.shape[1]:
        return positions, valid
    place = torch.where(valid, valid.cumsum(-1) - 1, most)
    slots = positions.new_zeros(positions.shape[0], most + 1).scatter_(1, place, positions)[:, :most]
    return slots, valid.new_zeros(valid.shape[0], most + 1).scatter_(1, place, valid)[:, :most]


def sparse_latent_attention_reference(q_lat, q_rope, latents, ropes, positions, valid, scale):
    """Plain autograd version of sparse_latent_attention (gathers every query's rows at once)."""
    _check(q_lat, q_rope, latents, ropes, positions, valid)
    acc = _acc(q_lat.dtype)
    rows_lat = gather_rows(list(latents), positions)
    rows_rope = gather_rows(list(ropes), positions)
    s = _block_scores(q_lat, q_rope, rows_lat, rows_rope, valid, scale, acc)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("thk,tkr->thr", p, rows_lat.to(acc)).to(q_lat.dtype)


# -- one page of rows at a time (context parallelism: the rows' owner computes their partial) -----------------------
def _page_slots(positions, valid, page_start, page_tokens):
    """The selected positions that lie in the page [page_start, page_start + page_tokens): (active queries [A]
    (those with at least one), slots [A, m] (rows of the page, 0 where unused), slot_valid [A, m]) with m the most
    any query has there, or None when no query has one. Each query's rows keep their order in its selection: a
    row's slot is the count of the query's selected rows there before it (a cumulative sum and one scatter, no
    sort), the rows elsewhere go to a spare column that is dropped. Only those rows are gathered: a page costs what
    its share of the selection costs, not a pass over every slot of every query."""
    inside = valid & (positions >= page_start) & (positions < page_start + page_tokens)
    counts = inside.sum(-1)
    active = counts.nonzero().squeeze(-1)
    if active.numel() == 0:
        return None
    inside = inside.index_select(0, active)
    most = int(counts.max())
    place = torch.where(inside, inside.cumsum(-1) - 1, most)
    local = torch.where(inside, positions.index_select(0, active) - page_start, 0)
    slots = local.new_zeros(active.numel(), most + 1).scatter_(1, place, local)[:, :most]
    slot_valid = inside.new_zeros(active.numel(), most + 1).scatter_(1, place, inside)[:, :most]
    return active, slots, slot_valid


def _page_block(found, q_lat, q_rope):
    """Query blocks for a page's compacted slots: their rows [Tq, m, R + E] bound the transient memory."""
    active, slots, _ = found
    return _query_block(slots.shape[1] * (q_lat.shape[-1] + q_rope.shape[-1]), active.numel())


def page_partial(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid, scale):
    """(o_lat [T, H, R], lse [T, H]) of the queries over those of their selected rows that lie in one page of rows
    (latent_page [n, R], rope_page [n, E] at positions page_start ..): the same function as sparse_latent_attention
    restricted to the page, both in max(float32, dtype) (so that merging many pages rounds once, not per page); a
    query with no selected row there gets (0, -inf). LSE-merging the pages' partials gives the attention over all
    of them. No autograd (see page_grads)."""
    if fast_path(q_lat, "triton") and triton_attention.supported(q_lat, q_rope, [latent_page, rope_page]):
        record("sparse MLA pages", "triton")
        return triton_attention.page_partial(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid,
                                             scale)
    record("sparse MLA pages", "torch")
    tokens, heads, rank = q_lat.shape
    acc = _acc(q_lat.dtype)
    out = torch.zeros(tokens, heads, rank, dtype=acc, device=q_lat.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=acc, device=q_lat.device)
    found = _page_slots(positions, valid, page_start, latent_page.shape[0])
    if found is None:
        return out, lse
    active, slots, slot_valid = found
    with torch.no_grad():  # the segment's table path over the page: one gather and two products per query block
        out[active], lse[active] = _forward_table(
            q_lat.index_select(0, active), q_rope.index_select(0, active), [latent_page], [rope_page], slots,
            slot_valid, scale, _page_block(found, q_lat, q_rope), out_dtype=acc)
    return out, lse


def page_grads(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid, lse, d_out, delta, scale):
    """One page's share of the gradients of an attention over selected rows, given the MERGED lse [T, H] and
    delta = rowsum(d_out * o_lat) - d_lse [T, H] of the whole attention (the ring-attention form): with
    p = exp(s - lse) over the page's selected rows, d_s = p (d_out . row - delta) scale.
    Returns (d_q_lat [T, H, R], d_q_rope [T, H, E], d_latent_page [n, R], d_rope_page [n, E]), in max(float32,
    dtype); summing the first two over every page of every rank gives the queries' gradients."""
    if fast_path(q_lat, "triton") and triton_attention.supported(q_lat, q_rope, [latent_page, rope_page]):
        record("sparse MLA page gradients", "triton")
        return triton_attention.page_grads(q_lat, q_rope, latent_page, rope_page, page_start, positions, valid,
                                           lse, d_out, delta, scale)
    record("sparse MLA page gradients", "torch")
    acc = _acc(q_lat.dtype)
    d_q_lat = torch.zeros(q_lat.shape, dtype=acc, device=q_lat.device)
    d_q_rope = torch.zeros(q_rope.shape, dtype=acc, device=q_rope.device)
    found = _page_slots(positions, valid, page_start, latent_page.shape[0])
    if found is None:
        return (d_q_lat, d_q_rope, torch.zeros(latent_page.shape, dtype=acc, device=latent_page.device),
                torch.zeros(rope_page.shape, dtype=acc, device=rope_page.device))
    active, slots, slot_valid = found
    with torch.no_grad():  # the segment's backward over the page, from the merged lse and delta
        d_lat_q, d_rope_q, d_table = _backward_blocks(
            q_lat.index_select(0, active), q_rope.index_select(0, active), _row_table([latent_page], [rope_page], acc),
            slots, slot_valid, None, lse.index_select(0, active), d_out.index_select(0, active), None, scale,
            _page_block(found, q_lat, q_rope), True, delta=delta.index_select(0, active))
    d_q_lat[active], d_q_rope[active] = d_lat_q, d_rope_q
    rank = q_lat.shape[-1]
    return d_q_lat, d_q_rope, d_table[:, :rank].contiguous(), d_table[:, rank:].contiguous()
