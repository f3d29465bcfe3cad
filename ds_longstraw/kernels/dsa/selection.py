"""DSA selection: the canonical top-k of the DeepSeek Sparse Attention indexer, in torch (GLM's selection).

Legend: T queries of a segment, I indexer heads, D indexer head dim, K the selected positions per query
(min(index_topk, keys)). Keys come as "pieces": what precedes and includes the segment, a list of token-major
tensors in position order starting at position 0 (the prompt's pages, earlier replay blocks, the segment itself):
indexer keys [N_s, D].

Selection (DeepSeek Sparse Attention, as transformers' GlmMoeDsaIndexer defines it): for the query at absolute
position t, score(t, j) = sum_i w_i(t) * relu(scale * q_i(t) . k(j)) over the keys j <= t, in max(float32, model
dtype); the K best positions are kept. Ties are broken canonically, score descending then position ascending (a
stable descending sort over positions in ascending order), so the selected set does not depend on how the keys are
split into pieces or blocks. Positions a query cannot see score -inf and are never selected: a query with fewer
than K visible keys sees all of them.

`dsa_select_reference` is the plain version of `dsa_select` with the same signature; tests compare the two.

Context parallelism (the keys split over ranks, each read page by page): `extend_candidates` merges one page of keys
into a query's canonical candidates (scores, positions) and `merge_candidates` merges candidate sets in position
order, so the ranks' candidates merged in rank order give exactly the one-rank top-k; `dsa_select(..., offset,
prior)` finishes a selection from the candidates of the keys before `offset` (tests/distributed/test_glm_cp.py holds
it to the plain reference).

Fast path: where `kernels.dispatch.fast_path(q, "triton")` says so (a CUDA tensor, mode "auto") and the kernel
takes the inputs (float32 / bfloat16 / float16), `dsa_select` and `extend_candidates` score in Triton and keep the
same canonical top-k (triton_selection.py); every other call (CPU tensors, float64) takes the torch code below,
unchanged.
"""

import torch
import torch.nn.functional as F

from ..dispatch import fast_path, record
from . import triton_selection

# Elements of one query block's indexer scores [Tq, I, keys]: the unit that bounds the transient memory of the
# selection. 2^20 elements are 4 MiB in float32: a block's scores stay in the CPU's cache from the product to the
# top-k (on the small GLM shape, 64 queries a block, the selection took half the CPU time of 2^24's 1,024;
# BENCHMARKS.md, issue 46).
BLOCK_ELEMENTS = 1 << 20
# Keys scored at once by the selection (a query block's scores are [Tq, I, KEY_BLOCK]).
KEY_BLOCK = 4096


def score_dtype(dtype):
    """Selection scores are computed in max(float32, model dtype), as the model computes them in float32."""
    return torch.promote_types(dtype, torch.float32)


def _query_block(per_query, tokens):
    return max(1, min(tokens, BLOCK_ELEMENTS // max(1, per_query)))


# -- selection --------------------------------------------------------------------------------------------------
def _index_scores(q_TID, weights_TI, keys_ND, scale):
    """sum_i w_i relu(scale * q_i . k) for every (query, key): [T, N] (inputs already in the score dtype)."""
    # in place: the same arithmetic without two more [T, I, N] temporaries (each a fresh allocation on the CPU)
    scores_TIN = torch.einsum("tid,nd->tin", q_TID, keys_ND).mul_(scale).relu_()
    return torch.einsum("ti,tin->tn", weights_TI, scores_TIN)


def canonical_top_reference(scores_TN, k, ties_TN=None):
    """Plain version of canonical_top: a stable sort by ties_TN (where given), then a stable descending sort of the
    whole rows by score."""
    index = torch.arange(scores_TN.shape[-1], device=scores_TN.device).expand_as(scores_TN)
    if ties_TN is not None:
        index = torch.sort(ties_TN, dim=-1, stable=True).indices
    order = torch.sort(scores_TN.gather(-1, index), dim=-1, descending=True, stable=True).indices[:, :k]
    return index.gather(-1, order)


def canonical_top(scores_TN, k, ties_TN=None):
    """Columns [T, min(k, N)] of each row's k best scores in canonical order: score descending, then ties_TN
    ascending (where given: positions), then column ascending. This is exactly the first k of
    canonical_top_reference's stable sorts, -inf entries (no candidate) included, but costs a top-k over N and
    sorts over k instead of sorts over N.

    How: torch.topk of k + 1 finds the k-th and (k+1)-th best scores exactly, but among equal entries it keeps an
    arbitrary few. Where the two differ the k best are the k + 1 less the last, whatever topk chose among ties above
    the k-th place; where they are equal (ties straddling the k-th place: equal scores, or -inf where a row holds
    fewer than k candidates) the row is rebuilt: every entry above the k-th score and the first of those equal to
    it in (ties, column) order. The k kept columns are then ordered by column, stably by tie, stably by score
    descending. Scores must not be NaN (an indexer score of finite inputs never is). float32 scores (the
    selection's) take one sort of int64 keys, (score, column) or (score, tie), instead of the sorts
    (_canonical_top_keyed)."""
    tokens, n = scores_TN.shape
    if k == 0 or k >= n:  # nothing to leave out: the reference's sort is over at most k
        return canonical_top_reference(scores_TN, k, ties_TN)
    if scores_TN.dtype == torch.float32:
        top = _canonical_top_keyed(scores_TN, k, ties_TN)
        if top is not None:
            return top
    values, columns = torch.topk(scores_TN, k + 1, dim=-1, sorted=False)
    last, kth = torch.topk(values, 2, dim=-1, largest=False, sorted=True).values.unbind(-1)
    # the (k+1)-th is unique among the k + 1 where it is below the k-th: drop it (column n sorts past the k kept)
    columns.scatter_(-1, values.argmin(dim=-1, keepdim=True), n)
    columns = torch.sort(columns, dim=-1).values[:, :k]
    straddle = last == kth
    if bool(straddle.any()):
        rows = straddle.nonzero().squeeze(1)
        columns[rows] = _boundary_ties(scores_TN[rows], kth[rows].unsqueeze(-1), k,
                                       None if ties_TN is None else ties_TN[rows])
    if ties_TN is not None:
        columns = columns.gather(-1, torch.sort(ties_TN.gather(-1, columns), dim=-1, stable=True).indices)
    order = torch.sort(scores_TN.gather(-1, columns), dim=-1, descending=True, stable=True).indices
    return columns.gather(-1, order)


def _canonical_keys(scores, columns):
    """int64 keys whose ascending order is the canonical order of float32 `scores` at `columns`: score descending,
    then column ascending (distinct within a row, as the columns are). A float's bits with the 31 low ones flipped
    where it is negative are an int32 in the float order (-0.0 first made 0.0: they are equal scores); complemented,
    that int32 orders descending, and the column fills the 32 low bits."""
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ((~ordered).to(torch.int64) << 32) | columns


def _canonical_top_keyed(scores_TN, k, ties_TN=None):
    """canonical_top of float32 scores (k < N): one sort of k + 1 int64 keys per row, (score, column) or with
    ties_TN (score, tie), instead of a sort by column, one by tie and a stable one by score. torch.topk of k + 1
    holds the k best unless ties straddle the k-th place (the k-th and (k+1)-th keys' scores equal); those rows
    are rebuilt by _boundary_ties, as in canonical_top, and ordered by their keys (stably: a tie repeats only at
    the padding's -inf, whose entries keep column order). None where a tie does not fit the key's 32 low bits
    (the caller then sorts): ties are positions, so a prompt of 2^32 tokens."""
    values, columns = torch.topk(scores_TN, k + 1, dim=-1, sorted=False)
    low = columns if ties_TN is None else ties_TN.gather(-1, columns)
    if ties_TN is not None and not _fits_low_bits(low):
        return None
    keys, order = torch.sort(_canonical_keys(values, low), dim=-1)
    top = columns.gather(-1, order[:, :k])
    straddle = (keys[:, k - 1] >> 32) == (keys[:, k] >> 32)
    if bool(straddle.any()):
        rows = straddle.nonzero().squeeze(1)
        scores_RN = scores_TN.index_select(0, rows)
        ties_RN = None if ties_TN is None else ties_TN.index_select(0, rows)
        kept = _boundary_ties(scores_RN, scores_RN.gather(-1, top[rows, k - 1:k]), k, ties_RN)
        kept_low = kept if ties_RN is None else ties_RN.gather(-1, kept)
        if ties_RN is not None and not _fits_low_bits(kept_low):
            return None
        by_key = torch.sort(_canonical_keys(scores_RN.gather(-1, kept), kept_low), dim=-1, stable=True).indices
        top[rows] = kept.gather(-1, by_key)
    return top


def _fits_low_bits(ties):
    return ties.numel() == 0 or (int(ties.min()) >= 0 and int(ties.max()) < (1 << 32))


def _boundary_ties(scores_RN, kth_R1, k, ties_RN):
    """Columns [R, k] (ascending) of each row's k best where the k-th score kth_R1 ties with entries past the k-th
    place: every column above kth_R1, then the first of those equal to it in (ties, column) order."""
    above = scores_RN > kth_R1
    equal = scores_RN == kth_R1
    need_R1 = k - above.sum(dim=-1, keepdim=True)
    if ties_RN is None:  # column order: the first `need` equal ones
        take = equal & (equal.cumsum(dim=-1) <= need_R1)
    else:  # (tie, column) order: the `need` smallest keys tie * N + column among the equal ones (keys distinct)
        n = scores_RN.shape[-1]
        keys = torch.where(equal, ties_RN * n + torch.arange(n, device=scores_RN.device),
                           torch.iinfo(torch.int64).max)
        most = int(need_R1.max())
        first = torch.topk(keys, most, dim=-1, largest=False, sorted=True).indices
        take = torch.zeros_like(equal).scatter_(
            -1, first, torch.arange(most, device=scores_RN.device).unsqueeze(0) < need_R1)
    return (above | take).nonzero()[:, 1].view(-1, k)  # exactly k per row, row-major: ascending columns


def merge_candidates_reference(best, part, k):
    """Plain version of merge_candidates: one stable descending sort of the concatenation."""
    cat_scores = torch.cat([best[0], part[0]], dim=-1)
    cat_pos = torch.cat([best[1], part[1].expand(part[0].shape[0], -1)], dim=-1)
    order = torch.sort(cat_scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return cat_scores.gather(-1, order), cat_pos.gather(-1, order)


def merge_candidates(best, part, k):
    """The k best of two candidate sets (scores [T, n], positions [T, n]) in canonical order (score descending, then
    position ascending). best is canonical; every position of `part` lies above every position of best, and part is
    canonical or in position order: the order of a stable descending sort of their concatenation, which keeps ties
    in position order (canonical_top; merge_candidates_reference sorts). A score of -inf marks no candidate (a key
    the query cannot see, or padding)."""
    cat_scores = torch.cat([best[0], part[0]], dim=-1)
    order = canonical_top(cat_scores, k)
    return cat_scores.gather(-1, order), _positions_at(best[1], part[1], order)


def _positions_at(best_pos, part_pos, order):
    """cat([best_pos, part_pos expanded to best's rows], -1).gather(-1, order), without the concatenation (a
    [T, n] int64 tensor per merge, most of whose columns no query keeps): part_pos is [1, m] (one row of positions
    for every query) or [T, m]."""
    n_best = best_pos.shape[1]
    if part_pos.shape[1] == 0:
        return best_pos.gather(-1, order)
    from_part = (order - n_best).clamp_(min=0)
    if part_pos.shape[0] == 1:
        taken = part_pos[0].index_select(0, from_part.reshape(-1)).view_as(order)
    else:
        taken = part_pos.gather(-1, from_part)
    if n_best:
        taken = torch.where(order < n_best, best_pos.gather(-1, order.clamp(max=n_best - 1)), taken)
    return taken


def merge_candidate_sets_reference(best, part, k):
    """Plain version of merge_candidate_sets: a stable sort by position, then a stable one by score descending."""
    cat_scores = torch.cat([best[0], part[0].to(best[0].dtype)], dim=-1)
    cat_pos = torch.cat([best[1], part[1].expand(part[0].shape[0], -1)], dim=-1)
    by_position = torch.sort(cat_pos, dim=-1, stable=True).indices
    cat_scores, cat_pos = cat_scores.gather(-1, by_position), cat_pos.gather(-1, by_position)
    order = torch.sort(cat_scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return cat_scores.gather(-1, order), cat_pos.gather(-1, order)


def merge_candidate_sets(best, part, k):
    """The k best of two canonical candidate sets over DISJOINT positions that may interleave (other ranks' zigzag
    pieces), in canonical order: score descending, then position ascending, then (padding's repeated positions)
    place in the concatenation, so ties keep position order whatever the sets' order (canonical_top with the
    positions as ties; merge_candidate_sets_reference sorts). Equal, bit for bit, to merge_candidates where part's
    positions lie above best's (both give the one total order)."""
    cat_scores = torch.cat([best[0], part[0].to(best[0].dtype)], dim=-1)
    cat_pos = torch.cat([best[1], part[1].expand(part[0].shape[0], -1)], dim=-1)
    order = canonical_top(cat_scores, k, cat_pos)
    return cat_scores.gather(-1, order), cat_pos.gather(-1, order)


def no_candidates(tokens, dtype, device):
    """The empty candidate set of `tokens` queries."""
    return (torch.full((tokens, 0), float("-inf"), dtype=dtype, device=device),
            torch.zeros((tokens, 0), dtype=torch.long, device=device))


def extend_candidates(best, q_TID, weights_TI, keys_ND, key_start, query_start, topk, scale, key_block=None):
    """Candidates of queries at positions query_start .. (None: after every key, so every key is visible) merged
    with keys_ND [N, D] at positions key_start ..: the topk best of best and these keys, canonical (best: None or
    canonical candidates, all below key_start). Keys a query cannot see score -inf; a query block scores only the
    keys up to its last query (those after it are unseen by all of the block), so where a query sees fewer than
    topk keys its -inf candidates (invalid: candidates_selection drops them) may be fewer or at other positions
    than a whole key block's. Gradient-free; memory per query block its scores [Tq, I, key_block] and running
    best [Tq, topk + key_block]."""
    key_block = key_block or KEY_BLOCK
    tokens = q_TID.shape[0]
    acc = score_dtype(q_TID.dtype)
    device = q_TID.device
    best = no_candidates(tokens, acc, device) if best is None else best
    if fast_path(q_TID, "triton") and triton_selection.supported(q_TID, weights_TI, [keys_ND]):
        record("DSA selection", "triton")
        part = triton_selection.candidates(q_TID, weights_TI, [keys_ND], key_start, query_start, topk, scale)
        return merge_candidates((best[0].to(acc), best[1]), part, topk)
    record("DSA selection", "torch")
    block = _query_block(q_TID.shape[1] * key_block, tokens)
    out_scores, out_pos = [], []
    with torch.no_grad():
        for q0 in range(0, tokens, block):
            q1 = min(tokens, q0 + block)
            q = q_TID[q0:q1].to(acc)
            w = weights_TI[q0:q1].to(acc)
            mine = (best[0][q0:q1].to(acc), best[1][q0:q1])
            for k0 in range(0, keys_ND.shape[0], key_block):
                first, stop = key_start + k0, k0 + key_block
                if query_start is not None:
                    if first > query_start + q1 - 1:  # beyond every query's horizon
                        break
                    # keys past the block's last query score -inf for every query of the block: left out
                    stop = min(stop, query_start + q1 - key_start)
                keys = keys_ND[k0:stop].to(acc)
                positions = torch.arange(first, first + keys.shape[0], device=device).unsqueeze(0)
                scores = _index_scores(q, w, keys, scale)
                if query_start is not None and first + keys.shape[0] - 1 > query_start + q0:  # some unseen
                    query_pos = torch.arange(query_start + q0, query_start + q1, device=device).unsqueeze(1)
                    scores.masked_fill_(positions > query_pos, float("-inf"))  # scores: a fresh tensor
                mine = merge_candidates(mine, (scores, positions), topk)
            out_scores.append(mine[0])
            out_pos.append(mine[1])
    if not out_scores:
        return best
    # query blocks past which a key block lay beyond the horizon hold fewer candidates: pad with none (-inf)
    width = max(scores.shape[1] for scores in out_scores)
    return (torch.cat([F.pad(scores, (0, width - scores.shape[1]), value=float("-inf")) for scores in out_scores]),
            torch.cat([F.pad(pos, (0, width - pos.shape[1])) for pos in out_pos]))


def candidates_selection(best, width):
    """(positions [T, width] int64, valid [T, width] bool) of canonical candidates: the first `width` of them
    (missing ones and -inf scores invalid, position 0)."""
    scores, positions = best[0][:, :width], best[1][:, :width]
    tokens = scores.shape[0]
    out_pos = torch.zeros(tokens, width, dtype=torch.long, device=positions.device)
    out_valid = torch.zeros(tokens, width, dtype=torch.bool, device=positions.device)
    valid = scores > float("-inf")
    out_pos[:, : positions.shape[1]] = torch.where(valid, positions, torch.zeros_like(positions))
    out_valid[:, : positions.shape[1]] = valid
    return out_pos, out_valid


def key_blocks(keys, key_block, offset=0):
    """(first position, key rows) of each block of key_block rows (the last may be shorter), in position order from
    `offset`: a piece longer than key_block is cut, and consecutive shorter pieces are joined (a past in pieces: a
    kept capture graph's segments after its 128-token probe, a tree node's ancestors then its own pages, a long
    member's earlier replay blocks). Each block costs a query one merge (a top-k over topk + its keys, then a sort
    of topk), so pieces cut each on its own cost a merge apiece: 1,024-token pieces took 1.5-1.7x the selection of
    one tensor (bench/bench_key_blocks.py; BENCHMARKS.md, issue 46). A joined block is a copy of its keys,
    [key_block, D]: far below the block's scores [Tq, I, key_block] computed from it. Pieces of different dtypes
    join in their promoted dtype (the scores' dtype is at least it)."""
    held, held_rows = [], 0  # the current block's parts, not yet key_block rows
    for piece in keys:
        lo = 0
        while lo < piece.shape[0]:
            take = min(key_block - held_rows, piece.shape[0] - lo)
            held.append(piece[lo:lo + take])
            held_rows += take
            lo += take
            if held_rows == key_block:
                yield offset, _joined(held)
                offset += held_rows
                held, held_rows = [], 0
    if held:
        yield offset, _joined(held)


def key_blocks_reference(keys, key_block, offset=0):
    """Plain version of key_blocks: every piece joined, then cut into key_block rows."""
    if not keys:
        return []
    joined = torch.cat(list(keys))
    return [(offset + lo, joined[lo:lo + key_block]) for lo in range(0, joined.shape[0], key_block)]


def _joined(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def dsa_select(q_TID, weights_TI, keys, start, topk, scale, key_block=None, offset=0, prior=None):
    """The canonical top-k selection of queries at positions start .. start+T-1 over the keys at positions 0 ..
    start+T-1: `keys`, a list of [N_s, D] pieces in position order from `offset` (the segment's own keys last), and,
    where offset > 0, `prior`: the canonical candidates (scores, positions) over the keys before `offset`, which
    precede the segment and so are visible to every query (context parallelism: the other ranks' keys, merged).

    q_TID [T, I, D] and keys in any dtype (scored in score_dtype of q's dtype); weights_TI [T, I] the per-head
    weights (the model's weights_proj output times I^-0.5); scale the indexer's softmax_scale.
    Returns (positions [T, K] int64, valid [T, K] bool) with K = min(topk, start + T); where valid is False
    the query sees fewer than K keys and the position (0) is to be ignored. Gradient-free, as the model defines
    it. Memory: a query block's scores [Tq, I, key_block] and its running best [Tq, K + key_block].
    """
    key_block = key_block or KEY_BLOCK
    total = offset + sum(piece.shape[0] for piece in keys)
    tokens = q_TID.shape[0]
    if total < start + tokens:
        raise ValueError(f"dsa_select: {total} keys cannot cover queries up to position {start + tokens - 1}")
    if offset and prior is None:
        raise ValueError(f"dsa_select: the keys before position {offset} need their candidates (prior)")
    if fast_path(q_TID, "triton") and triton_selection.supported(q_TID, weights_TI, keys):
        record("DSA selection", "triton")
        best = triton_selection.candidates(q_TID, weights_TI, keys, offset, start, topk, scale)
        if prior is not None:
            best = merge_candidates((prior[0].to(best[0].dtype), prior[1]), best, topk)
        return candidates_selection(best, min(topk, total))
    best = prior
    with torch.no_grad():
        for k0, piece in key_blocks(keys, key_block, offset):
            if k0 > start + tokens - 1:  # beyond the causal horizon of every query
                break
            best = extend_candidates(best, q_TID, weights_TI, piece, k0, start, topk, scale, key_block)
    return candidates_selection(best, min(topk, total))


def dsa_select_reference(q_TID, weights_TI, keys, start, topk, scale, key_block=None):
    """Plain version of dsa_select: the whole [T, N] score matrix, one stable sort."""
    acc = score_dtype(q_TID.dtype)
    keys_ND = torch.cat([piece.to(acc) for piece in keys])
    total, tokens = keys_ND.shape[0], q_TID.shape[0]
    k = min(topk, total)
    with torch.no_grad():
        scores = _index_scores(q_TID.to(acc), weights_TI.to(acc), keys_ND, scale)
        visible = torch.arange(total).unsqueeze(0) <= torch.arange(start, start + tokens).unsqueeze(1)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        valid = values[:, :k] > float("-inf")
        return torch.where(valid, order[:, :k], torch.zeros_like(order[:, :k])), valid
