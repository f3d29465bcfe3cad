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
