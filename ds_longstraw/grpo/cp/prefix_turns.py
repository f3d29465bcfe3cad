"""Exact mode's reverse pass over a prompt sharded over context-parallel ranks.

The single-process prefix pass (prefix_pass.py) walks the capture chunks last to first; a chunk's backward needs
the complete gradients of its outputs (its page rows, its end carry), which later tokens produce. Across ranks
the same order holds over the layout's SEGMENTS (groups.shard_pieces: one per rank for contiguous shards, two per
rank for zigzag ones): a segment's chunks can run only once every later segment has run (they add dK/dV to its
pages, and the next segment produces d(carry at its start) = d(carry at this one's end)). So segments take TURNS,
last to first (wall time about that of the single-process pass; memory stays one shard per rank):

  turn s   the owner of segment s runs prefix_backward over that piece's chunks. Its own earlier pages (an
           earlier piece of its own included) are local autograd leaves; the other ranks' earlier pages are reached
           by `RemotePages`: its chunk queries go to every rank holding keys before the piece, whose partial
           (out, lse) over the prefix of its pages the piece sees comes back (forward); backward sends (q, dout,
           lse, delta), the page owner adds dK/dV to ITS gradient pages and returns its dq share. Those ranks run
           `serve` until the owner says DONE.
           Then the owner hands d(carry at the piece's start) to the owner of the previous segment (kept if that
           is itself), where it is d(carry at that segment's end).
           With prefix_keep_attention the owner kept its tokens' merged (out, lse) in capture: its forward sends no
           request at all (KnownPagesFunction), only the backward ones.

Under ZeRO-3 (lockstep) every rank of the job must make the same submodule calls in the same order, so turns
are mirrored: in turn s every rank makes the iterations of the schedule's `prefix_turn` (lockstep.TurnIterations:
the owner's real chunks, then dummy ones up to the most chunks segment s has on any replica); the owner runs its
real chunks and then the dummies as zero-gradient one-token iterations, every other rank runs only such zero
iterations, and a rank whose pages the owner reads answers each request from inside the mirrored layer
(`PageServer`): the point-to-point exchanges then sit at the same place in every rank's sequence of weight
gathers, forward and backward.

The last segment's d(final carry) is the replay's gradient of the prompt's final state (every rank has it).
Messages are point-to-point within the CP group; a request is an int64 header [op, layer, queries]. A "topk_lse"
layer's requests (kinds/sparse/) are SELECT (the selection's candidates), then FORWARD and BACKWARD of the selected
rows' partial; their payloads are cp_sparse's request_* / answer_*.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.grpo.cp.capture import last_layer_rows_only
from ds_longstraw.grpo.cp.kinds.attention.ring import (
    accumulation_dtype,
    attention_delta,
    layer_stager,
    merge_in_order,
    remote_pages_attention,
)
from ds_longstraw.grpo.cp.kinds.base import BACKWARD, DONE, FORWARD, SELECT, PageRequest, kind_of
from ds_longstraw.grpo.cp.kinds.sparse.selection import (
    OwnRows,
    empty_partial,
    merge_partials_as,
    merged_grad,
    request_candidates,
    request_grads,
    request_partials,
    selected_rows_attention,
    uses_selection,
)
from ds_longstraw.grpo.lockstep import Schedule, ceil_div, zero_prefix_iteration
from ds_longstraw.grpo.prefix_pass import ReversePass, prefix_backward
from ds_longstraw.parallel.groups import piece_index, visible_prefix

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.grpo.interfaces import Partial, Selected
    from ds_longstraw.grpo.lockstep import TurnIterations
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.offload import PagePool, Stager
    from ds_longstraw.offload.tiered import TieredPagePool
    from ds_longstraw.parallel.groups import CPContext, PromptShards



class RemotePages:
    """remote_attention of the owner in its turn: (layer, q_HTD) -> (out, lse) over the other ranks' earlier pages;
    for a "topk_lse" layer candidates(layer, selector) and attend(layer, query, positions, valid) (the adapter's
    `remote`: the keys before position `start`, where the turn's piece begins). servers: the ranks that hold keys
    before the turn's piece (each answers over the prefix of its pages the piece sees). earlier: None, or (a
    "topk_lse" family on a layout where a rank owns several pieces) cp_sparse.OwnRows over this rank's own earlier
    pieces, which the selection reaches like the other ranks' rows: the adapter's past must be contiguous in
    positions up to the segment, so it starts at the turn's piece. (interfaces.RemoteAttention, whose `keys` it
    offers, and interfaces.RemoteSelection.)"""

    def __init__(self, cp: CPContext, pieces: PromptShards, servers: Sequence[int],
                 adapter: CausalLMAdapter | None = None, start: int = 0, earlier: OwnRows | None = None) -> None:
        self.cp, self.pieces, self.servers, self.adapter = cp, pieces, servers, adapter
        self.end, self.earlier = start, earlier
        self.visible = {i: visible_prefix(pieces[i], start) for i in servers}

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
        return remote_pages_attention(self, layer, q_HTD, known)

    def _header(self, op: int, layer: int, queries: int, device: torch.device) -> None:
        header = torch.tensor([op, layer, queries], dtype=torch.int64, device=device)
        for i in self.servers:
            self.cp.send(header, i)

    def forward(self, layer: int, q_HTD: torch.Tensor) -> Partial:
        keys = self.keys(layer)
        keys.post_forward(q_HTD)
        return keys.collect_forward()

    def backward(self, layer: int, q_HTD: torch.Tensor, out_HTD: torch.Tensor, lse_HT: torch.Tensor,
                 dout_HTD: torch.Tensor, dlse_HT: torch.Tensor | None) -> torch.Tensor:
        keys = self.keys(layer)
        keys.post_backward(q_HTD, out_HTD, lse_HT, dout_HTD, dlse_HT)
        return keys.collect_backward()

    def keys(self, layer: int) -> RemoteKeys:
        """The other ranks' earlier keys of `layer` as a request in two halves (RemoteKeys), so that the owner
        attends its own key sets while the page owners work (kernels/attention.attention_with_past's remote)."""
        return RemoteKeys(self, layer)

    # -- "topk_lse" layers (cp_sparse.py): the global selection's candidates, then the selected rows' partial ----
    def candidates(self, layer: int, selector: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._header(SELECT, layer, selector[0].shape[0], selector[0].device)
        best = request_candidates(self.cp, self.adapter, layer, selector, self.pieces, self.servers, self.visible.get)
        if self.earlier is not None:
            width = min(self.adapter.sparse_geometry(layer).topk, self.earlier.tokens)
            scores, positions = self.earlier.candidates(layer, selector, width)
            best = self.adapter.merge_candidates(best, (scores, positions.long()), interleaved=True)
        return best

    def attend(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
               valid: torch.Tensor) -> Partial:
        return selected_rows_attention(self, layer, query, positions, valid)

    def partials(self, layer: int, selected: Selected) -> Partial:
        self._header(FORWARD, layer, selected.positions.shape[0], selected.positions.device)
        result = request_partials(self.cp, self.adapter, layer, selected, self.pieces, self.servers)
        if self.earlier is not None:
            own = self.earlier.partial(layer, selected)
            result = merge_partials_as(self.adapter.sparse_geometry(layer), [result, own])
        return result

    def partial_grads(self, layer: int, selected: Selected, partial: Partial,
                      d_partial: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        merged = merged_grad(partial, d_partial)
        self._header(BACKWARD, layer, selected.positions.shape[0], selected.positions.device)
        d_query = request_grads(self.cp, self.adapter, layer, selected, merged, self.pieces, self.servers)
        if self.earlier is not None:
            earlier = self.earlier.grads(layer, selected, merged)
            for total, part in zip(d_query, earlier, strict=True):
                total += part.to(total.dtype)
        return d_query

    def close(self, device: torch.device) -> None:
        self._header(DONE, -1, 0, device)
        if self.earlier is not None:
            self.earlier.close()


class RemoteKeys:
    """One attention layer's keys on the other ranks, for the owner in its turn: post_* sends a request to every
    server (they compute while the owner goes on), collect_* receives and combines their answers.
      forward   header, q out; (out, lse) back, merged in server order
      backward  header, q, dout, (lse, delta) out (the MERGED result's, the ring-attention form); dq shares back,
                summed; each server adds its keys' dK/dV to its gradient pages."""

    def __init__(self, pages: RemotePages, layer: int) -> None:
        self.pages, self.layer = pages, layer

    def post_forward(self, q_HTD: torch.Tensor) -> None:
        pages = self.pages
        pages._header(FORWARD, self.layer, q_HTD.shape[1], q_HTD.device)
        for i in pages.servers:
            pages.cp.send(q_HTD, i)
        self.q = q_HTD

    def collect_forward(self) -> Partial:
        cp, q_HTD, acc = self.pages.cp, self.q, accumulation_dtype(self.q.dtype)
        partials = [(q_HTD.new_zeros(q_HTD.shape),
                     torch.full(q_HTD.shape[:2], float("-inf"), dtype=acc, device=q_HTD.device))]
        for i in self.pages.servers:
            out = cp.recv(q_HTD.shape, q_HTD.dtype, i, self.layer, "prefix_out", device=q_HTD.device)
            lse = cp.recv(q_HTD.shape[:2], acc, i, self.layer, "prefix_lse", device=q_HTD.device)
            partials.append((out, lse))
        del self.q
        return merge_in_order(partials)

    def post_backward(self, q_HTD: torch.Tensor, out_HTD: torch.Tensor, lse_HT: torch.Tensor, dout_HTD: torch.Tensor,
                      dlse_HT: torch.Tensor | None) -> None:
        pages, acc = self.pages, accumulation_dtype(q_HTD.dtype)
        delta_HT = attention_delta(out_HTD, dout_HTD, dlse_HT)
        pages._header(BACKWARD, self.layer, q_HTD.shape[1], q_HTD.device)
        for i in pages.servers:
            pages.cp.send(q_HTD, i)
            pages.cp.send(dout_HTD.to(q_HTD.dtype), i)
            pages.cp.send(torch.stack([lse_HT.to(acc), delta_HT.to(acc)]), i)
        self.shape, self.dtype, self.device = q_HTD.shape, acc, q_HTD.device

    def collect_backward(self) -> torch.Tensor:
        cp = self.pages.cp
        dq = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for i in self.pages.servers:
            dq += cp.recv(self.shape, self.dtype, i, self.layer, "prefix_dq", device=self.device)
        return dq


def _answer(cp: CPContext, owner: int, adapter: CausalLMAdapter, stager: Stager, chunk: int, header: tuple[int, ...],
            end: int | None = None) -> None:
    """Answer one request of `owner` (its header (op, layer, query tokens) already read) against this rank's pages
    [0, end) (None: all; the keys the owner's piece sees), by the layer's kind, streamed from its tier page by page
    through `stager` (dK/dV go to the gradient pages page by page)."""
    op, layer, tokens = header
    kind_of(adapter.specs[layer]).answer(cp, adapter, stager, chunk, PageRequest(owner, op, layer, tokens, end))


def _read_header(cp: CPContext, owner: int, device: torch.device) -> tuple[int, ...]:
    return tuple(int(x) for x in cp.recv((3,), torch.int64, owner, -1, "prefix_header", device=device))


def serve(cp: CPContext, owner: int, adapter: CausalLMAdapter, pool: PagePool | TieredPagePool, chunk: int,
          end: int | None = None) -> None:
    """Answer `owner`'s requests against this rank's pages [0, end) until it says DONE."""
    stager = layer_stager(pool, adapter.specs)
    try:
        while True:
            header = _read_header(cp, owner, adapter.device)
            if header[0] == DONE:
                return
            _answer(cp, owner, adapter, stager, chunk, header, end)
    finally:
        stager.close()


class PageServer:
    """A rank's pages answering `owner` from inside a mirrored chunk (ZeRO-3 lockstep, see cp_prefix_backward):
    called as remote_attention at each attention layer of a one-token dummy forward, it answers the owner's
    FORWARD request of that layer, and the backward of its (empty) partial answers the owner's BACKWARD request.
    A "topk_lse" layer's dummy asks it for candidates (the owner's SELECT is answered there; the dummy gets none)
    and attends through it (FORWARD, then BACKWARD in the backward of its empty partial), at the places where the
    owner's layer makes those requests.
    A request for another layer or op means the ranks' module calls have diverged: an error, not a hang later."""

    end = 0  # the mirrored dummy iteration is one token at position 0: no keys on other ranks precede it
    keys = None  # one request per layer (interfaces.RemoteAttention)

    def __init__(self, cp: CPContext, owner: int, adapter: CausalLMAdapter, pool: PagePool | TieredPagePool, chunk: int,
                 kept: bool = False, visible: int | None = None) -> None:
        self.cp, self.owner, self.adapter, self.chunk = cp, owner, adapter, chunk
        self.stager = layer_stager(pool, adapter.specs)  # closed by close()
        self.kept = kept  # the owner's attention was kept from capture: it sends no FORWARD request
        self.visible = visible  # this rank's pages [0, visible) are what the owner's piece sees (None: all)

    def answer(self, expected_op: int, expected_layer: int) -> None:
        header = _read_header(self.cp, self.owner, self.adapter.device)
        op, layer, _ = header
        if (op, layer) != (expected_op, expected_layer):
            raise RuntimeError(f"rank {self.cp.rank}: expected request {(expected_op, expected_layer)} from rank "
                               f"{self.owner}, got {(op, layer)}: the ranks' prefix-pass module calls diverged")
        if op != DONE:
            _answer(self.cp, self.owner, self.adapter, self.stager, self.chunk, header, self.visible)

    def close(self) -> None:
        self.stager.close()

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
        assert known is None, "a mirrored iteration keeps no attention of its own"
        return _AnswerOwner.apply(q_HTD, self, layer)

    # -- "topk_lse" layers --------------------------------------------------------------------------------------
    def candidates(self, layer: int, selector: tuple[torch.Tensor, ...]) -> None:
        self.answer(SELECT, layer)
        return None  # the dummy selects among its own key only

    def attend(self, layer: int, query: tuple[torch.Tensor, ...], positions: torch.Tensor,
               valid: torch.Tensor) -> Partial:
        return _AnswerOwnerSparse.apply(self, layer, *query)


class _AnswerOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_HTD: torch.Tensor, server: PageServer, layer: int) -> Partial:
        if not server.kept:
            server.answer(FORWARD, layer)
        ctx.server, ctx.layer = server, layer
        empty = torch.full(q_HTD.shape[:2], float("-inf"), dtype=accumulation_dtype(q_HTD.dtype), device=q_HTD.device)
        return q_HTD.new_zeros(q_HTD.shape), empty  # an empty partial: the dummy's own output is unchanged

    @staticmethod
    def backward(ctx: Any, dout_HTD: torch.Tensor | None, dlse_HT: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.server.answer(BACKWARD, ctx.layer)
        return None, None, None


class _AnswerOwnerSparse(torch.autograd.Function):
    """The "topk_lse" form of _AnswerOwner: forward answers the owner's FORWARD request and returns an empty
    partial for the dummy's query (no rows: out 0, lse -inf); backward answers its BACKWARD request."""

    @staticmethod
    def forward(ctx: Any, server: PageServer, layer: int, *query: torch.Tensor) -> Partial:
        server.answer(FORWARD, layer)
        ctx.server, ctx.layer, ctx.count = server, layer, len(query)
        geometry = server.adapter.sparse_geometry(layer)
        out, lse = empty_partial(geometry, query[0].shape[0], query[0].device)
        return out.to(geometry.out[1]), lse  # as the owner's merged partial comes (cp_sparse.merge_partials_as)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> tuple[None, ...]:
        ctx.server.answer(BACKWARD, ctx.layer)
        return (None, None, *([None] * ctx.count))


def _carry_shapes(state: PrefixState) -> dict[int, list[tuple[torch.Size, torch.dtype]]]:
    """layer -> [(shape, dtype) of each carry part], from the final carry every rank holds."""
    return {layer: [(t.shape, t.dtype) for t in parts] for layer, parts in state.carry.items()}


def cp_prefix_backward(reverse: ReversePass, d_final_carry: Mapping[int, Sequence[torch.Tensor]], cp: CPContext,
                       chunk: int, schedule: Schedule | None = None) -> None:
    """Exact-mode prefix pass of this rank's shard, in turns with the other ranks (see the module docstring).

    reverse.ids: this rank's shard of prompt[:-1] in local order; d_final_carry: d(prompt's final carry) from replay
    (used by the owner of the last segment); chunk: the capture segment (longstraw.segment_tokens: the shards'
    chunking, and queries per partial on the serving side).
    Turns walk the CP segments (every rank's pieces, groups.shard_pieces) last to first: one per rank for
    contiguous shards, two per rank for zigzag ones (a rank's own earlier piece is local past to its later one).
    Parameter gradients of this rank's tokens accumulate into .grad; the caller reduces them.

    schedule: the transaction's lockstep.Schedule (None: the plain one). Where its prefix_turn gives a turn's
    iterations (ZeRO-3, whose weight gathers are collectives over every rank of the job), every rank makes them:
    the owner runs its real chunks and then the dummy ones as zero iterations (lockstep.zero_prefix_iteration),
    every other rank mirrors each of them with a one-token zero iteration, and a rank whose pages the owner reads
    answers the owner's requests from inside its mirror (PageServer), at the same layer of the same module sequence.

    reverse.prefix_recompute: each layer recomputed in backward, real segments and zero iterations alike
    (longstraw.prefix_recompute_runs: only where no layer's forward makes a remote exchange).

    The last layer runs for its rows alone where the capture ran it so (capture.last_layer_rows_only): its output
    over the prompt feeds nothing, so the owner back-propagates the replay's gradients on its pages through the
    row projections and sends no request for it; the mirrors' zero iterations skip its attention alike, so every
    rank's module calls stay the same."""
    adapter, state, backward, prefix_recompute = reverse.adapter, reverse.state, reverse.backward, \
        reverse.prefix_recompute
    whole = not last_layer_rows_only(state)
    pieces = cp.pieces(state.length)
    selects = uses_selection(adapter.specs)
    order, mine = pieces.order, pieces.mine
    shapes = _carry_shapes(state)
    filled = [s for s, (_, _, lo, hi) in enumerate(order) if hi > lo]
    schedule = schedule or Schedule()
    d_carry, handoffs = d_final_carry, []  # d(carry) at the end of the segment in turn; sends still in flight
    for s in reversed(range(len(order))):
        owner, index, lo, hi = order[s]
        iterations = schedule.prefix_turn(s, ceil_div(hi - lo, chunk))  # None: not mirrored
        if hi == lo and iterations is None:
            continue
        later = [t for t in filled if t > s]
        earlier = [t for t in filled if t < s]
        servers = [j for j in range(cp.size) if j != owner and visible_prefix(pieces[j], lo) > 0] if hi > lo else []
        if cp.rank != owner:
            visible = visible_prefix(mine, lo)
            if iterations is not None:
                _mirror_turn(adapter, state, cp, owner, chunk, iterations, cp.rank in servers, backward,
                             prefix_recompute, visible, whole)
            elif cp.rank in servers:
                serve(cp, owner, adapter, state.pool, chunk, end=visible)
            continue
        if hi > lo and later and order[later[0]][0] != cp.rank:  # the next segment's owner hands d(carry) over
            d_carry = {layer: tuple(cp.recv(shape, dtype, order[later[0]][0], layer, "prefix_d_carry",
                                            device=adapter.device) for shape, dtype in parts)
                       for layer, parts in shapes.items()}
        turn = [b for b in state.boundaries if piece_index(mine, b.position) == index] if hi > lo else []
        assert iterations is None or len(turn) == iterations.real, "the capture's chunks are the segment's"
        if turn:
            # a "topk_lse" family's past is its turn's piece only; its own earlier pieces are reached like the
            # other ranks' rows (RemotePages' `earlier`)
            past_start = pieces.starts[index] if selects else 0
            own_earlier = (OwnRows(state.pool, adapter, mine[:index], grads_to_pages=True)
                           if selects and past_start else None)
            remote = RemotePages(cp, pieces, servers, adapter, start=lo, earlier=own_earlier)
            turn_pass = replace(reverse, remote_attention=remote if servers or own_earlier else None,
                                past_start=past_start, last_layer_whole=whole)
            d_carry = prefix_backward(turn_pass, d_carry, boundaries=turn)
            remote.close(adapter.device)
        for _ in iterations.dummies() if iterations is not None else ():  # the turn's dummy iterations
            zero_prefix_iteration(adapter, backward, prefix_recompute=prefix_recompute, need_hidden=whole)
        if turn and earlier and order[earlier[-1]][0] != cp.rank:  # hand d(carry at this piece's start) over
            handoffs += [cp.isend(_carry_part(d_carry.get(layer), part, shape, dtype, adapter.device),
                                  order[earlier[-1]][0])
                         for layer, parts in shapes.items() for part, (shape, dtype) in enumerate(parts)]
    for work in handoffs:
        work.wait()


def _carry_part(grads: Sequence[torch.Tensor] | None, part: int, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Part `part` of a layer's d(carry) as sent (zeros where the piece starts at the prompt start: no carry)."""
    return torch.zeros(shape, dtype=dtype, device=device) if grads is None else grads[part].to(dtype).contiguous()


def _mirror_turn(adapter: CausalLMAdapter, state: PrefixState, cp: CPContext, owner: int, chunk: int,
                 iterations: TurnIterations, serving: bool, backward: Callable[[torch.Tensor], Any] | None,
                 prefix_recompute: bool, visible: int, whole: bool) -> None:
    """`owner`'s turn seen from another rank under lockstep: one zero iteration per owner iteration; those that
    mirror the owner's real chunks answer its requests (against this rank's pages [0, visible)) when this rank
    serves it, then its DONE is read; then the turn's dummy iterations. whole: whether the owner runs its last
    layer whole (else its rows alone, and so do these)."""
    server = PageServer(cp, owner, adapter, state.pool, chunk, kept=state.kept_pool is not None,
                        visible=visible) if serving else None
    try:
        for _ in range(iterations.real):
            zero_prefix_iteration(adapter, backward, server, prefix_recompute, need_hidden=whole)
        if serving:  # the owner says DONE after its real chunks, before its padding
            server.answer(DONE, -1)
    finally:
        if server is not None:
            server.close()
    for _ in iterations.dummies():
        zero_prefix_iteration(adapter, backward, prefix_recompute=prefix_recompute, need_hidden=whole)
