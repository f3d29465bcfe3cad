"""Sparse attention across context-parallel ranks: the "topk_lse" combine (arch/specs.py).

A "topk_lse" layer attends, for each query, only the rows of a top-k selection over every earlier key. Under context
parallelism keys and rows are sharded (rank r owns the pages of its pieces of the prompt, groups.shard_pieces: one
contiguous shard, or zigzag segments r and 2N-1-r, kept in prompt order as its local tokens), and the selection is
GLOBAL, not a top-k per shard:

  select   (a layer whose spec names `select` streams; a layer that names none reuses the last selection, which is
           already global) each rank scores its OWN selection pages for the queries and keeps its top-k candidates
           (score, position) in canonical order: score descending, then position ascending (scored in its local
           positions, which order as the prompt's, then mapped to prompt positions). The ranks' candidates merge
           into the global top-k in that total order whatever ranks their positions lie on (zigzag pieces
           interleave). A key of the global top-k is in its owner's top-k (fewer than k keys precede it in the
           canonical order anywhere), so the merged set is exactly the one-rank selection, ties included.
  attend   each rank computes the partial (out, lse) of the queries over the selected rows that it owns, reading its
           pages (spec.row_names) page by page; the partials merge by log-sum-exp in rank order.
  backward each owner computes its rows' share of d(query) from the MERGED (out, lse) (the ring-attention form:
           delta = rowsum(d_out * out) - d_lse) and, in exact mode, adds d(rows) to ITS gradient pages where they are
           computed; the d(query) shares are summed back where the query lives.
Rows never leave their owner. What travels, per query token: the selector to the keys' owners and candidates back
(at most k (score, position) pairs per owner); the query and the positions the receiver owns (int32, -1 elsewhere,
padded to k) to the rows' owners and (out, lse) back; in backward (query, positions, d_out, lse, delta) there and
d(query) back.

Three places, as for "lse" layers (cp_attention.py):
  capture  (layer-major, capture.py) every rank at once, client and server: its selectors go (isend) to the ranks
           holding keys its pieces see (sparse_servers), it answers the ranks whose queries see its keys over the
           prefix of its pages each of their pieces sees, and collects its candidates; then its queries go to the
           same ranks and partials come back the same way (capture_sparse_layer).
  replay   every rank replays every member identically: candidates and partials are all-gathered and merged in rank
           order, so every rank gets the same bits; d(query) is all-reduced (SparsePagesAttention).
  prefix   (exact) the rank in its turn asks the ranks holding keys before its piece (prefix_turns.py's RemotePages and
           serve; its own earlier pieces through OwnRows): the payloads are request_* here, the owners' side
           answer_*.
A rank reads its own pages from its tier page by page through a stager (one page read ahead), the selection's
streams and the attended rows each through their own, so no layer's shard is materialised whole.

The family's math is the adapter's (arch/): sparse_geometry (what travels per query token), sparse_project (the
projections), sparse_candidates (one page of keys into the candidates), merge_candidates, sparse_selection,
sparse_partial / sparse_grads (one page of rows), attention_finish (the output).

Legend: T queries; positions / valid [T, K] a selection (absolute prompt positions); candidates (scores [T, n],
positions [T, n]), canonical; a partial (out [T, ...], lse [T, ...]) as sparse_geometry's `out` says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ds_longstraw.grpo.cp.kinds.attention.ring import merge_in_order, page_runs
from ds_longstraw.grpo.interfaces import MergedGrad, Selected
from ds_longstraw.grpo.state import append_rows, decode_selection, encode_selection
from ds_longstraw.kernels.attention import attention_delta
from ds_longstraw.kernels.sparse_mla.selected_rows import selected_marks
from ds_longstraw.offload import Stager
from ds_longstraw.parallel.groups import local_starts, local_to_prompt, prompt_to_local, visible_prefix

if TYPE_CHECKING:
    from torch.distributed import Work

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState, SparseGeometry
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.cp.kinds.base import ShardFrame
    from ds_longstraw.grpo.interfaces import MergedGrad, Partial
    from ds_longstraw.offload import PagePool
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext, PromptShards

COMBINE = "topk_lse"
# Keys scored per candidates call: consecutive pages are scored together up to this many (each call merges its
# scores into the running top-k, a sort over topk + keys columns per query, so pages shorter than topk would make
# the merges cost more than the scores)
CANDIDATE_BLOCK = 4096


def uses_selection(specs: Iterable[LayerState]) -> bool:
    """Whether any layer combines across ranks by a global top-k."""
    return any(spec.rule.selects for spec in specs)


def check_sparse(specs: Iterable[LayerState], longstraw: LongstrawConfig, cp_size: int) -> None:
    """ValueError (before any work) for what the "topk_lse" combine does not run under context parallelism."""
    layers = [spec.layer for spec in specs if spec.rule.selects]
    if not layers:
        return
    where = f"under 'longstraw.cp_size' = {cp_size}, layers {layers} attend a global top-k selection ({COMBINE!r})"
    if longstraw.cp_attention == "ulysses":
        raise ValueError(f"'longstraw.cp_attention' = 'ulysses': {where}, which a head/sequence all-to-all does not "
                         "serve; use 'lse'")
    if longstraw.prefix_grad == "exact" and longstraw.prefix_keep_attention is True:
        raise ValueError(f"'longstraw.prefix_keep_attention' = True: {where}, which keep no selection under context "
                         "parallelism yet; set it to false or 'auto'")


def sparse_servers(pieces: PromptShards, rank: int) -> list[int]:
    """The ranks holding keys that some query of `rank` sees (every earlier key is seen): on contiguous shards the
    earlier non-empty ranks; on zigzag ones every other rank with a key before `rank`'s last piece."""
    starts = [lo for lo, hi in pieces[rank] if hi > lo]
    if not starts:
        return []
    return [i for i in range(len(pieces)) if i != rank and visible_prefix(pieces[i], starts[-1]) > 0]


def sparse_clients(pieces: PromptShards, rank: int) -> list[int]:
    """The ranks whose queries see some key of `rank` (those it answers in the capture)."""
    return [j for j in range(len(pieces)) if rank in sparse_servers(pieces, j)]


def local_selection(selected: Selected, pieces: Sequence[tuple[int, int]]) -> Selected:
    """The selection in the local positions of the owner of `pieces` (invalid where a row is not its own)."""
    return Selected(selected.query, *prompt_to_local(selected.positions, selected.valid, pieces))


def owned_positions(positions: torch.Tensor, valid: torch.Tensor, pieces: Sequence[tuple[int, int]],
                    width: int) -> torch.Tensor:
    """The selection as the owner of `pieces` sees it: its own local indices (int32), -1 where the selected row is
    not its own or the slot is invalid, padded with -1 to `width` columns (the receiver's buffer size)."""
    return encode_selection(*prompt_to_local(positions, valid, pieces), width)


def padded_candidates(best: tuple[torch.Tensor, torch.Tensor] | None, tokens: int, width: int, geometry: SparseGeometry,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates (scores, positions) widened to `width` columns with score -inf (never a candidate); None: none."""
    scores = torch.full((tokens, width), float("-inf"), dtype=geometry.score_dtype, device=device)
    positions = torch.zeros((tokens, width), dtype=torch.long, device=device)
    if best is not None:
        scores[:, : best[0].shape[1]] = best[0]
        positions[:, : best[1].shape[1]] = best[1]
    return scores, positions


def empty_partial(geometry: SparseGeometry, tokens: int, device: torch.device) -> Partial:
    """(out, lse) of queries over no rows: out = 0, lse = -inf (both in the lse's dtype)."""
    shape = geometry.out[0]
    return (torch.zeros((tokens, *shape), dtype=geometry.lse_dtype, device=device),
            torch.full((tokens, *shape[:-1]), float("-inf"), dtype=geometry.lse_dtype, device=device))


def merge_partials_as(geometry: SparseGeometry, partials: Iterable[Partial]) -> Partial:
    """LSE-merge partials left to right in the lse's dtype (max(float32, dtype): a low-precision output is rounded
    once, after the merges, not at each), the output then in the geometry's dtype."""
    out, lse = merge_in_order([(o.to(geometry.lse_dtype), l_.to(geometry.lse_dtype)) for o, l_ in partials])
    return out.to(geometry.out[1]), lse


def merge_rank_candidates(adapter: CausalLMAdapter, scores: Sequence[torch.Tensor],
                          positions: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ranks' candidates (padded: score -inf never counts; positions interleave on a zigzag layout), merged in
    rank order into the global top-k."""
    best = None
    for part_scores, part_positions in zip(scores, positions, strict=True):
        best = adapter.merge_candidates(best, (part_scores, part_positions.long()), interleaved=True)
    return best


def row_stager(pool: PagePool | TieredPagePool, specs: Iterable[LayerState], wrap: bool = False) -> Stager:
    """A stager over the rows that "topk_lse" layers attend (the streams their selection does not score)."""
    return Stager(pool, {spec.layer: spec.row_names for spec in specs if spec.rule.selects and spec.streams},
                  wrap=wrap)


def key_stager(pool: PagePool | TieredPagePool, specs: Iterable[LayerState], wrap: bool = False) -> Stager:
    """A stager over the streams the selecting layers score."""
    return Stager(pool, {spec.layer: spec.select for spec in specs if spec.select}, wrap=wrap)


def _runs(stager: Stager, layer: int, names: Sequence[str],
          end: int | None = None) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(lo, hi, {name: tokens}) of this rank's streams `names` of `layer` [0, end) in runs of consecutive pages
    (cp_attention.page_runs, CANDIDATE_BLOCK tokens: a call per short page would cost more in merging candidates,
    or in finding each query's selected rows there, than in the keys or rows themselves)."""
    for lo, hi, run in page_runs(stager.stream(layer, 0, end), names, CANDIDATE_BLOCK):
        yield lo, hi, dict(zip(names, run, strict=True))


# -- this rank's pages, page by page ------------------------------------------------------------------------------
def _has_rows(positions: torch.Tensor, valid: torch.Tensor, lo: int, hi: int) -> bool:
    return bool((valid & (positions >= lo) & (positions < hi)).any())


def _rows_in(positions: torch.Tensor, valid: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The distinct selected rows in [lo, hi), ascending, from lo: one mark per row of the run."""
    inside = valid & (positions >= lo) & (positions < hi)
    return selected_marks(positions - lo, inside, hi - lo).nonzero().squeeze(1)


def streamed_candidates(stager: Stager, adapter: CausalLMAdapter, spec: LayerState, selector: tuple[torch.Tensor, ...],
                        best: tuple[torch.Tensor, torch.Tensor] | None = None, query_start: int | None = None,
                        end: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`best` extended by this rank's selection pages of layer `spec.layer` (tokens [0, end), in its local
    positions), page by page; query_start None: every key is visible to every query (they precede them)."""
    for lo, _, pages in _runs(stager, spec.layer, spec.select, end):
        best = adapter.sparse_candidates(spec.layer, selector, pages, lo, query_start, best)
    return best


def streamed_sparse_partial(stager: Stager, adapter: CausalLMAdapter, spec: LayerState, selected: Selected) -> Partial:
    """(out, lse) of the query over its selected rows among this rank's pages (the selection in this rank's own
    positions), page by page, merged by log-sum-exp in order (in the lse's dtype; the output then in the
    geometry's); pages holding none are not computed on."""
    query, positions, valid = selected
    geometry = adapter.sparse_geometry(spec.layer)
    result = empty_partial(geometry, positions.shape[0], positions.device)
    for lo, hi, pages in _runs(stager, spec.layer, spec.row_names):
        if _has_rows(positions, valid, lo, hi):
            page = adapter.sparse_partial(spec.layer, query, pages, lo, positions, valid)
            result = merge_in_order([result, tuple(t.to(geometry.lse_dtype) for t in page)])
    return result[0].to(geometry.out[1]), result[1]


def streamed_sparse_grads(stager: Stager, adapter: CausalLMAdapter, spec: LayerState, selected: Selected,
                          merged: MergedGrad, pool: PagePool | TieredPagePool | None = None) -> list[torch.Tensor]:
    """This rank's pages' share of d(query) given the MERGED lse and delta (the selection in this rank's own
    positions), page by page (in lse's dtype); with `pool`, the gradients of the page's rows some query selected
    are added to its gradient pages as they are computed (streams that carry one; the other rows' are zero and
    are not touched: pool.add_grad_rows)."""
    (query, positions, valid), (lse, d_out, delta) = selected, merged
    d_query = [torch.zeros(q.shape, dtype=lse.dtype, device=q.device) for q in query]
    grads = {stream.name for stream in spec.streams if stream.grad}
    for lo, hi, pages in _runs(stager, spec.layer, spec.row_names):
        rows = _rows_in(positions, valid, lo, hi)
        if not rows.numel():
            continue
        parts, d_rows = adapter.sparse_grads(spec.layer, query, pages, lo, positions, valid, lse, d_out, delta)
        for total, part in zip(d_query, parts, strict=True):
            total += part
        if pool is not None:
            for name, grad in d_rows.items():
                if name in grads:
                    pool.add_grad_rows(spec.layer, name, lo, rows, grad.index_select(0, rows))
    return d_query


# -- requests and answers, point to point (capture, and the prefix pass through prefix_turns.py) ------------------
# A client's queries travel to the servers (the ranks holding keys they see); a server answers in its own LOCAL
# positions (its pages' order) and the client, which knows every rank's pieces, maps them to prompt positions. The
# capture sends with isend (every rank is client and server at once, so no send may wait for its receiver); the
# prefix pass's turns send plainly (the servers only listen).
def _send_all(cp: CPContext, tensors: Iterable[torch.Tensor], dst: int, works: list[Work] | None = None) -> None:
    for tensor in tensors:
        if works is None:
            cp.send(tensor, dst)
        else:
            works.append(cp.isend(tensor, dst))


def _recv_all(cp: CPContext, parts: Iterable[tuple[Sequence[int], torch.dtype]], tokens: int, src: int, layer: int,
              op: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(cp.recv((tokens, *shape), dtype, src, layer, op, device=device) for shape, dtype in parts)


def candidate_width(geometry: SparseGeometry, ends: Iterable[int]) -> int:
    """The columns a server's candidates take for query groups that see its pages [0, end) for each end in ends."""
    return min(geometry.topk, max(ends, default=0))


def send_selector(cp: CPContext, selector: tuple[torch.Tensor, ...], servers: Iterable[int],
                  works: list[Work] | None = None) -> None:
    for i in servers:
        _send_all(cp, selector, i, works)


def collect_candidates(cp: CPContext, adapter: CausalLMAdapter, layer: int, like: torch.Tensor,
                       server_ends: Mapping[int, Iterable[int]], pieces: PromptShards,
                       best: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`best` merged with every server's candidates for the queries of `like` (a [T, ...] tensor: their count
    and device), in prompt positions; server_ends[i]: the end of server i's pages each query group sees, as
    answer_candidates got them (in server order)."""
    geometry = adapter.sparse_geometry(layer)
    tokens, device = like.shape[0], like.device
    for i in server_ends:
        width = candidate_width(geometry, server_ends[i])
        scores = cp.recv((tokens, width), geometry.score_dtype, i, layer, "sparse_candidate_scores", device=device)
        local = cp.recv((tokens, width), torch.int32, i, layer, "sparse_candidates", device=device)
        best = adapter.merge_candidates(best, (scores, local_to_prompt(local, pieces[i])), interleaved=True)
    return best


def request_candidates(cp: CPContext, adapter: CausalLMAdapter, layer: int, selector: tuple[torch.Tensor, ...],
                       pieces: PromptShards, servers: Sequence[int],
                       end_of: Callable[[int], int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Send the selector to every server; their candidates merged (prompt positions), or None when there are none.
    end_of(i): the end of server i's pages that every query sees."""
    send_selector(cp, selector, servers)
    return collect_candidates(cp, adapter, layer, selector[0], {i: [end_of(i)] for i in servers}, pieces)


def answer_candidates(cp: CPContext, client: int, adapter: CausalLMAdapter, stager: Stager, spec: LayerState,
                      groups: Sequence[tuple[int, int]], works: list[Work] | None = None) -> None:
    """The client's selector in; for each group (rows, end) of its queries in order, this rank's candidates among
    its pages [0, end) (every one of which precedes those queries), local positions, out: candidate_width columns."""
    geometry = adapter.sparse_geometry(spec.layer)
    tokens = sum(rows for rows, _ in groups)
    selector = _recv_all(cp, geometry.selector, tokens, client, spec.layer, "sparse_selector", adapter.device)
    width, a, parts = candidate_width(geometry, [end for _, end in groups]), 0, []
    for rows, end in groups:
        part = tuple(t[a:a + rows] for t in selector)
        best = streamed_candidates(stager, adapter, spec, part, end=end) if rows and end else None
        parts.append(padded_candidates(best, rows, width, geometry, adapter.device))
        a += rows
    scores, positions = _cat(parts) if parts else padded_candidates(None, 0, width, geometry, adapter.device)
    _send_all(cp, (scores, positions.to(torch.int32)), client, works)


def _send_query(cp: CPContext, selected: Selected, pieces: PromptShards, server: int,
                width: int, works: list[Work] | None = None) -> None:
    query, positions, valid = selected
    _send_all(cp, (*query, owned_positions(positions, valid, pieces[server], width)), server, works)


def _recv_query(cp: CPContext, owner: int, adapter: CausalLMAdapter, spec: LayerState,
                tokens: int) -> Selected:
    """The owner's query and its selection in this rank's local positions."""
    geometry = adapter.sparse_geometry(spec.layer)
    query = _recv_all(cp, geometry.query, tokens, owner, spec.layer, "sparse_query", adapter.device)
    local = cp.recv((tokens, geometry.topk), torch.int32, owner, spec.layer, "sparse_positions",
                    device=adapter.device)
    return Selected(query, *decode_selection(local))


def send_partial_requests(cp: CPContext, geometry: SparseGeometry, selected: Selected,
                          pieces: PromptShards, servers: Iterable[int],
                          works: list[Work] | None = None) -> None:
    for i in servers:
        _send_query(cp, selected, pieces, i, geometry.topk, works)


def collect_partials(cp: CPContext, adapter: CausalLMAdapter, layer: int, tokens: int, device: torch.device,
                     servers: Iterable[int]) -> Partial:
    """The servers' partials of a query block, merged in rank order (an empty partial when there are none)."""
    geometry = adapter.sparse_geometry(layer)
    (shape, dtype), partials = geometry.out, [empty_partial(geometry, tokens, device)]
    for i in servers:
        out = cp.recv((tokens, *shape), dtype, i, layer, "sparse_out", device=device)
        lse = cp.recv((tokens, *shape[:-1]), geometry.lse_dtype, i, layer, "sparse_lse", device=device)
        partials.append((out, lse))
    return merge_partials_as(geometry, partials)


def request_partials(cp: CPContext, adapter: CausalLMAdapter, layer: int, selected: Selected,
                     pieces: PromptShards, servers: Sequence[int]) -> Partial:
    """(out, lse) of the query over the selected rows every server owns, merged in rank order."""
    send_partial_requests(cp, adapter.sparse_geometry(layer), selected, pieces, servers)
    return collect_partials(cp, adapter, layer, selected.positions.shape[0], selected.positions.device, servers)


def answer_partial(cp: CPContext, owner: int, adapter: CausalLMAdapter, stager: Stager, spec: LayerState, tokens: int,
                   works: list[Work] | None = None) -> None:
    """The owner's query and this rank's positions in, the partial over those rows out."""
    out, lse = streamed_sparse_partial(stager, adapter, spec, _recv_query(cp, owner, adapter, spec, tokens))
    _send_all(cp, (out, lse), owner, works)


def send_grad_requests(cp: CPContext, geometry: SparseGeometry, selected: Selected, merged: MergedGrad,
                       pieces: PromptShards, servers: Iterable[int],
                       works: list[Work] | None = None) -> None:
    acc, (lse, d_out, delta) = geometry.lse_dtype, merged
    for i in servers:
        _send_query(cp, selected, pieces, i, geometry.topk, works)
        _send_all(cp, (d_out.to(geometry.out[1]), torch.stack([lse.to(acc), delta.to(acc)])), i, works)


def collect_grads(cp: CPContext, adapter: CausalLMAdapter, layer: int, query: tuple[torch.Tensor, ...],
                  servers: Iterable[int], d_query: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """d_query (None: zeros in the lse's dtype) plus every server's share of it."""
    geometry = adapter.sparse_geometry(layer)
    acc = geometry.lse_dtype
    if d_query is None:
        d_query = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in query]
    tokens, device = query[0].shape[0], query[0].device
    for i in servers:
        for total, (shape, _) in zip(d_query, geometry.query, strict=True):
            total += cp.recv((tokens, *shape), acc, i, layer, "sparse_dq", device=device)
    return d_query


def request_grads(cp: CPContext, adapter: CausalLMAdapter, layer: int, selected: Selected, merged: MergedGrad,
                  pieces: PromptShards, servers: Sequence[int]) -> list[torch.Tensor]:
    """Every server's share of d(query) (given the merged lse and delta), summed; the servers add their rows'
    gradients to their gradient pages."""
    send_grad_requests(cp, adapter.sparse_geometry(layer), selected, merged, pieces, servers)
    return collect_grads(cp, adapter, layer, selected.query, servers)


def answer_grads(cp: CPContext, owner: int, adapter: CausalLMAdapter, stager: Stager, spec: LayerState, tokens: int,
                 works: list[Work] | None = None) -> None:
    """The owner's query, this rank's positions, d_out, lse and delta in; this rank's rows' gradients onto its
    gradient pages; its share of d(query) out."""
    geometry = adapter.sparse_geometry(spec.layer)
    selected = _recv_query(cp, owner, adapter, spec, tokens)
    (shape, dtype), acc = geometry.out, geometry.lse_dtype
    d_out = cp.recv((tokens, *shape), dtype, owner, spec.layer, "sparse_d_out", device=adapter.device)
    lse, delta = cp.recv((2, tokens, *shape[:-1]), acc, owner, spec.layer, "sparse_lse_delta", device=adapter.device)
    shares = streamed_sparse_grads(stager, adapter, spec, selected, MergedGrad(lse, d_out, delta), stager.pool)
    _send_all(cp, [part.to(acc) for part in shares], owner, works)


# -- capture ------------------------------------------------------------------------------------------------------
def _cat(parts: Iterable[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Tuples of per-chunk tensors -> one tuple of the shard's tensors."""
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def capture_sparse_layer(frame: ShardFrame, spec: LayerState, normed_1TC: torch.Tensor,
                         selection: tuple[torch.Tensor, torch.Tensor] | None = None,
                         append: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One "topk_lse" layer of the layer-major capture on this rank's shard (no autograd), every rank at once.

    Pass A projects the shard chunk by chunk and appends its rows to this rank's pages. A layer that selects then
    sends its selectors to every rank holding keys they see, answers every rank whose queries see its own keys,
    merges the candidates it gets back and extends them by its own pages (causal), so every query has its global
    selection; a layer that selects nothing reuses `selection` (the last one made). The queries then go to the
    same ranks, which return the partials of the selected rows they own; this rank's own pages give the rest,
    merged by log-sum-exp; the output projection runs chunk by chunk. Returns (the layer's mixer output [1, T, C],
    the selection it used: positions, valid [T, K]).

    frame.chunks: the projections and the output projections walk the real chunks, then the schedule's dummy ones
    (ZeRO-3 lockstep, grpo/cp/capture.py; results discarded), so the exchanges in between sit at the same place in
    every rank's sequence of weight gathers. append False: the rows are on the pages already (the layer-major prefix
    pass's recompute of a layer's output)."""
    adapter, cp, pieces, chunks, pool = frame.adapter, frame.cp, frame.pieces, frame.chunks, frame.state.pool
    layer = spec.layer
    spans = chunks.spans
    selectors, queries, finishes, padded = [], [], [], []
    for chunk in chunks:
        selector, query, finish, rows = adapter.sparse_project(layer, chunk.of(normed_1TC), chunk.position)
        if chunk.dummy:
            padded.append((query, finish))
            continue
        if append:
            append_rows(pool, spec, rows)
        selectors.append(selector)
        queries.append(query)
        finishes.append(finish)
    query = _cat(queries) if queries else None
    keys, rows = key_stager(pool, [spec]), row_stager(pool, [spec])
    try:
        if spec.select:
            selection = shard_selection(cp, adapter, spec, keys, _cat(selectors) if selectors else None, spans,
                                        pieces)
        elif selection is None:
            raise ValueError(f"layer {layer} reuses a selection, but no earlier layer selects")
        out, lse = shard_partial(cp, adapter, spec, rows, Selected(query, *selection), pieces)
    finally:
        keys.close()
        rows.close()
    outs = [adapter.attention_finish(layer, out[a:b], finish)
            for (a, b, _), finish in zip(spans, finishes, strict=True)]
    for dummy_query, finish in padded:
        adapter.attention_finish(layer, torch.zeros_like(dummy_query[0]), finish)
    return (torch.cat(outs, 1) if outs else normed_1TC.new_zeros(normed_1TC.shape)), selection


def capture_sparse_rows(frame: ShardFrame, spec: LayerState, normed_1TC: torch.Tensor) -> None:
    """The rows of a "topk_lse" layer over this rank's shard onto its pages, as capture_sparse_layer's pass A
    appends them, and nothing else (the capture's last layer: grpo/cp/capture.py). The dummy chunks are projected
    too, so every rank makes the same module calls (ZeRO-3 lockstep)."""
    for chunk in frame.chunks:
        rows = frame.adapter.sparse_project(spec.layer, chunk.of(normed_1TC), chunk.position)[3]
        if not chunk.dummy:
            append_rows(frame.state.pool, spec, rows)


def _query_groups(client_pieces: Sequence[tuple[int, int]],
                  server_pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(rows, end of the server's pages they see) of each of a client's pieces."""
    return [(hi - lo, visible_prefix(server_pieces, lo)) for lo, hi in client_pieces]


def exchange_all_at_once(cp: CPContext, pieces: PromptShards,
                         post: Callable[[list[int], list[Work]], Any], answer: Callable[[int, list[Work]], Any],
                         collect: Callable[[list[int]], Any]) -> Any:
    """One exchange with every rank client and server at once: post(servers, works) sends this rank's requests to
    the ranks holding keys its queries see (isend, into works), answer(client, works) serves each rank whose queries
    see this rank's keys, collect(servers) receives the answers and returns the result; then every send is waited
    for. Sends never block, so no rank waits for another's turn."""
    works = []
    servers = sparse_servers(pieces, cp.rank)
    post(servers, works)
    for client in sparse_clients(pieces, cp.rank):
        answer(client, works)
    result = collect(servers)
    for work in works:
        work.wait()
    return result


def exchange_candidates(cp: CPContext, adapter: CausalLMAdapter, spec: LayerState, stager: Stager,
                        selector: tuple[torch.Tensor, ...] | None,
                        pieces: PromptShards) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank at once: its selectors go to the ranks holding keys they see, it answers the ranks whose queries
    see its keys (their pieces' visible prefixes of its pages), and the candidates it gets merge into its shard's
    (prompt positions; None on a rank without earlier keys elsewhere)."""
    mine, tokens = pieces.mine, pieces.tokens

    def collect(servers: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        ends = {i: [end for _, end in _query_groups(mine, pieces[i])] for i in servers}
        return collect_candidates(cp, adapter, spec.layer, torch.empty(tokens, device=adapter.device), ends, pieces)

    return exchange_all_at_once(
        cp, pieces, lambda servers, works: send_selector(cp, selector, servers, works),
        lambda j, works: answer_candidates(cp, j, adapter, stager, spec, _query_groups(pieces[j], mine), works),
        collect)


def shard_selection(cp: CPContext, adapter: CausalLMAdapter, spec: LayerState, keys: Stager,
                    selector: tuple[torch.Tensor, ...] | None, spans: Sequence[tuple[int, int, int]],
                    pieces: PromptShards) -> tuple[torch.Tensor, torch.Tensor]:
    """The global selection (positions, valid) of this rank's shard at selecting layer `spec.layer` (no autograd):
    the other ranks' candidates (exchange_candidates) merged with its own keys' (causal), piece by piece."""
    mine, tokens = pieces.mine, pieces.tokens
    best = exchange_candidates(cp, adapter, spec, keys, selector, pieces)
    if tokens:
        best = own_causal_candidates(keys, adapter, spec, selector, spans, mine, best)
    return piece_selections(adapter, spec.layer, best, mine, tokens)


def own_causal_candidates(stager: Stager, adapter: CausalLMAdapter, spec: LayerState,
                          selector: tuple[torch.Tensor, ...], spans: Sequence[tuple[int, int, int]],
                          mine: Sequence[tuple[int, int]],
                          best: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`best` merged with this rank's own keys' candidates, causal: each chunk's queries (spans, local order) over
    the local tokens up to the chunk's end (local order is prompt order, and a chunk sees no key past its own end,
    so no later key is scored), in local positions, then mapped to prompt positions."""
    parts = []
    for a, b, _ in spans:
        part = tuple(t[a:b] for t in selector)
        parts.append(streamed_candidates(stager, adapter, spec, part, query_start=a, end=b))
    geometry = adapter.sparse_geometry(spec.layer)
    width = max(part[0].shape[1] for part in parts)
    own = _cat([padded_candidates(part, part[0].shape[0], width, geometry, adapter.device) for part in parts])
    own = (own[0], local_to_prompt(own[1], mine))
    return own if best is None else adapter.merge_candidates(best, own, interleaved=True)


def piece_selections(adapter: CausalLMAdapter, layer: int, best: tuple[torch.Tensor, torch.Tensor] | None,
                     mine: Sequence[tuple[int, int]], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's selection from its final candidates, piece by piece (a piece of queries at positions lo.. has
    min(topk, hi) columns, as one process's segment there), widened with invalid slots to a common width."""
    if not tokens:
        return adapter.sparse_selection(layer, None, 0, 0)
    starts, parts = local_starts(mine), []
    for (lo, _hi), (a, b) in zip(mine, pairwise(starts), strict=True):
        if b > a:
            parts.append(adapter.sparse_selection(layer, (best[0][a:b], best[1][a:b]), lo, b - a))
    width = max(positions.shape[1] for positions, _ in parts)
    return (torch.cat([F.pad(positions, (0, width - positions.shape[1])) for positions, _ in parts]),
            torch.cat([F.pad(valid, (0, width - valid.shape[1]), value=False) for _, valid in parts]))


def exchange_partials(cp: CPContext, adapter: CausalLMAdapter, spec: LayerState, stager: Stager, selected: Selected,
                      pieces: PromptShards) -> Partial:
    """Every rank at once: its queries and selections go to the ranks holding keys they see, it answers the ranks
    whose queries see its keys, and the partials it gets merge in rank order (an empty partial where none)."""
    geometry, positions = adapter.sparse_geometry(spec.layer), selected.positions
    return exchange_all_at_once(
        cp, pieces,
        lambda servers, works: send_partial_requests(cp, geometry, selected, pieces, servers, works),
        lambda j, works: answer_partial(cp, j, adapter, stager, spec, pieces.size(j), works),
        lambda servers: collect_partials(cp, adapter, spec.layer, positions.shape[0], positions.device, servers))


def shard_partial(cp: CPContext, adapter: CausalLMAdapter, spec: LayerState, rows: Stager, selected: Selected,
                  pieces: PromptShards) -> Partial:
    """The merged (out, lse) of this rank's shard queries (selected.query None: it has none) over every rank's
    selected rows (no autograd): the other ranks' partials (exchange_partials), then its own rows'."""
    out, lse = exchange_partials(cp, adapter, spec, rows, selected, pieces)
    if selected.query is not None:
        own = streamed_sparse_partial(rows, adapter, spec, local_selection(selected, pieces.mine))
        out, lse = merge_partials_as(adapter.sparse_geometry(spec.layer), [(out, lse), own])
    return out, lse


# -- replay and scoring: the same queries on every rank, candidates and partials all-gathered --------------------
class _SelectedRows(torch.autograd.Function):
    """Attention of a query over selected rows held elsewhere, as one autograd node (pages: an
    interfaces.SelectedRowsPages): pages.partials(layer, selected) -> (out, lse); pages.partial_grads(layer,
    selected, (out, lse), (d_out, d_lse)) -> d(query), sending d(rows) wherever those rows' gradients belong. The
    rows are constants of the graph."""

    @staticmethod
    def forward(ctx: Any, pages: Any, layer: int, positions: torch.Tensor, valid: torch.Tensor,
                *query: torch.Tensor) -> Partial:
        out, lse = pages.partials(layer, Selected(query, positions, valid))
        ctx.save_for_backward(positions, valid, out, lse, *query)
        ctx.pages, ctx.layer = pages, layer
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        positions, valid, out, lse, *query = ctx.saved_tensors
        d_out = torch.zeros_like(out) if d_out is None else d_out
        d_query = ctx.pages.partial_grads(ctx.layer, Selected(tuple(query), positions, valid), (out, lse),
                                          (d_out, d_lse))
        return (None, None, None, None, *(d.to(q.dtype) for d, q in zip(d_query, query, strict=True)))


def merged_grad(partial: Partial, d_partial: tuple[torch.Tensor, torch.Tensor | None]) -> MergedGrad:
    """What every party's share of d(query) needs, from the merged partial (out, lse) and its gradients."""
    (out, lse), (d_out, d_lse) = partial, d_partial
    return MergedGrad(lse, d_out, attention_delta(out, d_out, d_lse))


def selected_rows_attention(pages: Any, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
                            valid: torch.Tensor) -> Partial:
    """(out, lse) of `query` (a tuple of [T, ...] tensors) over the selected rows `pages` reaches, differentiable in
    the query (see _SelectedRows)."""
    return _SelectedRows.apply(pages, layer, positions, valid, *query)


class OwnRows:
    """This rank's pages of "topk_lse" layers over its first pieces `pieces` (local tokens [0, n)) as one party of
    a global selection: its candidates, its partials and its shares of the gradients, page by page from its tier.
    grads_to_pages: its rows' gradients go onto its gradient pages. wrap: a stager walk that restarts at every block."""

    def __init__(self, pool: PagePool | TieredPagePool, adapter: CausalLMAdapter, pieces: Sequence[tuple[int, int]],
                 grads_to_pages: bool = False, wrap: bool = False) -> None:
        self.pool, self.adapter, self.pieces, self.grads_to_pages = pool, adapter, pieces, grads_to_pages
        self.specs = {spec.layer: spec for spec in adapter.specs}
        self.tokens = sum(hi - lo for lo, hi in pieces)
        self.rows, self.keys = row_stager(pool, adapter.specs, wrap=wrap), key_stager(pool, adapter.specs, wrap=wrap)

    def candidates(self, layer: int, selector: tuple[torch.Tensor, ...],
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates (scores, prompt positions int32) of the selector's queries, every one of which sees all these
        rows, padded with score -inf (never a candidate) to `width` columns."""
        spec, geometry = self.specs[layer], self.adapter.sparse_geometry(layer)
        tokens, device = selector[0].shape[0], selector[0].device
        best = streamed_candidates(self.keys, self.adapter, spec, selector, end=self.tokens) if self.tokens else None
        if best is not None:  # scored in local positions (monotone in the prompt's)
            best = (best[0], local_to_prompt(best[1], self.pieces))
        scores, positions = padded_candidates(best, tokens, width, geometry, device)
        return scores, positions.to(torch.int32)

    def partial(self, layer: int, selected: Selected) -> Partial:
        """(out, lse) of the query over the selected rows among these pages."""
        return streamed_sparse_partial(self.rows, self.adapter, self.specs[layer],
                                       local_selection(selected, self.pieces))

    def grads(self, layer: int, selected: Selected, merged: MergedGrad) -> list[torch.Tensor]:
        """These pages' share of d(query) given the merged lse and delta; d(rows) stay here, on the gradient pages
        (grads_to_pages)."""
        return streamed_sparse_grads(self.rows, self.adapter, self.specs[layer], local_selection(selected, self.pieces),
                                     merged, self.pool if self.grads_to_pages else None)

    def close(self) -> None:
        self.rows.close()
        self.keys.close()


class SparsePagesAttention:
    """remote_attention of "topk_lse" layers for replay and scoring: the prompt's keys on every rank, this one's
    included (positions [0, end)), for queries that every rank computes alike (the response is replayed on every
    rank). `candidates` all-gathers each rank's candidates and merges them; `attend` all-gathers the partials and
    merges them in rank order, so every rank gets the same bits; backward all-reduces d(query), and in exact mode
    each rank adds its own rows' gradients to its gradient pages. (interfaces.RemoteSelection; its own pages' share:
    interfaces.OwnSparsePages.)"""

    def __init__(self, cp: CPContext, pool: PagePool | TieredPagePool, adapter: CausalLMAdapter, end: int,
                 grads_to_pages: bool = False) -> None:
        self.cp, self.adapter, self.end = cp, adapter, end
        pieces = cp.pieces(end)
        self.sizes = pieces.sizes
        # wrap: every replay block walks all layers
        self.own = self.stager = OwnRows(pool, adapter, pieces.mine, grads_to_pages, wrap=True)  # leaves close it

    # -- this rank's pages' share (the replicated schedule below, and grpo/cp/spread.py's) ----------------------
    def own_candidates(self, layer: int, selector: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's candidates at the width every rank uses (OwnRows.candidates)."""
        return self.own.candidates(layer, selector, min(self.adapter.sparse_geometry(layer).topk, max(self.sizes)))

    def own_partial(self, layer: int, selected: Selected) -> Partial:
        return self.own.partial(layer, selected)

    def own_grads(self, layer: int, selected: Selected, merged: MergedGrad) -> list[torch.Tensor]:
        return self.own.grads(layer, selected, merged)

    # -- every rank with the same queries ---------------------------------------------------------------------
    def candidates(self, layer: int, selector: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        scores, positions = self.own_candidates(layer, selector)
        all_scores = self.cp.all_gather(scores, layer, "sparse_candidate_scores")
        all_positions = self.cp.all_gather(positions, layer, "sparse_candidates")
        return merge_rank_candidates(self.adapter, all_scores, all_positions)

    def attend(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
               valid: torch.Tensor) -> Partial:
        return selected_rows_attention(self, layer, query, positions, valid)

    def partials(self, layer: int, selected: Selected) -> Partial:
        out, lse = self.own_partial(layer, selected)
        outs = self.cp.all_gather(out, layer, "sparse_out")
        lses = self.cp.all_gather(lse, layer, "sparse_lse")
        return merge_partials_as(self.adapter.sparse_geometry(layer), list(zip(outs, lses, strict=True)))

    def partial_grads(self, layer: int, selected: Selected, partial: Partial,
                      d_partial: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        d_query = self.own_grads(layer, selected, merged_grad(partial, d_partial))
        flat = self.cp.all_reduce_(torch.cat([d.reshape(-1) for d in d_query]), layer, "sparse_dq")
        return [piece.view_as(d) for piece, d in zip(flat.split([d.numel() for d in d_query]), d_query, strict=True)]

    def close(self) -> None:
        self.own.close()
