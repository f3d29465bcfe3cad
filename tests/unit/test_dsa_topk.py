"""The DSA selection's top-k without a sort over every candidate, held to the sorts it replaces, bit for bit.

  canonical_top(scores, k[, ties])     == canonical_top_reference: a stable sort by ties (where given), then a stable
                                          descending sort by score, first k; -inf entries (no candidate) included
  merge_candidates(best, part, k)      == merge_candidates_reference (one stable sort of the concatenation)
  merge_candidate_sets(best, part, k)  == merge_candidate_sets_reference (sort by position, then stably by score)
  dsa_select (blocked, fast merges)    == dsa_select_reference (one stable sort of the whole score matrix)
  key_blocks(pieces, block)            == key_blocks_reference (the pieces joined, then cut): pages joined into
                                          whole blocks, so pages cost no more merges than one tensor

Every comparison is torch.equal on scores and positions: the selection is discrete, the fast path only moves the
same values, so any difference at all is a different selection (no tolerance applies). Cases: scores drawn from a
few values (many ties, ties straddling the k-th place), rows of -inf only, rows with fewer than k candidates, -0.0
against 0.0, k of 1, of N - 1 and of N or more, candidates not in position order (zigzag ranks).
"""

import pytest
import torch

from ds_longstraw.kernels.dsa import selection as dsa

NEG = float("-inf")
DTYPES = [pytest.param(torch.float64, id="f64"), pytest.param(torch.float32, id="f32")]


def _tied_scores(rows, n, dtype, gen, levels=4):
    """Scores from `levels` values (ties everywhere), with rows of all -inf, rows of a few finite entries only, and
    -0.0 beside 0.0 (equal as scores: the sort keeps them in column order)."""
    scores = torch.randint(0, levels, (rows, n), generator=gen).to(dtype) - 1.0
    scores[scores == -1.0] = -0.0
    scores[torch.rand(rows, n, generator=gen) < 0.2] = NEG
    scores[0] = NEG  # no candidate at all
    if rows > 1:
        scores[1, 3:] = NEG  # fewer than k candidates
    if rows > 2:
        scores[2] = 1.0  # one value: every place is a tie
    return scores


def _assert_same(mine, plain):
    assert torch.equal(mine[0], plain[0]) and torch.equal(mine[1], plain[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (13, 1), (13, 5), (13, 12), (13, 13), (13, 40), (97, 31)])
@pytest.mark.parametrize("levels", [2, 5, 1000])
def test_canonical_top_equals_the_sorts(dtype, n, k, levels):
    gen = torch.Generator().manual_seed(n * 100 + k + levels)
    scores = _tied_scores(9, n, dtype, gen, levels)
    assert torch.equal(dsa.canonical_top(scores, k), dsa.canonical_top_reference(scores, k))
    # ties given as positions in any order, repeated where the padding repeats position 0
    ties = torch.randperm(n, generator=gen).expand(9, n).clone()
    ties[scores == NEG] = 0
    assert torch.equal(dsa.canonical_top(scores, k, ties), dsa.canonical_top_reference(scores, k, ties))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_straddling_the_kth_place_keep_position_order(dtype):
    """Hand-made rows where the reference's answer is known: the first of the equal scores by column (no ties
    given) or by tie then column (ties given)."""
    scores = torch.tensor([[2.0, 1.0, 1.0, 3.0, 1.0, 1.0],
                           [NEG, NEG, NEG, NEG, NEG, NEG],
                           [NEG, 0.0, NEG, -0.0, NEG, NEG]], dtype=dtype)
    assert dsa.canonical_top(scores, 3).tolist() == [[3, 0, 1], [0, 1, 2], [1, 3, 0]]
    ties = torch.tensor([[0, 5, 4, 1, 3, 2], [0, 0, 0, 3, 2, 1], [0, 9, 0, 8, 0, 0]])
    assert dsa.canonical_top(scores, 3, ties).tolist() == [[3, 0, 5], [0, 1, 2], [3, 1, 0]]



def test_canonical_keys_sort_float32_as_the_stable_sort():
    """float32 scores without ties take one sort of int64 keys (_canonical_keys): sorting a row's keys gives the
    reference's whole canonical order, over values that stress the bit trick: -0.0 beside 0.0 (equal scores),
    negative and positive values of one magnitude, subnormals, the largest finite values, -inf (no candidate) and
    +inf. A key that kept -0.0 below 0.0, or left the negative values' low bits unflipped, orders them otherwise."""
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, tiny / 4, -tiny / 4, tiny, -tiny, big, -big, float("inf"), NEG,
                           2.5, -2.5, 3.0, -3.0], dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    rows, n = 16, 40
    scores = values[torch.randint(0, values.numel(), (rows, n), generator=gen)]
    keys = dsa._canonical_keys(scores, torch.arange(n).expand(rows, n))
    assert torch.equal(torch.sort(keys, dim=-1).values & 0xFFFFFFFF, dsa.canonical_top_reference(scores, n))


@pytest.mark.parametrize("n,k", [(4608, 512), (700, 512)])
def test_canonical_top_at_the_model_scale(n, k):
    """The small GLM shape's merge (512 of 512 + 4,096 candidates) in float32: scores from a ReLU of few levels, so
    that many are exactly 0.0 or -0.0 and rows with fewer positive scores than k rebuild their ties, beside rows
    without a tie at the k-th place and rows of fewer than k candidates (-inf)."""
    gen = torch.Generator().manual_seed(n + k)
    rows = 24
    scores = torch.relu(torch.randint(-8, 40, (rows, n), generator=gen).float()) * torch.tensor([1.0, -1.0])[
        torch.randint(0, 2, (rows, 1), generator=gen)]
    scores[:8] = torch.randn(8, n, generator=gen)  # no ties
    scores[8:12, :300] = torch.randint(1, 9, (4, 300), generator=gen).float()  # fewer than k positive: ties at 0
    scores[8:12, 300:] = 0.0
    scores[12, 100:] = NEG  # fewer than k candidates
    assert torch.equal(dsa.canonical_top(scores, k), dsa.canonical_top_reference(scores, k))

def _canonical(scores, positions, k):
    """A canonical candidate set (scores, positions) [T, min(k, n)] from raw scores at positions [n] (a stable
    sort over the positions in ascending order: score descending, position ascending)."""
    by_position = torch.sort(positions, stable=True).indices
    scores, positions = scores[:, by_position], positions[by_position]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return scores.gather(-1, order), positions.expand(scores.shape[0], -1).gather(-1, order)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("below,above,k", [(0, 11, 4), (7, 11, 4), (7, 11, 7), (3, 5, 16), (20, 1, 8), (30, 70, 29)])
def test_merge_candidates_equals_its_sort(dtype, below, above, k):
    """best: canonical over positions 0 .. below-1 (its padding -inf at position 0, as extend_candidates pads);
    part: the next keys in position order, or canonical, some unseen (-inf, a causal horizon)."""
    gen = torch.Generator().manual_seed(below * 1000 + above + k)
    rows = 8
    best = _canonical(_tied_scores(rows, below, dtype, gen), torch.arange(below), k)
    pad = max(0, k - best[0].shape[1])  # a query block with fewer candidates, padded with none
    best = (torch.cat([best[0], torch.full((rows, pad), NEG, dtype=dtype)], dim=-1),
            torch.cat([best[1], torch.zeros(rows, pad, dtype=torch.long)], dim=-1))
    raw = _tied_scores(rows, above, dtype, gen)
    positions = torch.arange(below, below + above)
    for part in ((raw, positions.unsqueeze(0)), _canonical(raw, positions, k)):
        _assert_same(dsa.merge_candidates(best, part, k), dsa.merge_candidates_reference(best, part, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("total,ranks,k", [(12, 2, 4), (24, 3, 5), (40, 2, 16), (10, 2, 12), (96, 3, 33)])
def test_merge_candidate_sets_equals_its_sorts(dtype, total, ranks, k):
    """Zigzag ranks' canonical sets (positions interleaved, not in position order), merged in either order, and
    with -inf padding at repeated position 0."""
    gen = torch.Generator().manual_seed(total + ranks + k)
    rows = 7
    scores = _tied_scores(rows, total, dtype, gen, levels=3)
    segment = total // (2 * ranks)
    owned = []
    for r in range(ranks):  # segments r and 2N-1-r (the last takes the rest)
        hi = total if r == 0 else (2 * ranks - r) * segment
        owned.append(torch.cat([torch.arange(r * segment, (r + 1) * segment),
                                torch.arange((2 * ranks - 1 - r) * segment, hi)]))
    parts = [_canonical(scores[:, pos], pos, k) for pos in owned]
    for order in (parts, parts[::-1]):
        mine = plain = dsa.no_candidates(rows, dtype, "cpu")
        for part in order:
            mine = dsa.merge_candidate_sets(mine, part, k)
            plain = dsa.merge_candidate_sets_reference(plain, part, k)
            _assert_same(mine, plain)
        assert torch.equal(mine[0], _canonical(scores, torch.arange(total), k)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,lengths,topk", [(0, [37], 8), (21, [19, 23], 8), (50, [13, 0, 30, 21], 24),
                                                (5, [9, 11], 64)])
def test_blocked_selection_with_ties_equals_the_plain_sort(monkeypatch, dtype, start, lengths, topk):
    """dsa_select over key blocks of 8 and query blocks of 2 (so the running best is merged many times) ==
    dsa_select_reference, with integer-valued indexer inputs: many scores exactly equal, zeros from the ReLU among
    them, straddling the k-th place."""
    monkeypatch.setattr(dsa, "BLOCK_ELEMENTS", 2 * 2 * 8)
    gen = torch.Generator().manual_seed(start + topk)
    keys = [torch.randint(-1, 2, (n, 3), generator=gen).to(dtype) for n in lengths]
    tokens = sum(lengths) - start
    q = torch.randint(-1, 2, (tokens, 2, 3), generator=gen).to(dtype)
    weights = torch.randint(1, 3, (tokens, 2), generator=gen).to(dtype)
    mine = dsa.dsa_select(q, weights, keys, start, topk, 0.5, key_block=8)
    plain = dsa.dsa_select_reference(q, weights, keys, start, topk, 0.5)
    assert torch.equal(mine[1], plain[1]) and torch.equal(mine[0], plain[0])
    assert mine[1].sum(-1).tolist() == [min(topk, start + t + 1) for t in range(tokens)]


@pytest.mark.parametrize("lengths,block,offset", [([37], 8, 0), ([8, 8, 8], 8, 5), ([3, 0, 5, 9, 1], 8, 0),
                                                  ([1024] * 8, 4096, 0), ([5000, 100, 3000], 4096, 7), ([], 8, 0),
                                                  ([0, 0], 8, 0)])
def test_key_blocks_join_pages_and_cut_long_pieces(lengths, block, offset):
    """Blocks of `block` rows at their positions, whatever the pieces' lengths: equal to the pieces joined and cut;
    mixed dtypes join in the promoted dtype (pages in bfloat16 beside a float32 segment)."""
    gen = torch.Generator().manual_seed(len(lengths) + block)
    dtypes = [torch.bfloat16 if i % 2 else torch.float32 for i in range(len(lengths))]
    keys = [torch.randn(n, 3, generator=gen).to(dtype) for n, dtype in zip(lengths, dtypes, strict=True)]
    mine = list(dsa.key_blocks(keys, block, offset))
    plain = dsa.key_blocks_reference(keys, block, offset)
    assert [start for start, _ in mine] == [start for start, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, plain, strict=True))
    assert all(rows.shape[0] == block for _, rows in mine[:-1])
    assert sum(rows.shape[0] for _, rows in mine) == sum(lengths)


def test_pages_cost_the_merges_of_one_tensor(monkeypatch):
    """A query block's keys given as eight pages take as many merges as the same keys as one tensor (two blocks of
    32 here), and select the same: a merge is a top-k over topk + a block's keys, so one per page cost 1 + topk /
    page its top-k elements and a sort of topk per page. Counted by wrapping merge_candidates."""
    calls = []
    merge = dsa.merge_candidates
    monkeypatch.setattr(dsa, "merge_candidates", lambda *args: calls.append(args[1][0].shape[1]) or merge(*args))
    gen = torch.Generator().manual_seed(3)
    whole = torch.randn(64, 4, generator=gen)
    q, weights = torch.randn(16, 2, 4, generator=gen), torch.rand(16, 2, generator=gen)
    picked = {}
    for name, keys in (("whole", [whole]), ("pages", list(whole.split(8)))):
        calls.clear()
        picked[name] = dsa.dsa_select(q, weights, keys, 48, 8, 0.5, key_block=32)
        assert calls == [32, 32], name  # one query block (16 x 2 x 32 scores fit), two key blocks
    assert torch.equal(picked["whole"][0], picked["pages"][0]) and torch.equal(picked["whole"][1], picked["pages"][1])
    plain = dsa.dsa_select_reference(q, weights, [whole], 48, 8, 0.5)
    assert torch.equal(picked["pages"][0], plain[0]) and torch.equal(picked["pages"][1], plain[1])


def test_ties_past_the_keys_low_bits_take_the_sorts():
    """float32 scores with ties take one sort of (score, tie) keys; a tie of 2^32 or more (a position past what a
    key's 32 low bits hold) or a negative one would alias another, so those calls take the sorts, and still equal
    the reference; the same ties shifted into range give the same order through the keys."""
    gen = torch.Generator().manual_seed(11)
    scores = _tied_scores(9, 50, torch.float32, gen, levels=3)
    ties = torch.randperm(50, generator=gen).expand(9, 50).clone()
    for shift in (0, (1 << 32) - 10, -20):
        shifted = ties + shift
        for k in (1, 7, 49):
            top = dsa.canonical_top(scores, k, shifted)
            assert torch.equal(top, dsa.canonical_top_reference(scores, k, shifted))
            assert torch.equal(top, dsa.canonical_top(scores, k, ties))  # the order depends on ties' order only
