"""A recurrent ("affine_scan") layer of the layer-major exact prefix pass: every context-parallel rank's backward at
once.

The schedule half of the "affine_scan" combine in ds_longstraw.grpo.cp.prefix_layers (the capture's half is
scan.py); the family's math is the adapter's recurrent_scan(layer) (grpo/interfaces.RecurrentScanGrad; qwen3_5:
arch/qwen3_5_scan_backward.py, which says why the backward's state and tail gradients are affine across segments).
The pass walks the layers top to bottom on all ranks together; at this layer each rank holds d(layer output) for
its own tokens and the layer's input over its shard (saved at capture), and must produce d(layer input), the
parameter gradients of its tokens, and nothing else across ranks but two small exchanges:
  state  each rank summarises its pieces' state adjoints [L | A] (d(start state) = A D + L in the gradient D of
         the piece's end state), the summaries are all-gathered, and every rank folds them from the prompt's end
         (D of the last segment: replay's gradient of the prompt's final state) to get its pieces' true D. Each
         piece then runs its own backward from its D, chunk by chunk, last chunk first.
  tail   the pieces' backwards run with zero d(end tail); afterwards the d(start tail) of every piece is
         all-gathered, every rank folds them from the prompt's end (replay's gradient of the final tail first) and
         back-propagates its pieces' share through the last tokens' projection.
Per rank that is about its share of the layer's backward: the layer's forward recomputed twice (the output side
once, the input side with the recurrence once) plus the summary's recurrence over [dS | X], (dv + dk) / dv of
the backward's own state loop.

Steps per recurrent layer (the schedule's dummy chunks after each per-chunk loop: ZeRO-3 lockstep, as the capture
makes):
(0, 1) per chunk: the recurrence's inputs and output from its checkpointed carry without a graph; then with
    autograd y = mlp_residual(x + finish(o, z)) with o and z as leaves: d(o), d(z), a d(x) part; and the chunk's
    (L, A), composed into its piece's, so that no input of the recurrence outlives its chunk;
(2) all-gather the pieces' (L, A); fold from the prompt's end -> each piece's D;
(3) per piece, chunks last first, with autograd from the chunk's checkpointed carry (leaves): the recurrence's
    roots (o, z, end state, end tail) get (d(o), d(z), D or the next chunk's d(start state), the next chunk's
    d(start tail)); a d(x) part;
(4) all-gather the pieces' d(start tail); fold; each piece's last tokens' projection gets its share; a d(x) part.
Held across the layer: d(o) and d(z) over the shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_longstraw.parallel.groups import piece_index

if TYPE_CHECKING:
    from ds_longstraw.grpo.cp.kinds.base import LayerMajorFrame
    from ds_longstraw.grpo.interfaces import RecurrentScan
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.grpo.state import ChunkBoundary, PrefixState


def prefix_scan_layer(frame: LayerMajorFrame, layer: int, read_input: Callable[[int, int], torch.Tensor],
                      dy_1TC: torch.Tensor) -> torch.Tensor:
    """d(layer input) [1, T, C] of recurrent layer `layer` over this rank's shard (see the module docstring);
    parameter gradients accumulate. The family's math for the layer is the adapter's recurrent_scan(layer);
    read_input(a, b): the layer's input [1, b - a, C] of local tokens [a, b) (capture's); dy_1TC: d(layer output);
    frame.chunks: `spans`, this rank's chunks [(a, b, position)] in local order, one per state.boundaries entry,
    then dummies() after each per-chunk loop; frame.d_final_carry[layer]: replay's (d state, d tail) of the
    prompt's final carry of this layer, where it has one."""
    scan, state, chunks, cp = frame.adapter.recurrent_scan(layer), frame.state, frame.chunks, frame.cp
    pieces, d_final, backward = frame.pieces, frame.d_final_carry.get(layer), frame.backward
    spans = chunks.spans
    width = scan.width
    mine, order, starts = pieces.mine, pieces.order, pieces.starts
    owners = [piece_index(mine, position) for _, _, position in spans]  # each chunk's piece
    acc = scan.state_dtype
    device = dy_1TC.device
    zero = torch.zeros(1, 1, dy_1TC.shape[-1], dtype=scan.dtype, device=device)
    d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=device)
    carries = [_carry(state, boundary, layer) for boundary in state.boundaries]

    # (0, 1) per chunk: the recurrence's inputs and output without a graph, then the output side with autograd:
    # d(o), d(z), the residual's and MLP's d(x); (2, first half) the chunk's state adjoint summary [L | A], composed
    # into its piece's (d start = A_1 (A_2 D + L_2) + L_1), so no input of the recurrence outlives its chunk
    d_outs, d_gates = [], []
    summaries = [scan.identity_summary(device) for _ in mine]
    for (a, b, _), (start_state, start_tail), k in zip(spans, carries, owners, strict=True):
        x = read_input(a, b)
        rule, out, z = scan.prepare(x, start_state, start_tail)
        d_out, d_gate, d_part = scan.output_side(x, out, z, dy_1TC[:, a:b], backward)
        d_outs.append(d_out)
        d_gates.append(d_gate)
        d_x[:, a:b] += d_part
        if mine[k][0] > 0:  # the prompt's first segment: nothing before it reads its D
            summaries[k] = scan.extend_adjoint(summaries[k], rule, d_out)
        del rule, out, z
    for _ in chunks.dummies():  # the calls of a real chunk, in its order
        _, out, z = scan.prepare(zero, None, None)
        scan.output_side(zero, out, z, zero, backward)

    # (2, second half) the fold from the prompt's end gives each piece its D
    gathered = cp.all_gather(torch.stack(summaries).contiguous(), layer, "gdn_adjoint_summary")
    d_end = torch.zeros(1, scan.heads, scan.key_dim, scan.value_dim, dtype=acc, device=device)
    if d_final is not None and d_final[0] is not None:
        d_end = d_final[0].to(acc).clone()
    d_ends = {}  # (rank, piece) -> D
    for rank, index, lo, hi in reversed(order):
        d_ends[(rank, index)] = d_end
        if hi > lo:
            d_end = scan.apply_summary(gathered[rank][index], d_end)

    # (3) each piece's backward from its D, last chunk first; d(start tail) of each piece kept for (4)
    d_tail_starts = []
    for k in range(len(mine)):
        d_state, d_tail = d_ends[(cp.rank, k)], None
        for j in reversed([j for j, owner in enumerate(owners) if owner == k]):
            a, b, _ = spans[j]
            d_part, d_state, d_tail = scan.input_side(read_input(a, b), carries[j],
                                                      (d_outs[j], d_gates[j], d_state, d_tail), backward)
            d_x[:, a:b] += d_part
        d_tail_starts.append(torch.zeros(1, scan.tail_channels, width, dtype=scan.dtype, device=device)
                             if d_tail is None else d_tail.to(scan.dtype))
    for _ in chunks.dummies():
        scan.input_side(zero, (None, None), None, backward)

    # (4) the conv tails: fold the pieces' d(start tail) from the prompt's end; each piece's share of it goes
    # through its last tokens' pre-convolution projection
    gathered = cp.all_gather(torch.stack(d_tail_starts).contiguous(), layer, "gdn_tail_grad")
    t_end = torch.zeros_like(d_tail_starts[0])
    if d_final is not None and d_final[1] is not None:
        t_end = d_final[1].to(t_end.dtype).clone()
    shares = {}  # (rank, piece) -> d(the piece's end tail)
    for rank, index, lo, hi in reversed(order):
        shares[(rank, index)] = t_end
        t_end = gathered[rank][index] + scan.tail_grad_before(t_end, hi - lo)
    for k, (lo, hi) in enumerate(mine):
        count = min(hi - lo, width)
        end = starts[k] + hi - lo
        if count == 0:
            scan.tail_projection_grad(zero, zero.new_zeros(1, scan.tail_channels, 1), backward)
            continue
        d_part = scan.tail_projection_grad(read_input(end - count, end), shares[(cp.rank, k)][..., width - count:],
                                           backward)
        d_x[:, end - count:end] += d_part
    return d_x


def scan_layer_forward(scan: RecurrentScan, layer: int, normed_1TC: torch.Tensor, chunks: ShardChunks,
                       state: PrefixState) -> list[torch.Tensor]:
    """The layer's mixer output of each chunk [a, b) of the shard (no graph), from the chunk's checkpointed carry:
    the rank's own work alone, no exchange (the carries at every chunk start were kept by capture)."""
    outs = []
    with torch.no_grad():
        for (a, b, _), boundary in zip(chunks.spans, state.boundaries, strict=True):
            start_state, start_tail = _carry(state, boundary, layer)
            outs.append(scan.forward(normed_1TC[:, a:b], start_state, start_tail)[0])
        zero = normed_1TC.new_zeros(1, 1, normed_1TC.shape[-1])
        for _ in chunks.dummies():
            scan.forward(zero, None, None)
    return outs


def _carry(state: PrefixState, boundary: ChunkBoundary,
           layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(state, tail) of `layer` checkpointed at the chunk's start ((None, None) at the prompt start)."""
    got = state.begin_carry(boundary, {layer}).result().get(layer)
    return (None, None) if got is None else got
