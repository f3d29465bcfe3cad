"""The torch backward of sparse_latent_attention (one gather and one index_add_ per query block over the pieces laid
side by side) against plain autograd through gathered rows, in float64.

Equivalence chain: sparse_latent_attention(...) backward == autograd of a plain gather -> scores -> softmax ->
weighted sum (and its log-sum-exp), for d_q_lat, d_q_rope and every piece's rows.

Cases: many queries selecting the same positions (duplicates that the index_add_ must sum), positions spread over
several pieces of lengths that are not powers of two, an empty piece, a piece without a gradient, unselected slots,
query blocks of a few queries whose last block is partial (the reused workspace), an lse gradient, and an offset
(context parallelism: positions below it are not here).
"""

import pytest
import torch

from ds_longstraw.kernels.sparse_mla import attention as sparse_mla
from ds_longstraw.kernels.sparse_mla import selected_rows

# Both sides compute the same float64 sums in different orders (one product over [latent | rope] vs two; index_add_
# vs autograd's accumulation of indexing gradients): ~1e-15 on values of order 1-10. A missing term or a row added
# at a wrong position is of order 1e-1.
TOL = 1e-12


def _plain(q_lat, q_rope, latents, ropes, positions, valid, scale):
    """(o_lat, lse) by plain autograd: one gather of every query's rows from the concatenated pieces."""
    rows_lat = torch.cat(latents)[positions]  # [T, K, R]
    rows_rope = torch.cat(ropes)[positions]
    s = torch.einsum("thr,tkr->thk", q_lat, rows_lat) + torch.einsum("the,tke->thk", q_rope, rows_rope)
    s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    return torch.einsum("thk,tkr->thr", torch.softmax(s, dim=-1), rows_lat), torch.logsumexp(s, dim=-1)


def _case(lengths, tokens, heads, k, gen, shared):
    """Inputs whose selections start with a few `shared` positions (so queries select the same rows) and go on
    anywhere, with about a fifth of the slots unselected (each query keeps its first)."""
    total = sum(lengths)
    popular = torch.randperm(total, generator=gen)[:shared]
    positions = torch.empty(tokens, k, dtype=torch.long)
    for t in range(tokens):
        mine = torch.cat([popular, torch.randperm(total, generator=gen)])
        positions[t] = _distinct(mine, k)
    valid = torch.rand(tokens, k, generator=gen) > 0.2
    valid[:, 0] = True
    positions = torch.where(valid, positions, torch.zeros_like(positions))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    latents = [randn(n, 6) for n in lengths]
    ropes = [randn(n, 4) for n in lengths]
    return randn(tokens, heads, 6), randn(tokens, heads, 4), latents, ropes, positions, valid


def _distinct(values, k):
    """The first k distinct values in order (a query selects a position at most once)."""
    seen, out = set(), []
    for v in values.tolist():
        if v not in seen:
            seen.add(v)
            out.append(v)
        if len(out) == k:
            break
    return torch.tensor(out)


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("offset", [0, 7], ids=["offset0", "offset7"])
@pytest.mark.parametrize("block", [1, 3, 11], ids=lambda b: f"block{b}")
def test_backward_matches_plain_autograd_float64(monkeypatch, block, offset, with_lse):
    heads, k, tokens = 3, 7, 11
    lengths = [9, 0, 13, 5, 17]
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", block * k * (6 + 4))  # `block` queries per block
    gen = torch.Generator().manual_seed(block + offset)
    q_lat, q_rope, latents, ropes, positions, valid = _case(lengths, tokens, heads, k, gen, shared=4)
    counts = torch.bincount(positions[valid], minlength=sum(lengths))
    assert int(counts.max()) >= tokens // 2 and int((counts > 0).sum()) > 4 * len(lengths)  # duplicates, spread
    needs = [True, True, True, True, False, True]  # piece 3 (latent and rope) without a gradient
    latents = [p.requires_grad_(n) for p, n in zip(latents, needs[1:], strict=True)]
    ropes = [p.requires_grad_(n) for p, n in zip(ropes, needs[1:], strict=True)]
    q_lat.requires_grad_()
    q_rope.requires_grad_()
    inputs = [q_lat, q_rope, *[p for p in latents + ropes if p.requires_grad]]
    d_out = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(tokens, heads, generator=gen, dtype=torch.float64) if with_lse else None

    # with an offset the pieces start there: a third of the selected slots (never a query's first) lie below it,
    # on other ranks, and are left out
    remote = (torch.rand(tokens, k, generator=gen) < 0.3) & valid
    remote[:, 0] = False
    absolute = torch.where(remote, torch.randint(0, max(offset, 1), (tokens, k), generator=gen), positions + offset)
    absolute = absolute if offset else positions

    out, lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, absolute, valid, 0.6, offset=offset,
                                                  with_lse=True)
    here = valid & ~remote if offset else valid
    plain_out, plain_lse = _plain(q_lat, q_rope, latents, ropes, positions, here, 0.6)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=TOL)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=TOL)

    def loss(o, lse_):
        return (o * d_out).sum() + ((lse_ * d_lse).sum() if with_lse else 0)

    grads = torch.autograd.grad(loss(out, lse), inputs, allow_unused=True)
    plain = torch.autograd.grad(loss(plain_out, plain_lse), inputs, allow_unused=True)
    for grad, ref in zip(grads, plain, strict=True):
        torch.testing.assert_close(grad, torch.zeros_like(grad) if ref is None else ref, rtol=0, atol=TOL)


def test_backward_matches_reference_function(monkeypatch):
    """The same against sparse_latent_attention_reference (the module's own plain version), pieces needing
    gradients only, blocks of 4 queries over 10."""
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", 4 * 5 * (6 + 4))
    gen = torch.Generator().manual_seed(3)
    q_lat, q_rope, latents, ropes, positions, valid = _case([6, 11, 0, 7], 10, 2, 5, gen, shared=3)
    inputs = [t.requires_grad_() for t in (q_lat, q_rope, *latents, *ropes)]
    d_out = torch.randn(10, 2, 6, generator=gen, dtype=torch.float64)
    results = []
    for fn in (sparse_mla.sparse_latent_attention, sparse_mla.sparse_latent_attention_reference):
        out = fn(q_lat, q_rope, latents, ropes, positions, valid, 0.9)
        results.append((out, torch.autograd.grad(out, inputs, d_out, allow_unused=True)))
    (out, grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=0, atol=TOL)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, torch.zeros_like(grad) if ref is None else ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("lengths", [[0, 41], [19, 0, 23]], ids=["one-piece", "two-pieces"])
def test_few_queries_over_a_long_past(lengths):
    """3 queries selecting 5 rows each of 41-42 (decode-like: the forward gathers piece by piece instead of
    building the row table; backward builds it): values and gradients equal plain autograd."""
    gen = torch.Generator().manual_seed(len(lengths))
    q_lat, q_rope, latents, ropes, positions, valid = _case(lengths, 3, 2, 5, gen, shared=2)
    assert sum(lengths) > sum(1 for n in lengths if n) * positions.numel()  # the piece-by-piece forward
    inputs = [t.requires_grad_() for t in (q_lat, q_rope, *latents, *ropes)]
    d_out = torch.randn(3, 2, 6, generator=gen, dtype=torch.float64)
    out = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, 0.5)
    plain_out, _ = _plain(q_lat, q_rope, latents, ropes, positions, valid, 0.5)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=TOL)
    grads = torch.autograd.grad(out, inputs, d_out)
    for grad, ref in zip(grads, torch.autograd.grad(plain_out, inputs, d_out), strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("block", [1, 4, 64], ids=lambda b: f"block{b}")
def test_pages_merged_equal_plain_autograd(monkeypatch, block):
    """Context parallelism's form: the rows in pages (lengths 9, 0, 13, 5, 17, as a rank's runs), page_partial per
    page merged by log-sum-exp == the plain attention's (o_lat, lse); page_grads per page from the MERGED lse and
    delta = rowsum(d_out * o_lat) - d_lse: d(query) summed over pages and each page's d(rows) == plain autograd's.
    Duplicate selections, unselected slots and queries with no row in a page included; `block` queries per block
    of a page's compacted slots."""
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", block * 7 * (6 + 4))
    heads, k, tokens = 3, 7, 11
    lengths = [9, 0, 13, 5, 17]
    gen = torch.Generator().manual_seed(block)
    q_lat, q_rope, latents, ropes, positions, valid = _case(lengths, tokens, heads, k, gen, shared=4)
    inputs = [t.requires_grad_() for t in (q_lat, q_rope, *latents, *ropes)]
    d_out = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(tokens, heads, generator=gen, dtype=torch.float64)
    plain_out, plain_lse = _plain(q_lat, q_rope, latents, ropes, positions, valid, 0.6)
    plain = torch.autograd.grad((plain_out * d_out).sum() + (plain_lse * d_lse).sum(), inputs)

    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    with torch.no_grad():
        parts = [sparse_mla.page_partial(q_lat, q_rope, lat, rope, start, positions, valid, 0.6)
                 for lat, rope, start in zip(latents, ropes, starts, strict=True)]
        lse = torch.logsumexp(torch.stack([part[1] for part in parts]), dim=0)
        out = sum(part[0] * torch.exp(part[1] - lse).unsqueeze(-1) for part in parts)
        torch.testing.assert_close(out, plain_out, rtol=0, atol=TOL)
        torch.testing.assert_close(lse, plain_lse, rtol=0, atol=TOL)
        assert any(bool(torch.isinf(part[1]).any()) for part in parts)  # some query has no row in some page
        delta = (d_out * out).sum(-1) - d_lse
        grads = [sparse_mla.page_grads(q_lat, q_rope, lat, rope, start, positions, valid, lse, d_out, delta, 0.6)
                 for lat, rope, start in zip(latents, ropes, starts, strict=True)]
    torch.testing.assert_close(sum(g[0] for g in grads), plain[0], rtol=0, atol=TOL)
    torch.testing.assert_close(sum(g[1] for g in grads), plain[1], rtol=0, atol=TOL)
    pages = len(lengths)
    for page, g in enumerate(grads):
        torch.testing.assert_close(g[2], plain[2 + page], rtol=0, atol=TOL)
        torch.testing.assert_close(g[3], plain[2 + pages + page], rtol=0, atol=TOL)


@pytest.mark.parametrize("block", [2, 3], ids=lambda b: f"block{b}")
def test_blocks_fully_selected_and_not(monkeypatch, block):
    """A causal selection as a prompt makes it (query t selects up to K = 5 of positions 0 .. t): the first queries'
    blocks have unselected slots and are masked, the later ones are wholly selected and skip the mask; one query
    in a late block selects nothing (o_lat 0, lse -inf, no gradient from it). Values and gradients equal plain
    autograd over the queries that select something; a block taken as wholly selected while it is not would
    attend position 0 in its unselected slots."""
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", block * 5 * (6 + 4))
    gen = torch.Generator().manual_seed(block)
    tokens, heads, k, lengths = 13, 2, 5, [4, 9]
    positions = torch.stack([torch.nn.functional.pad(torch.randperm(t + 1, generator=gen)[:k], (0, max(0, k - t - 1)))
                             for t in range(tokens)])
    valid = torch.arange(k).unsqueeze(0) <= torch.arange(tokens).unsqueeze(1)
    empty = 10
    valid[empty] = False
    positions = torch.where(valid, positions, torch.zeros_like(positions))
    full = sparse_mla._selected(valid, block)
    assert any(full) and not all(full)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q_lat, q_rope = randn(tokens, heads, 6), randn(tokens, heads, 4)
    latents, ropes = [randn(n, 6) for n in lengths], [randn(n, 4) for n in lengths]
    inputs = [t.requires_grad_() for t in (q_lat, q_rope, *latents, *ropes)]
    d_out, d_lse = randn(tokens, heads, 6), randn(tokens, heads)
    out, lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, 0.7,
                                                  with_lse=True)
    assert torch.equal(out[empty].detach(), torch.zeros(heads, 6)) and bool(torch.isneginf(lse[empty]).all())
    some = torch.arange(tokens) != empty
    grads = torch.autograd.grad((out[some] * d_out[some]).sum() + (lse[some] * d_lse[some]).sum(), inputs)
    plain_out, plain_lse = _plain(q_lat[some], q_rope[some], latents, ropes, positions[some], valid[some], 0.7)
    torch.testing.assert_close(out[some], plain_out, rtol=0, atol=TOL)
    torch.testing.assert_close(lse[some], plain_lse, rtol=0, atol=TOL)
    plain = torch.autograd.grad((plain_out * d_out[some]).sum() + (plain_lse * d_lse[some]).sum(), inputs)
    for grad, ref in zip(grads, plain, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=TOL)


# -- the rows some query selected (selected_rows.py) ----------------------------------------------------------------
def test_select_rows_are_the_distinct_selected_positions():
    """rows == the sorted distinct positions of the valid slots; rows[slots] gives back every valid slot's
    position; unselected slots (whatever position they hold) index row 0 and add no row."""
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 22, (9, 6), generator=gen)
    valid = torch.rand(9, 6, generator=gen) > 0.3
    valid[:, 0] = True
    positions[~valid] = 39  # held by unselected slots only: not a selected row
    selected = selected_rows.select_rows(positions, valid, 40)
    assert torch.equal(selected.rows, torch.unique(positions[valid]))
    assert 39 not in selected.rows.tolist()
    assert torch.equal(selected.rows[selected.slots[valid]], positions[valid])
    assert bool((selected.slots[~valid] == 0).all())
    assert not selected.whole  # fewer than three quarters of the 40 rows: compact
    nothing = selected_rows.select_rows(positions, torch.zeros_like(valid), 40)
    assert nothing.rows.numel() == 0 and bool((nothing.slots == 0).all())
    empty = selected_rows.select_rows(positions[:, :0], valid[:, :0], 0)  # no rows at all
    assert empty.rows.numel() == 0 and empty.slots.shape == (9, 0)
    most = selected_rows.select_rows(positions, valid, 23)  # the same rows, over fewer than twice as many
    assert most.whole and torch.equal(most.rows, torch.arange(23))
    assert torch.equal(most.slots, torch.where(valid, positions, 0))


@pytest.mark.parametrize("tokens", [3, 40], ids=["few-queries", "many-queries"])
def test_row_sinks_take_only_the_selected_rows(monkeypatch, tokens):
    """Pieces 0 and 2 with a row sink (the prompt's staged pages do this, offload/staged_past.py), piece 1 and the
    last without: each sink is called once, with exactly its piece's distinct selected rows (ascending, local to
    the piece) and their gradients, equal to plain autograd's rows of that piece; the piece itself gets no autograd
    gradient. The other pieces' dense gradients and the queries' equal plain autograd's. Few queries select under
    three quarters of the rows (the compact layout); many select more, and every row is laid out and handed to the
    sinks (the unselected ones' gradient zero)."""
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", 4 * 7 * (6 + 4))
    lengths = [29, 6, 31, 5]
    gen = torch.Generator().manual_seed(tokens)
    q_lat, q_rope, latents, ropes, positions, valid = _case(lengths, tokens, 3, 7, gen, shared=3)
    whole = selected_rows.select_rows(positions, valid, sum(lengths)).whole
    assert whole == (tokens == 40)
    inputs = [t.requires_grad_() for t in (q_lat, q_rope, *latents, *ropes)]
    taken = {}

    def sink_of(piece):
        def sink(rows, d_latent, d_rope):
            assert piece not in taken, "one call per piece and backward"
            taken[piece] = (rows, d_latent, d_rope)
        return sink

    sinks = [sink_of(0), None, sink_of(2), None]
    d_out = torch.randn(tokens, 3, 6, generator=gen, dtype=torch.float64)
    out = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, 0.8, row_sinks=sinks)
    grads = torch.autograd.grad(out, inputs, d_out, allow_unused=True)
    plain_out, _ = _plain(q_lat, q_rope, latents, ropes, positions, valid, 0.8)
    plain = torch.autograd.grad(plain_out, inputs, d_out)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    chosen = torch.unique(positions[valid])
    for piece in (0, 2):
        rows, d_latent, d_rope = taken[piece]
        mine = chosen[(chosen >= starts[piece]) & (chosen < starts[piece] + lengths[piece])] - starts[piece]
        # compact: every selected row of the piece, none other; whole: every row (the unselected ones' zero)
        assert torch.equal(rows, torch.arange(lengths[piece]) if whole else mine)
        torch.testing.assert_close(d_latent, plain[2 + piece][rows], rtol=0, atol=TOL)
        torch.testing.assert_close(d_rope, plain[2 + 4 + piece][rows], rtol=0, atol=TOL)
        unselected = torch.ones(lengths[piece], dtype=torch.bool)
        unselected[mine] = False
        assert bool((plain[2 + piece][unselected] == 0).all())  # so the sink's rows are the whole gradient
        assert grads[2 + piece] is None and grads[2 + 4 + piece] is None
    for i, (grad, ref) in enumerate(zip(grads, plain, strict=True)):
        if i not in (2, 4, 6, 8):
            torch.testing.assert_close(grad, ref, rtol=0, atol=TOL)


def test_row_sinks_must_match_the_pieces():
    q_lat, q_rope, latents, ropes, positions, valid = _case([5, 4], 2, 1, 3, torch.Generator().manual_seed(0),
                                                            shared=1)
    with pytest.raises(ValueError, match="row_sinks has 1 entries for 2 pieces"):
        sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, 1.0, row_sinks=[None])
