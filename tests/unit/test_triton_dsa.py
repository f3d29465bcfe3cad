"""The Triton DSA kernels (kernels/dsa/triton_selection.py, kernels/sparse_mla/triton_attention.py) against the
torch functions beside them (kernels/dsa/selection.py, kernels/sparse_mla/attention.py), under the Triton
interpreter on CPU (tests/conftest.py) and compiled on CUDA.

On CPU the wiring is exercised by forcing `fast_path` true (`triton_path` fixture): the public torch functions
(`dsa_select`, `extend_candidates`, `sparse_latent_attention`, `page_partial`, `page_grads`) then call the kernels
on CPU float32 tensors, exactly as they do on CUDA.

Equivalence chains:
  selection (Triton, float32) == dsa_select (torch, float32) == dsa_select_reference (float64), position for
      position, on inputs of small integers times powers of two: every score is exact in both precisions, so the
      many exact ties (relu zeros, repeated keys) must be broken alike (score descending, then position ascending);
      with context-parallel candidates (prior) and page by page (extend_candidates) too;
  sparse_latent_attention (Triton, float32) == the torch autograd Function in float64: o_lat, lse, d_q_lat,
      d_q_rope and every piece's gradient (pieces empty, strided, duplicated positions across queries, invalid
      slots, a query with no valid slot, an offset);
  page_partial / page_grads (Triton) == their torch versions in float64;
  the tiny GLM model's segment (full and shared indexer layers) with every DSA call on the Triton path == the torch
      path, hidden states and gradients (float32).
Tolerances: float32 kernels against float64 sums of a few dozen terms of O(1): ~1e-6 absolute is float32's
rounding (2^-24 relative) accumulated over the dot products; 2e-5 leaves 10x room. The model comparison runs both
paths in float32 through 4 layers (gradients through the MoE and norms): 1e-4 relative L2.
"""

from contextlib import contextmanager

import pytest
import torch

from ds_longstraw.kernels.dsa import selection as dsa
from ds_longstraw.kernels.dsa import triton_selection as triton_dsa
from ds_longstraw.kernels.sparse_mla import attention as sparse_mla

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

F64 = dict(dtype=torch.float64)
ATOL = 2e-5  # float32 vs float64 on these sizes (see the module docstring)


def _force(patch, on):
    """Every DSA call (selection and sparse attention alike) takes the Triton path where `on`, else the torch one."""
    for module in (dsa, sparse_mla):
        patch.setattr(module, "fast_path", lambda tensor, library=None: on)


@pytest.fixture
def triton_path(monkeypatch):
    """Every DSA call takes the Triton path, CPU tensors included (the interpreter runs the kernels)."""
    _force(monkeypatch, True)


@contextmanager
def torch_path():
    """Inside, every DSA call takes the torch path again (the fixture's patch is restored after)."""
    with pytest.MonkeyPatch.context() as patch:
        _force(patch, False)
        yield


def _grid(shape, gen, low=-2, high=3, denominator=1.0):
    """Small integers over a power of two: products and sums stay exact in float32, so scores tie exactly."""
    return torch.randint(low, high, shape, generator=gen).double() / denominator


def _indexer_inputs(tokens, heads, dim, lengths, gen, repeat=True):
    q = _grid((tokens, heads, dim), gen)
    weights = _grid((tokens, heads), gen, denominator=4.0)
    keys = [_grid((n, dim), gen) for n in lengths]
    if repeat and len(keys) > 1 and keys[0].shape[0] > 2 and keys[-1].shape[0] > 1:
        keys[-1][1] = keys[0][2]  # a repeated key: its score ties with an earlier position's for every query
        keys[0][1] = 0.0  # a zero key: relu zero for every query
    return q, weights, keys


def _f32(tensors):
    return [t.float() for t in tensors]


# -- selection ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("start,lengths,topk", [
    (0, [11], 8),  # the first queries see fewer keys than k
    (13, [13, 11], 8),
    (29, [7, 0, 15, 3, 11], 5),  # an empty piece, pieces not multiples of the block
    (20, [17, 20], 40),  # k above every query's visible keys
], ids=["from-0", "two-pieces", "five-pieces", "k-above-keys"])
@pytest.mark.parametrize("heads", [1, 3], ids=["I1", "I3"])
def test_selection_matches_torch_and_reference(triton_path, monkeypatch, start, lengths, topk, heads):
    gen = torch.Generator().manual_seed(start * 10 + heads)
    tokens = sum(lengths) - start
    q, weights, keys = _indexer_inputs(tokens, heads, 16, lengths, gen)
    reference = dsa.dsa_select_reference(q, weights, keys, start, topk, 0.5)
    with torch_path():
        plain = dsa.dsa_select(*_f32([q, weights]), _f32(keys), start, topk, 0.5, key_block=8)
    monkeypatch.setattr(triton_dsa, "BLOCK_ELEMENTS", 7 * 16)  # query blocks of a few rows (of different horizons)
    mine = dsa.dsa_select(*_f32([q, weights]), _f32(keys), start, topk, 0.5)
    for expected in (reference, plain):
        assert torch.equal(mine[1], expected[1])
        assert torch.equal(mine[0], expected[0])
    assert mine[1].sum(-1).tolist() == [min(topk, start + t + 1) for t in range(tokens)]
    scores = dsa._index_scores(q, weights, torch.cat(keys), 0.5).gather(-1, reference[0])
    chosen = scores[reference[1]]
    assert chosen.unique().numel() < chosen.numel(), "the inputs must hold exact ties among the selected"


def test_selection_of_random_floats_matches_torch(triton_path):
    """Scores of random floats: the same selection as the torch float32 path (no near-ties at this seed)."""
    gen = torch.Generator().manual_seed(7)
    lengths, start, topk = [9, 14, 10], 21, 6
    tokens = sum(lengths) - start
    q = torch.randn(tokens, 3, 20, generator=gen)  # D = 20: not a power of two
    weights = torch.randn(tokens, 3, generator=gen)
    keys = [torch.randn(n, 20, generator=gen) for n in lengths]
    mine = dsa.dsa_select(q, weights, keys, start, topk, 0.3)
    with torch_path():
        expected = dsa.dsa_select(q, weights, keys, start, topk, 0.3)
    assert torch.equal(mine[0], expected[0]) and torch.equal(mine[1], expected[1])


def test_selection_with_prior_candidates(triton_path):
    """Context parallelism: the keys before `offset` arrive as canonical candidates (here from the torch
    extend_candidates); finishing the selection in Triton gives the one-rank torch selection."""
    gen = torch.Generator().manual_seed(3)
    lengths, start, topk, offset = [10, 9, 12], 19, 7, 10
    tokens = sum(lengths) - start
    q, weights, keys = _indexer_inputs(tokens, 2, 16, lengths, gen)
    keys[2][3] = keys[0][5]  # a tie across the offset: the prior's position wins
    q, weights, keys = *_f32([q, weights]), _f32(keys)
    expected = dsa.dsa_select_reference(q, weights, keys, start, topk, 0.5)
    with torch_path():
        prior = dsa.extend_candidates(None, q, weights, keys[0], 0, start, topk, 0.5)
    mine = dsa.dsa_select(q, weights, keys[1:], start, topk, 0.5, offset=offset, prior=prior)
    assert torch.equal(mine[0], expected[0]) and torch.equal(mine[1], expected[1])


@pytest.mark.parametrize("query_start", [None, 4], ids=["after-every-key", "causal"])
def test_extend_candidates_page_by_page(monkeypatch, query_start):
    """Pages of keys merged one by one into running candidates: the same selection as the torch path."""
    gen = torch.Generator().manual_seed(5)
    q, weights, keys = _indexer_inputs(9, 3, 16, [6, 5, 7], gen)
    q, weights, keys = *_f32([q, weights]), _f32(keys)
    results = []
    for triton_on in (True, False):
        with monkeypatch.context() as patch:
            _force(patch, triton_on)
            best, first = None, 0
            for page in keys:
                best = dsa.extend_candidates(best, q, weights, page, first, query_start, 8, 0.5)
                first += page.shape[0]
            results.append(dsa.candidates_selection(best, 8))
    (mine_pos, mine_valid), (ref_pos, ref_valid) = results
    assert torch.equal(mine_valid, ref_valid) and torch.equal(mine_pos, ref_pos)


def test_canonical_topk_orders_ties_by_position():
    scores = torch.tensor([[0.0, -0.0, 1.0, float("-inf"), 1.0, -2.0, 0.0, -0.0]])
    columns, best = triton_dsa.canonical_topk(scores, 8)
    assert columns.tolist() == [[2, 4, 0, 1, 6, 7, 5, 3]]
    assert torch.equal(best, scores.gather(-1, columns))


# -- sparse absorbed attention ---------------------------------------------------------------------------------
def _attention_inputs(lengths, tokens, heads, rank, rope, k, gen, offset=0):
    """Float64 inputs: pieces (one strided: a column slice of a wider tensor), a selection with duplicated
    positions across queries, invalid slots and one query with none valid."""
    latents, ropes = [], []
    for i, n in enumerate(lengths):
        wide = torch.randn(n, rank + rope + 3, generator=gen, **F64)
        if i == 1:  # strided pieces: rows of a wider tensor, as a projection's split leaves them
            latents.append(wide[:, :rank])
            ropes.append(wide[:, rank:rank + rope])
        else:
            latents.append(wide[:, :rank].contiguous())
            ropes.append(wide[:, rank:rank + rope].contiguous())
    total = offset + sum(lengths)
    positions = torch.randint(0, total, (tokens, k), generator=gen)
    positions[:, 0] = total - 1  # every query selects the last row: many adds into one row
    valid = torch.rand(tokens, k, generator=gen) > 0.25
    valid[min(2, tokens - 1)] = False
    positions = torch.where(valid, positions, torch.zeros_like(positions))
    q_lat = torch.randn(tokens, heads, rank, generator=gen, **F64)
    q_rope = torch.randn(tokens, heads, rope, generator=gen, **F64)
    return q_lat, q_rope, latents, ropes, positions, valid


def _run_attention(q_lat, q_rope, latents, ropes, positions, valid, scale, offset, d_out, d_lse):
    inputs = [x.detach().clone().requires_grad_() for x in (q_lat, q_rope, *latents, *ropes)]
    n = len(latents)
    out, lse = sparse_mla.sparse_latent_attention(inputs[0], inputs[1], inputs[2:2 + n], inputs[2 + n:], positions,
                                                  valid, scale, offset=offset, with_lse=True)
    seen = torch.isfinite(lse)
    objective = (out * d_out.to(out.dtype)).sum() + (lse.masked_fill(~seen, 0) * d_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(objective, inputs)
    return out, lse, grads


@pytest.mark.parametrize("lengths,tokens,heads,k,offset", [
    ([9, 0, 6, 8], 7, 3, 5, 0),
    ([5, 12], 6, 4, 19, 0),  # K above one block of slots
    ([4, 7, 3], 5, 17, 6, 11),  # heads above one block of heads; rows from position 11 (context parallelism)
], ids=["empty-piece", "k-above-block", "heads-above-block-offset"])
def test_sparse_latent_attention_matches_float64(triton_path, lengths, tokens, heads, k, offset):
    gen = torch.Generator().manual_seed(tokens * 100 + k)
    rank, rope = 24, 8  # not powers of two (blocks pad to 32 and 16)
    q_lat, q_rope, latents, ropes, positions, valid = _attention_inputs(lengths, tokens, heads, rank, rope, k, gen,
                                                                        offset)
    if offset:  # selected positions below the offset are other ranks' rows: left out here
        positions = positions.clone()
        positions[:, 1] = offset - 1
        valid = valid.clone()
        valid[:, 1] = True
    d_out = torch.randn(tokens, heads, rank, generator=gen, **F64)
    d_lse = torch.randn(tokens, heads, generator=gen, **F64)
    mine = _run_attention(*_f32([q_lat, q_rope]), _f32(latents), _f32(ropes), positions, valid, 0.3, offset,
                          d_out, d_lse)
    with torch_path():
        expected = _run_attention(q_lat, q_rope, latents, ropes, positions, valid, 0.3, offset, d_out, d_lse)
    out, lse, grads = mine
    ref_out, ref_lse, ref_grads = expected
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=ATOL)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=ATOL)  # -inf where no valid slot, on both
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
        torch.testing.assert_close(grad.double(), ref, rtol=0, atol=ATOL)


def test_row_sinks_on_the_triton_path(triton_path):
    """Pieces 0 and 2 of four with a row sink (the prompt's staged pages): the Triton backward's compact row
    gradients reach each sink as the piece's distinct selected rows with the torch path's gradients of those rows
    (float64); the other pieces' dense gradients equal the torch path's too."""
    gen = torch.Generator().manual_seed(23)
    lengths, tokens, heads, rank, rope, k = [30, 5, 26, 4], 4, 3, 24, 8, 6
    q_lat, q_rope, latents, ropes, positions, valid = _attention_inputs(lengths, tokens, heads, rank, rope, k, gen)
    d_out = torch.randn(tokens, heads, rank, generator=gen, **F64)

    def run(tensors):
        inputs = [x.detach().clone().requires_grad_() for x in tensors]
        taken = {}
        sinks = [lambda *got: taken.setdefault(0, got), None, lambda *got: taken.setdefault(2, got), None]
        out = sparse_mla.sparse_latent_attention(inputs[0], inputs[1], inputs[2:6], inputs[6:], positions, valid,
                                                 0.3, row_sinks=sinks)
        return taken, torch.autograd.grad(out, inputs, d_out.to(out.dtype), allow_unused=True)

    taken, grads = run(_f32([q_lat, q_rope, *latents, *ropes]))
    with torch_path():
        ref_taken, ref_grads = run([q_lat, q_rope, *latents, *ropes])
    assert sorted(taken) == sorted(ref_taken) == [0, 2]
    starts = [0, 30, 35, 61]
    chosen = torch.unique(positions[valid])
    for piece in (0, 2):
        rows, *piece_grads = taken[piece]
        assert torch.equal(rows, chosen[(chosen >= starts[piece]) & (chosen < starts[piece] + lengths[piece])]
                           - starts[piece])
        assert torch.equal(rows, ref_taken[piece][0])
        for mine, ref in zip(piece_grads, ref_taken[piece][1:], strict=True):
            assert mine.dtype == torch.float32
            torch.testing.assert_close(mine.double(), ref, rtol=0, atol=ATOL)
    for i, (grad, ref) in enumerate(zip(grads, ref_grads, strict=True)):
        if i in (2, 4, 6, 8):  # the sinks' pieces
            assert grad is None and ref is None
        else:
            torch.testing.assert_close(grad.double(), ref, rtol=0, atol=ATOL)


def test_page_partial_and_grads_match_float64(triton_path):
    """One page of rows (positions 5 .. 14): the Triton partial and gradients equal the torch ones (float64)."""
    gen = torch.Generator().manual_seed(11)
    tokens, heads, rank, rope, k, page_start = 6, 4, 24, 8, 7, 5
    q_lat, q_rope, (page_lat, _), (page_rope, _), positions, valid = _attention_inputs(
        [10, 10], tokens, heads, rank, rope, k, gen)
    # positions 0 .. 19: some in the page, some not
    lse = torch.randn(tokens, heads, generator=gen, **F64) + 3.0  # a merged lse (larger than the page's own)
    lse[2] = float("-inf")  # a query with no row anywhere
    d_out = torch.randn(tokens, heads, rank, generator=gen, **F64)
    delta = torch.randn(tokens, heads, generator=gen, **F64)
    args = (positions, valid)
    mine_partial = sparse_mla.page_partial(*_f32([q_lat, q_rope, page_lat, page_rope]), page_start, *args, 0.3)
    mine_grads = sparse_mla.page_grads(*_f32([q_lat, q_rope, page_lat, page_rope]), page_start, *args,
                                       *_f32([lse, d_out, delta]), 0.3)
    with torch_path():
        ref_partial = sparse_mla.page_partial(q_lat, q_rope, page_lat, page_rope, page_start, *args, 0.3)
        ref_grads = sparse_mla.page_grads(q_lat, q_rope, page_lat, page_rope, page_start, *args, lse, d_out, delta, 0.3)
    for mine, ref in zip((*mine_partial, *mine_grads), (*ref_partial, *ref_grads), strict=True):
        assert mine.dtype == torch.float32 and mine.shape == ref.shape
        torch.testing.assert_close(mine.double(), ref, rtol=0, atol=ATOL)


# -- the model's segment: full and shared indexer layers ------------------------------------------------------------
def test_glm_segment_on_the_triton_path(monkeypatch):
    """A segment after a captured past through the tiny GLM (indexer layers full, shared, full, shared: a shared
    layer reuses the last full layer's selection, which the Triton selection made): hidden states and the gradients
    of the parameters and of the past rows equal the torch path's (float32 on both sides)."""
    from glm_models import VOCAB, tiny_glm_moe_dsa

    from ds_longstraw.arch import adapter_for

    model = tiny_glm_moe_dsa(dtype=torch.float32)
    adapter = adapter_for(model)
    ids = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(0))
    cut = 29
    weights = torch.randn(1, 41 - cut, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for triton_on in (True, False):
        _force(monkeypatch, triton_on)
        with torch.no_grad():
            captured = adapter.forward_segment(ids[:cut], 0, {}, {})
        past = {index: [tuple(r.clone().requires_grad_() for r in rows)] for index, rows in captured.rows.items()}
        out = adapter.forward_segment(ids[cut:], cut, {}, past)
        past_rows = [r for rows in past.values() for r in rows[0]]
        grads = torch.autograd.grad((out.hidden * weights).sum(), params + past_rows, allow_unused=True)
        results.append((out.hidden.detach(), [torch.zeros(()) if g is None else g for g in grads]))
    (hidden, grads), (ref_hidden, ref_grads) = results
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-5)
    num = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, ref_grads, strict=True))
    den = sum(float(r.pow(2).sum()) for r in ref_grads)
    assert (num / den) ** 0.5 <= 1e-4


# -- compiled, on a CUDA device ---------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_kernels_on_cuda(dtype):
    """GLM-5-like widths (R 512, E 64, H 16, I 8 x D 128, K 64 of 300 keys) compiled on the device. Selection: the
    same as the torch float32 path on exactly representable inputs (ties included). Attention: errors against
    float64 at most 2x (plus float32's floor) those of the torch path in the same dtype, values and gradients."""
    device = "cuda"
    gen = torch.Generator().manual_seed(0)
    lengths, tokens, start, topk = [128, 0, 100, 72], 72, 228, 64
    q, weights, keys = _indexer_inputs(tokens, 8, 128, lengths, gen)
    expected = dsa.dsa_select_reference(*_f32([q, weights]), _f32(keys), start, topk, 0.5)
    cuda = [t.to(device=device, dtype=dtype) for t in (q, *keys)]
    mine = dsa.dsa_select(cuda[0], weights.float().to(device), cuda[1:], start, topk, 0.5)
    assert torch.equal(mine[1].cpu(), expected[1]) and torch.equal(mine[0].cpu(), expected[0])

    heads, rank, rope = 16, 512, 64
    q_lat, q_rope, latents, ropes, positions, valid = _attention_inputs(lengths, tokens, heads, rank, rope, topk, gen)
    d_out = torch.randn(tokens, heads, rank, generator=gen, **F64)
    d_lse = torch.randn(tokens, heads, generator=gen, **F64)
    on = lambda tensors: [t.to(device) for t in tensors]  # noqa: E731
    low = lambda tensors: [t.to(device=device, dtype=dtype) for t in tensors]  # noqa: E731
    exact = _run_attention(*on([q_lat, q_rope]), on(latents), on(ropes), *on([positions, valid]), 0.06, 0,
                           *on([d_out, d_lse]))
    args = (*low([q_lat, q_rope]), low(latents), low(ropes), *on([positions, valid]), 0.06, 0, *on([d_out, d_lse]))
    mine = _run_attention(*args)
    with torch_path():
        plain = _run_attention(*args)
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    for got, ref, base in zip((mine[0], mine[1], *mine[2]), (exact[0], exact[1], *exact[2]),
                              (plain[0], plain[1], *plain[2]), strict=True):
        seen = torch.isfinite(ref)
        if not seen.any():  # the empty piece's gradient
            continue
        err = (got.double() - ref)[seen].abs().max().item()
        plain_err = (base.double() - ref)[seen].abs().max().item()
        assert err <= 2 * plain_err + floor, (err, plain_err)
