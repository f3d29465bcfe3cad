"""Attention across context-parallel ranks: queries meet every rank's K/V pages through (out, lse) partials.

Legend: H query heads, K kv heads, D head dim, Tq queries, Tk keys; q_HTD [H, Tq, D]; pages are token-major
[Tk, K, D] on their owner; out_HTD [H, Tq, D]; lse_HT [H, Tq]; N ranks, rank r owns prompt tokens [lo_r, hi_r).

Three places, three movement choices (what is cheaper to move decides):
  capture  every rank has a shard of queries and needs the other ranks' EARLIER keys of the same layer.
           Zigzag shards (several pieces a rank): a ring, every rank at once (ring_remote_partial): each rank sends
           every other the prefix of its pages that the other's later piece sees, and attends what it receives.
           Contiguous shards, one of two cargos:
           "kv": pages travel from rank j to each later rank (2 K D elements per token per receiver);
           "q": queries travel to each earlier owner and (out, lse) come back ((2 H D + H) per token per owner).
           `capture_move_bytes` evaluates both for the prompt's shard sizes; with grouped-query attention (H > K)
           pages are the cheaper cargo. Pages travel one source rank at a time, page by page.
  replay   the response runs on every rank (see ../topology.py); every rank computes the partial of the (same)
           queries over its own pages, partials are all-gathered and LSE-merged in rank order (identical result
           everywhere). Queries do not move at all; per layer and replayed token each rank receives
           (N-1)(H D + H) elements forward and all-reduces H D (dq) backward.
  prefix   (exact mode) one segment at a time, its owner recomputes its chunks with autograd; its chunk queries
           travel to the ranks holding earlier keys, (out, lse) come back; backward sends (q, dout, lse, delta) and
           gets dq back. dK/dV never leave the page owner: they are added to its gradient pages where they are
           computed.
A rank reads its own pages from its tier page by page through a stager (streamed_partial / streamed_grads), the
next page read ahead: no layer's shard is ever materialised whole, on any tier.

Backward reuses the merged (out, lse) (ring-attention form): with p = exp(s - lse_merged) a shard's keys give
dv = p^T dout, ds = p (dout v^T - delta) scale, dq_part = ds k, dk = ds^T q, where
delta = rowsum(dout * out_merged) - dlse_merged; summing dq_part over the shards gives dq.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.grpo.state import append_rows, keep_segment_attention
from ds_longstraw.kernels import attention_with_past, merge_partials, partial_attention
from ds_longstraw.kernels.attention import KEY_BLOCK, attention_delta, blockwise_grads_from_delta, key_set_grads
from ds_longstraw.offload import Stager
from ds_longstraw.parallel.groups import contiguous_bounds, visible_prefix

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.cp.kinds.base import ShardFrame
    from ds_longstraw.grpo.interfaces import Partial
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.offload import PagePool
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext, Landing, PromptShards


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_partial(q_HTD: torch.Tensor, value_dim: int | None = None) -> Partial:
    """(out, lse) of a query block over no keys: out = 0, lse = -inf."""
    d = q_HTD.shape[-1] if value_dim is None else value_dim
    return (q_HTD.new_zeros(q_HTD.shape[:2] + (d,)),
            torch.full(q_HTD.shape[:2], float("-inf"), dtype=accumulation_dtype(q_HTD.dtype), device=q_HTD.device))


def merge_in_order(partials: Sequence[Partial]) -> Partial:
    """LSE-merge a list of (out, lse) partials left to right (the same order on every rank -> same bits)."""
    out, lse = partials[0]
    for o2, l2 in partials[1:]:
        out, lse = merge_partials(out, lse, o2, l2.to(lse.dtype))
    return out, lse


def sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts summed left to right (every rank the same order, hence the same bits)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def chunked_partial(q_HTD: torch.Tensor, k_KTD: torch.Tensor, v_KTD: torch.Tensor, scale: float, chunk: int) -> Partial:
    """partial_attention over all keys, `chunk` queries at a time (bounds score memory for long query shards)."""
    if q_HTD.shape[1] == 0 or k_KTD.shape[1] == 0:
        return empty_partial(q_HTD, v_KTD.shape[-1])
    outs, lses = [], []
    for a in range(0, q_HTD.shape[1], chunk):
        o, lse_part = partial_attention(q_HTD[:, a:a + chunk], k_KTD, v_KTD, scale)
        outs.append(o)
        lses.append(lse_part)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def streamed_partial(stager: Stager, spec: LayerState, q_HTD: torch.Tensor, scale: float, start: int = 0,
                     end: int | None = None, query_chunk: int | None = None) -> Partial:
    """(out, lse) of q_HTD over tokens [start, end) of this rank's pages of layer `spec.layer`, read page by page
    through `stager` (one page read ahead; no layer's shard is materialised whole) and merged by LSE in order.
    Consecutive pages are attended together, up to KEY_BLOCK keys per partial (short pages would otherwise cost a
    kernel call and a merge each). query_chunk: queries per partial (bounds score memory for long query shards)."""
    result = empty_partial(q_HTD)
    for k_KTD, v_KTD in _key_blocks(stager.stream(spec.layer, start, end), spec.stream_names):
        piece = (chunked_partial(q_HTD, k_KTD, v_KTD, scale, query_chunk) if query_chunk
                 else partial_attention(q_HTD, k_KTD, v_KTD, scale))
        result = merge_in_order([result, piece])
    return result


def _key_blocks(stream: Iterable[tuple[int, int, dict[str, torch.Tensor]]],
                names: Sequence[str]) -> Iterator[tuple[torch.Tensor, ...]]:
    """(K, V) head-major [K, T, D] over runs of consecutive pages of `stream`, up to KEY_BLOCK tokens each
    (page_runs)."""
    for _, _, run in page_runs(stream, names, KEY_BLOCK):
        yield tuple(tensor.transpose(0, 1) for tensor in run)


def page_runs(stream: Iterable[tuple[int, int, dict[str, torch.Tensor]]], names: Sequence[str],
              block: int) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...]]]:
    """(lo, hi, the streams `names` token-major) over runs of consecutive pages of `stream`, up to `block` tokens
    each (short pages would otherwise cost a kernel call and a merge each). A stager releases a page when the next
    is asked for, so each page is copied into the run's buffer (reused from run to run: the caller is done with a
    run when it asks for the next); a page of `block` tokens or more is handed out as its own view, before the
    next page is read."""
    buffers, tokens, start = None, 0, 0
    for lo, hi, pages in stream:
        n = hi - lo
        if buffers is None and n >= block:
            yield lo, hi, tuple(pages[name] for name in names)
            continue
        if buffers is not None and tokens + n > buffers[0].shape[0]:
            yield start, start + tokens, tuple(buffer[:tokens] for buffer in buffers)
            tokens = 0
        if buffers is None:
            buffers = [pages[name].new_empty((max(block, n),) + pages[name].shape[1:]) for name in names]
        if tokens == 0:
            start = lo
        for buffer, name in zip(buffers, names, strict=True):
            buffer[tokens:tokens + n].copy_(pages[name])
        tokens += n
    if tokens:
        yield start, start + tokens, tuple(buffer[:tokens] for buffer in buffers)


def streamed_grads(stager: Stager, spec: LayerState, q_HTD: torch.Tensor, lse_HT: torch.Tensor, dout_HTD: torch.Tensor,
                   delta_HT: torch.Tensor, scale: float, pool: PagePool | TieredPagePool | None = None,
                   end: int | None = None) -> torch.Tensor:
    """The share of this rank's pages [0, end) (None: all) of dq for a merged attention (given the MERGED lse and
    delta), page by page through `stager`; with `pool`, each page's dK/dV is added to its gradient pages as it is
    computed."""
    dq = torch.zeros(q_HTD.shape, dtype=accumulation_dtype(q_HTD.dtype), device=q_HTD.device)
    for lo, _, pages in stager.stream(spec.layer, 0, end):
        k_KTD, v_KTD = (pages[name].transpose(0, 1) for name in spec.stream_names)
        # this page's share given the MERGED lse and delta (the ring-attention form)
        dq_part, dk, dv = blockwise_grads_from_delta(q_HTD, k_KTD, v_KTD, lse_HT, dout_HTD, delta_HT, scale)
        dq += dq_part
        if pool is not None:
            add_page_grads(pool, spec, lo, dk, dv)
    return dq


def streamed_key_grads(stager: Stager, spec: LayerState, q_HTD: torch.Tensor, out_HTD: torch.Tensor,
                       lse_HT: torch.Tensor, dout_HTD: torch.Tensor, scale: float, pool: PagePool | TieredPagePool,
                       end: int | None = None) -> torch.Tensor:
    """streamed_grads' fast twin: the same share of dq and the same dK/dV onto the gradient pages of this rank's
    pages [0, end), from the MERGED out (not delta), over blocks of up to KEY_BLOCK consecutive keys through the
    kernels' dispatch (flash on CUDA, the fused CPU kernel) instead of the plain blockwise loop page by page."""
    dq = torch.zeros(q_HTD.shape, dtype=accumulation_dtype(q_HTD.dtype), device=q_HTD.device)
    start = 0
    for k_KTD, v_KTD in _key_blocks(stager.stream(spec.layer, 0, end), spec.stream_names):
        share, dk, dv = key_set_grads(q_HTD, k_KTD, v_KTD, out_HTD, lse_HT, dout_HTD, scale)
        dq += share.to(dq.dtype)
        add_page_grads(pool, spec, start, dk, dv)  # before the next block reuses the buffers
        start += k_KTD.shape[1]
    return dq


def layer_stager(pool: PagePool | TieredPagePool, specs: Iterable[LayerState], wrap: bool = False) -> Stager:
    """A stager over the paged layers of `specs` (what streamed_partial / streamed_grads read through)."""
    return Stager(pool, {spec.layer: spec.stream_names for spec in specs if spec.streams}, wrap=wrap)


def _pages_KTD(pool: PagePool | TieredPagePool, spec: LayerState, start: int = 0,
               end: int | None = None) -> tuple[torch.Tensor, ...]:
    """An attention layer's (K, V) pages of tokens [start, end), head-major [K, T, D] (its two streams in order)."""
    return tuple(pool.read(spec.layer, name, start, end).transpose(0, 1) for name in spec.stream_names)


def add_page_grads(pool: PagePool | TieredPagePool, spec: LayerState, start: int, *grads_KTD: torch.Tensor) -> None:
    """Add head-major gradients of an attention layer's rows (dK, dV [K, T, D]) to its gradient pages from token
    `start` on (streams that carry no gradient are skipped)."""
    for stream, grad in zip(spec.streams, grads_KTD, strict=True):
        if stream.grad:
            pool.add_grad(spec.layer, stream.name, start, grad.transpose(0, 1))


# -- capture ---------------------------------------------------------------------------------------------------
def capture_move_bytes(bounds: Sequence[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                       lse_bytes: int) -> dict[str, int]:
    """Bytes one attention layer's capture moves over the whole group, for each choice.

    kv: rank j's pages (2 K D per token) go to every later non-empty rank;
    q:  rank j's queries (H D per token) go to every earlier non-empty rank, and (out, lse) (H D + H) come back.
    """
    sizes = [hi - lo for lo, hi in bounds]
    kv = q = 0
    for j, n in enumerate(sizes):
        later = sum(1 for m in sizes[j + 1:] if m)
        earlier = sum(1 for m in sizes[:j] if m)
        if n and later:
            kv += n * 2 * kv_heads * head_dim * elem_bytes * later
        if n and earlier:
            q += n * (2 * heads * head_dim * elem_bytes + heads * lse_bytes) * earlier
    return {"kv": kv, "q": q}


def _capture_kv_move(cp: CPContext, q_HTD: torch.Tensor, stager: Stager, spec: LayerState, scale: float,
                     bounds: Sequence[tuple[int, int]], chunk: int) -> Partial:
    """Pages travel: for each source rank j in turn, j streams its layer pages, page by page, to every later
    non-empty rank (neither side holds a shard of the layer whole)."""
    layer, key = spec.layer, spec.streams[0]
    sizes = [hi - lo for lo, hi in bounds]
    result = empty_partial(q_HTD)
    page = stager.pool.page_tokens
    for j in range(cp.size - 1):
        if sizes[j] == 0:
            continue
        if cp.rank == j:
            for _, _, pages in stager.stream(layer):
                kv = torch.stack([pages[name] for name in spec.stream_names])
                for r in range(j + 1, cp.size):
                    if sizes[r]:
                        cp.send(kv, r)
        elif cp.rank > j and sizes[cp.rank]:
            for lo in range(0, sizes[j], page):  # rank j's pages, as its stager cuts them
                n = min(sizes[j], lo + page) - lo
                kv = cp.recv((2, n) + tuple(key.shape), key.dtype, j, layer, "capture_kv", device=q_HTD.device)
                piece = chunked_partial(q_HTD, kv[0].transpose(0, 1), kv[1].transpose(0, 1), scale, chunk)
                result = merge_in_order([result, piece])
                del kv
    return result


def _capture_q_move(cp: CPContext, q_HTD: torch.Tensor, stager: Stager, spec: LayerState, scale: float,
                    bounds: Sequence[tuple[int, int]], chunk: int) -> Partial:
    """Queries travel: for each client rank j in turn, j sends its queries to every earlier non-empty rank, which
    returns the (out, lse) partial of those queries over its own pages."""
    layer = spec.layer
    sizes = [hi - lo for lo, hi in bounds]
    heads, _, dim = q_HTD.shape
    acc = accumulation_dtype(q_HTD.dtype)
    result = empty_partial(q_HTD)
    for j in range(1, cp.size):
        servers = [i for i in range(j) if sizes[i]]
        if sizes[j] == 0 or not servers:
            continue
        if cp.rank == j:
            for i in servers:
                cp.send(q_HTD, i)
            partials = [result]
            for i in servers:
                out = cp.recv((heads, sizes[j], dim), q_HTD.dtype, i, layer, "capture_q_out", device=q_HTD.device)
                lse = cp.recv((heads, sizes[j]), acc, i, layer, "capture_q_lse", device=q_HTD.device)
                partials.append((out, lse))
            result = merge_in_order(partials)
        elif cp.rank in servers:
            q = cp.recv((heads, sizes[j], dim), q_HTD.dtype, j, layer, "capture_q", device=q_HTD.device)
            out, lse = streamed_partial(stager, spec, q, scale, query_chunk=chunk)
            cp.send(out, j)
            cp.send(lse.to(acc), j)
    return result


def capture_remote_partial(cp: CPContext, q_HTD: torch.Tensor, stager: Stager, spec: LayerState, scale: float,
                           bounds: Sequence[tuple[int, int]], chunk: int) -> Partial:
    """(out, lse) of this rank's shard queries over every earlier rank's pages of layer `spec.layer` (no
    autograd). Every rank calls it for every attention layer; the choice of cargo is the same on every rank."""
    move = cp.capture_move
    if move == "auto":
        elem = q_HTD.element_size()
        cost = capture_move_bytes(bounds, q_HTD.shape[0], spec.streams[0].shape[0], q_HTD.shape[-1], elem,
                                  torch.finfo(accumulation_dtype(q_HTD.dtype)).bits // 8)
        move = "kv" if cost["kv"] <= cost["q"] else "q"
    cp.decisions[(cp.phase_name, spec.layer)] = move
    mover = _capture_kv_move if move == "kv" else _capture_q_move
    return mover(cp, q_HTD, stager, spec, scale, bounds, chunk)


def ring_remote_partial(cp: CPContext, q_HTD: torch.Tensor, stager: Stager, spec: LayerState, scale: float,
                        pieces: PromptShards, chunk: int) -> Partial:
    """(out, lse) of this rank's shard queries over the keys of every other rank that precede them, for a layout
    whose ranks own several pieces (zigzag; no autograd). Every rank is busy at once: in step t = 1..N-1 rank r
    sends the pages that rank r+t needs to it and receives those it needs from rank r-t (mod N), page by page.
    Its sends run on a thread of their own (_RingSends), so a rank attends what it has received while its own
    pages leave, whatever the other ranks' pace (zigzag's rank 0 at CP 2 receives twice the pages of rank 1 and
    does half the work per page), and no rank waits for another's turn.

    The keys a query sees on any rank are a prefix of that rank's local tokens (groups.visible_prefix), so each
    rank sends the longest prefix any piece of the receiver sees, and the receiver cuts each block of pages (up to
    KEY_BLOCK keys, attended at once) to what each of its pieces sees. Alive at once: one page in flight out, the
    block being received and the next page's landing buffer."""
    layer, key = spec.layer, spec.streams[0]
    mine, starts = pieces.mine, pieces.starts
    sizes = [hi - lo for lo, hi in mine]
    out, lse = empty_partial(q_HTD)
    outs, lses = list(out.split(sizes, 1)), list(lse.split(sizes, 1))
    page = stager.pool.page_tokens
    for step in range(1, cp.size):
        dst, src = (cp.rank + step) % cp.size, (cp.rank - step) % cp.size
        need_dst = max((visible_prefix(mine, lo) for lo, hi in pieces[dst] if hi > lo), default=0)
        seen = [visible_prefix(pieces[src], lo) if hi > lo else 0 for lo, hi in mine]  # per piece of mine
        end = max(seen, default=0)
        incoming = [(p0, min(end, p0 + page)) for p0 in range(0, end, page)]  # src's pages, as its stager cuts them

        def landing(index: int, shape: tuple[int, ...] = tuple(key.shape), incoming: list[tuple[int, int]] = incoming,
                    src: int = src) -> Landing:
            p0, p1 = incoming[index]
            return cp.irecv((2, p1 - p0) + shape, key.dtype, src, layer, "capture_kv", q_HTD.device)

        sends = _RingSends(cp, stager, spec, dst, need_dst)
        sends.start()
        try:
            block, block_start = [], 0  # received pages not yet attended
            following = landing(0) if incoming else None
            for index, (_, p1) in enumerate(incoming):
                current, following = following, landing(index + 1) if index + 1 < len(incoming) else None
                block.append(current.wait())
                if p1 - block_start < KEY_BLOCK and following is not None:
                    continue
                kv = torch.cat(block, 1) if len(block) > 1 else block[0]
                for k, (a, b) in enumerate(pairwise(starts)):
                    n = min(p1, seen[k]) - block_start
                    if b > a and n > 0:
                        piece = chunked_partial(q_HTD[:, a:b], kv[0, :n].transpose(0, 1),
                                                kv[1, :n].transpose(0, 1), scale, chunk)
                        outs[k], lses[k] = merge_in_order([(outs[k], lses[k]), piece])
                block, block_start = [], p1
                del kv
        finally:
            sends.finish()
    return torch.cat(outs, 1), torch.cat(lses, 1)


class _RingSends(threading.Thread):
    """The pages [0, need) of this rank's layer going to `dst`, one at a time on this thread (each stacked [K | V]
    into one message; a tier's staging buffers are reused as its stream moves on). finish() joins it and raises
    what it raised."""

    def __init__(self, cp: CPContext, stager: Stager, spec: LayerState, dst: int, need: int) -> None:
        super().__init__(name=f"ring-sends-layer{spec.layer}", daemon=True)
        self.cp, self.stager, self.spec, self.dst, self.need = cp, stager, spec, dst, need
        self.error = None

    def run(self) -> None:
        try:
            if self.need:
                for _, _, pages in self.stager.stream(self.spec.layer, 0, self.need):
                    self.cp.isend(torch.stack([pages[name] for name in self.spec.stream_names]), self.dst).wait()
        except BaseException as error:  # re-raised on the calling thread by finish()
            self.error = error

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def capture_attention_layer(frame: ShardFrame, spec: LayerState, normed_1TC: torch.Tensor) -> torch.Tensor:
    """One full-attention layer of the layer-major capture on this rank's shard (no autograd).

    Pass A computes q, gate, K, V chunk by chunk (frame.chunks: the real chunks then the schedule's dummies; see
    grpo/cp/capture.py) and appends K/V to this rank's pages; then shard_attention gives each chunk's merged (out,
    lse) over every rank's earlier keys, and the output projection is applied. The state's kept_pool, where there
    is one, keeps each chunk's merged (out, lse) (exact mode's prefix_keep_attention)."""
    adapter, layer, kept_pool = frame.adapter, spec.layer, frame.state.kept_pool
    queries, gates, dummies = project_chunks(adapter, spec, normed_1TC, frame.chunks, frame.state.pool)
    results = shard_attention(frame, spec, queries)
    outs = []
    for result, gate in zip(results, gates, strict=True):
        if kept_pool is not None:
            keep_segment_attention(kept_pool, spec, result)
        outs.append(adapter.attention_finish(layer, result[0], gate))
    finish_dummies(adapter, layer, dummies)
    return torch.cat(outs, 1) if outs else normed_1TC.new_zeros(normed_1TC.shape)


def shard_attention(frame: ShardFrame, spec: LayerState, queries: Sequence[torch.Tensor]) -> list[Partial]:
    """The merged (out, lse) of each chunk of this rank's shard (queries: [H, T_c, D] per span of frame.chunks)
    over every rank's keys before it, its own pages being in place (no autograd; every rank calls it for the layer).

    The remote partial over the other ranks' earlier keys is computed for the whole shard (contiguous shards:
    capture_remote_partial; several pieces per rank: ring_remote_partial); then each chunk attends to itself
    (causal) and this rank's earlier pages, and the remote partial is merged by LSE."""
    adapter, cp, pieces, pool, chunk = frame.adapter, frame.cp, frame.pieces, frame.state.pool, frame.chunk
    layer = spec.layer
    heads, _, dim = adapter.attention_geometry()
    scale = adapter.attention_scale(layer)
    q_all = torch.cat(queries, 1) if queries else _empty_queries(adapter, heads, dim)
    stager = layer_stager(pool, [spec])
    try:
        bounds = contiguous_bounds(pieces)
        if bounds is not None:
            remote_out, remote_lse = capture_remote_partial(cp, q_all, stager, spec, scale, bounds, chunk)
        else:
            cp.decisions[(cp.phase_name, layer)] = "ring"
            remote_out, remote_lse = ring_remote_partial(cp, q_all, stager, spec, scale, pieces, chunk)
        del q_all
        return [_chunk_attention(spec, stager, pool, scale, q, a, b, remote_out, remote_lse)
                for (a, b, _), q in zip(frame.chunks.spans, queries, strict=True)]
    finally:
        stager.close()


def _empty_queries(adapter: CausalLMAdapter, heads: int, dim: int) -> torch.Tensor:
    return torch.zeros(heads, 0, dim, dtype=adapter.dtype, device=adapter.device)


def _chunk_attention(spec: LayerState, stager: Stager, pool: PagePool | TieredPagePool, scale: float, q: torch.Tensor,
                     a: int, b: int, remote_out: torch.Tensor, remote_lse: torch.Tensor) -> Partial:
    """One chunk [a, b) of the shard: causal over itself, over this rank's earlier pages (streamed page by page)
    and, merged by LSE, over the earlier ranks' keys (remote partial)."""
    out, lse = attention_with_past(q, [], *_pages_KTD(pool, spec, a, b), scale)
    earlier_out, earlier_lse = streamed_partial(stager, spec, q, scale, 0, a)
    out, lse = merge_partials(out, lse, earlier_out, earlier_lse.to(lse.dtype))
    return merge_partials(out, lse, remote_out[:, a:b], remote_lse[:, a:b].to(lse.dtype))


def project_chunks(adapter: CausalLMAdapter, spec: LayerState, normed_1TC: torch.Tensor, chunks: ShardChunks,
                   pool: PagePool | TieredPagePool | None = None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Queries and rows of this rank's shard chunk by chunk (chunks: lockstep.ShardChunks): the rows of the real
    chunks go onto its own pages (pool None: they are there already); returns the real chunks' queries [H, T_c, D],
    what attention_finish needs of each, and the dummy chunks' (zero output, gate) for finish_dummies."""
    queries, gates, dummies = [], [], []
    for chunk in chunks:
        q, gate, rows = adapter.attention_project(spec.layer, chunk.of(normed_1TC), chunk.position)
        if chunk.dummy:
            dummies.append((torch.zeros_like(q), gate))
            continue
        if pool is not None:
            append_rows(pool, spec, rows)
        queries.append(q)
        gates.append(gate)
    return queries, gates, dummies


def finish_dummies(adapter: CausalLMAdapter, layer: int, dummies: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The dummy chunks' output projections (project_chunks' dummies; results discarded)."""
    for out, gate in dummies:
        adapter.attention_finish(layer, out, gate)


# -- replay: queries on every rank, partials all-gathered -----------------------------------------------------
class PagesFunction(torch.autograd.Function):
    """Attention of queries over prompt pages held elsewhere (other ranks', or all ranks' merged), as one autograd
    node. `pages` says how: pages.forward(layer, q) -> (out, lse); pages.backward(layer, q, out, lse, dout, dlse)
    -> dq, sending dK/dV wherever those pages' gradients belong. The queries' gradient is the only one autograd
    sees: the pages are constants of the graph whose gradients go to gradient pages."""

    @staticmethod
    def forward(ctx: Any, q_HTD: torch.Tensor, pages: Any, layer: int) -> Partial:
        out, lse = pages.forward(layer, q_HTD)
        ctx.save_for_backward(q_HTD, out, lse)
        ctx.pages, ctx.layer = pages, layer
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout_HTD: torch.Tensor | None,
                 dlse_HT: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        q_HTD, out, lse = ctx.saved_tensors
        if dout_HTD is None:
            dout_HTD = torch.zeros_like(out)
        dq = ctx.pages.backward(ctx.layer, q_HTD, out, lse, dout_HTD, dlse_HT)
        return dq.to(q_HTD.dtype), None, None


class KnownPagesFunction(torch.autograd.Function):
    """Like PagesFunction when the MERGED (out, lse) is already known (exact mode's kept attention): forward passes
    it through without any exchange; backward asks `pages` for the remote keys' share of dq from the merged
    (out, lse) and their gradients (the ring-attention form needs nothing else), and passes those gradients on
    to the local keys' node that produced `known`."""

    @staticmethod
    def forward(ctx: Any, q_HTD: torch.Tensor, out_HTD: torch.Tensor, lse_HT: torch.Tensor, pages: Any,
                layer: int) -> Partial:
        ctx.save_for_backward(q_HTD, out_HTD, lse_HT)
        ctx.pages, ctx.layer = pages, layer
        return out_HTD.clone(), lse_HT.clone()

    @staticmethod
    def backward(ctx: Any, dout_HTD: torch.Tensor | None,
                 dlse_HT: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q_HTD, out, lse = ctx.saved_tensors
        dq = ctx.pages.backward(ctx.layer, q_HTD, out, lse, torch.zeros_like(out) if dout_HTD is None else dout_HTD,
                                dlse_HT)
        return dq.to(q_HTD.dtype), dout_HTD, dlse_HT, None, None


def remote_pages_attention(pages: Any, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
    """remote_attention through `pages` (see PagesFunction): the remote partial, or with `known` the merged result
    passed through (KnownPagesFunction)."""
    if known is None:
        return PagesFunction.apply(q_HTD, pages, layer)
    return KnownPagesFunction.apply(q_HTD, known[0], known[1], pages, layer)


class PagesAttention:
    """remote_attention for replay and scoring: (layer, q_HTD) -> (out, lse) over every rank's prompt pages.

    Every rank calls it with the same queries (the response is replayed on every rank). exact: dK/dV of each
    rank's pages are added to its gradient pages. (interfaces.RemoteAttention; its own pages' share:
    interfaces.OwnPages.)"""

    keys = None  # one request per layer (interfaces.RemoteAttention)

    def __init__(self, cp: CPContext, pool: PagePool | TieredPagePool, adapter: CausalLMAdapter,
                 grads_to_pages: bool = False) -> None:
        self.cp, self.pool, self.adapter, self.grads_to_pages = cp, pool, adapter, grads_to_pages
        self.specs = {spec.layer: spec for spec in adapter.specs}
        # this rank's pages, page by page from its tier; wrap: every replay block walks all layers
        self.stager = layer_stager(pool, adapter.specs, wrap=True)

    # -- this rank's pages' share (the replicated schedule below, and grpo/cp/spread.py's) ----------------------
    def own_partial(self, layer: int, q_HTD: torch.Tensor) -> Partial:
        """(out, lse) of the queries over this rank's pages, the lse in the accumulation dtype."""
        out, lse = streamed_partial(self.stager, self.specs[layer], q_HTD, self.adapter.attention_scale(layer))
        return out, lse.to(accumulation_dtype(q_HTD.dtype))

    def own_grads(self, layer: int, q_HTD: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                  delta: torch.Tensor) -> torch.Tensor:
        """This rank's pages' share of dq given the merged lse and delta; dK/dV of its pages stay here, on its
        gradient pages (exact mode)."""
        return streamed_grads(self.stager, self.specs[layer], q_HTD, lse, dout_HTD, delta,
                              self.adapter.attention_scale(layer), self.pool if self.grads_to_pages else None)

    # -- every rank with the same queries ---------------------------------------------------------------------
    def forward(self, layer: int, q_HTD: torch.Tensor) -> Partial:
        out, lse = self.own_partial(layer, q_HTD)
        outs = self.cp.all_gather(out, layer, "replay_out")
        lses = self.cp.all_gather(lse, layer, "replay_lse")
        return merge_in_order(list(zip(outs, lses, strict=True)))

    def backward(self, layer: int, q_HTD: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                 dlse_HT: torch.Tensor | None) -> torch.Tensor:
        dq = self.own_grads(layer, q_HTD, lse, dout_HTD, attention_delta(out, dout_HTD, dlse_HT))
        self.cp.all_reduce_(dq, layer, "replay_dq")
        return dq

    def close(self) -> None:
        self.stager.close()

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
        return remote_pages_attention(self, layer, q_HTD, known)
