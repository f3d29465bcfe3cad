"""A recurrent ("affine_scan") layer of the layer-major CP capture: the exchange, pass, fold and finish of a scan.

The schedule half of the "affine_scan" combine (arch/specs.py): ds_longstraw.grpo.cp.capture calls capture_scan_layer
per such layer with the family's math for it, the adapter's recurrent_scan(layer) (grpo/interfaces.RecurrentScan;
qwen3_5: arch/qwen3_5_scan.py, which derives it), and the CP group's exchanges (cp.all_gather) as its only view of
the other ranks.

What the math gives: a segment run from zero initial state ends in a summary, an affine map of its initial state;
summaries compose, so a segment's true initial state is the fold of every earlier segment's summary in order (an
exclusive scan) and the fold of all of them is the prompt's final state, which replay needs. The summaries are
all-gathered (N small tensors per layer) and every rank folds them itself, in the same order, so every rank holds
the same final state bit for bit. A segment's outputs, computed before its initial state S_0 is known, are
[o(0) | q~] and become o(0) + q~ S_0 once the exchange has given S_0: a rank runs the recurrence ONCE over its shard,
from the identity summary, keeping those outputs until the exchange, then corrects them and finishes the layer. A
segment at the prompt start needs no correction (S_0 = 0): it runs the plain recurrence and finishes at once.
Conv tails cross ranks too: a segment's incoming tail folds the tail contributions (the last k-1 projected tokens,
fewer for a shorter segment) of every earlier segment.

Segments: a rank owns one or more pieces of the prompt (parallel/groups.py, shard_pieces: contiguous or zigzag);
every piece is a segment of the scan, and the scan folds all ranks' segments in PROMPT order.

Capture schedule per recurrent layer (layer-major, see ds_longstraw.grpo.cp.capture):
(1) all-gather the pieces' tail contributions -> each piece's incoming tail;
(2) one pass over this rank's chunks: projections, convolution, the recurrence from the identity summary (the plain
    recurrence for a piece at the prompt start: its outputs), keeping [o(0) | q~] per chunk (exact mode: the
    summary at each chunk start);
(3) all-gather the pieces' summaries; fold in prompt order -> each piece's initial state and the final state;
(4) per chunk: o = o(0) + q~ S_0, the output gate (projected here from the layer input, which the layer-major
    capture keeps anyway, rather than held), gated norm and out projection (exact mode: each chunk start's carry
    P_c S_0 + B_c checkpointed).
"cp_scan": "two_pass" keeps nothing across the exchange instead and runs (4) as the layer's own forward from the
true initial state (the projections and the plain recurrence again).
Under ZeRO-3 every per-chunk loop is followed by the schedule's dummy chunks (one zero token each, the calls of a
real chunk, results discarded: grpo/lockstep.ShardChunks), so that every rank makes the same module calls in the
same order with the exchanges at the same places in between.
Memory: what waits for the exchange is the recurrence's outputs over the shard, in the model's dtype: [T, Hv, dv + dk]
for pieces that do not start the prompt, [T, Hv, dv] for the one that does (the adapter's scan_output_bytes; the
planner's "gdn_scan_outputs").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ds_longstraw.offload.auto import holds_scan
from ds_longstraw.parallel.groups import piece_index

if TYPE_CHECKING:
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.cp.kinds.base import CaptureFrame
    from ds_longstraw.grpo.interfaces import RecurrentScan
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.grpo.state import CarryCheckpoints, ChunkBoundary, PooledCarryCheckpoints



def holds_scan_outputs(longstraw: LongstrawConfig, held_bytes: int, device: torch.device,
                       device_total: int | None = None) -> bool:
    """Whether the GDN capture holds its outputs across the exchange ("one_pass") for a shard whose outputs take
    `held_bytes`: offload/auto.holds_scan (the planner's rule) against the device's total memory (CUDA; read from
    the device when device_total is None; off CUDA nothing bounds them)."""
    if longstraw.cp_scan == "auto" and device.type == "cuda" and device_total is None:
        device_total = torch.cuda.get_device_properties(device).total_memory
    return holds_scan(longstraw.cp_scan, held_bytes, device_total if device.type == "cuda" else None)


def capture_scan_layer(frame: CaptureFrame, layer: int,
                       normed_1TC: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor]]:
    """One recurrent layer of the layer-major capture on this rank's shard (no autograd).

    The family's math for layer `layer` is the adapter's recurrent_scan(layer); normed_1TC: the layer's mixer
    input over the shard. frame.hold: keep the first pass's outputs and correct them after the exchange
    ("cp_scan": "one_pass"), or keep nothing and run the layer again from the true initial state ("two_pass": the
    projections and the plain recurrence a second time, for the memory of [o(0) | q~] over the shard).

    Returns (output [1, T, C], (final state, final conv tail) of the whole prompt). frame.boundaries: None, or the
    exact-mode ChunkBoundary list of this rank, whose carries get this layer's (state, tail) at each chunk start,
    kept in the state's checkpoints (ds_longstraw.grpo.state's checkpoint store). frame.chunks: the real ones
    (`spans`, this rank's chunks [(a, b, position)] in local order, groups.local_spans), then a one-token dummy
    call for each of its dummies() after each per-chunk loop (ZeRO-3 lockstep; see grpo/cp/capture.py); where it
    pads (`padded`), an empty piece also makes a dummy call in place of its conv-tail projection.
    """
    scan, chunks, cp, pieces = frame.adapter.recurrent_scan(layer), frame.chunks, frame.cp, frame.pieces
    boundaries, checkpoints, hold = frame.boundaries, frame.state.checkpoints, frame.hold
    width = scan.width
    mine, order, starts = pieces.mine, pieces.order, pieces.starts
    spans = chunks.spans
    owners = [piece_index(mine, position) for _, _, position in spans]  # each chunk's piece
    dummy = normed_1TC.new_zeros(1, 1, normed_1TC.shape[-1])

    # (1) conv tails across segment boundaries
    parts = []
    for (lo, hi), a in zip(mine, starts[:-1], strict=True):
        count = min(hi - lo, width)
        part = normed_1TC.new_zeros(1, scan.tail_channels, width)
        if count:
            b = a + hi - lo
            part[:, :, width - count:] = scan.tail_projection(normed_1TC[:, b - count:b])
        elif chunks.padded:
            scan.tail_projection(dummy)
        parts.append(part)
    gathered = cp.all_gather(_stacked(parts), layer, "gdn_tail")
    tail_parts = [gathered[rank][index] for rank, index, _, _ in order]
    counts = [min(hi - lo, width) for _, _, lo, hi in order]
    tails_in = [scan.fold_tails(tail_parts[:_before(order, lo)], counts[:_before(order, lo)]) if lo > 0 else None
                for lo, _ in mine]
    tail_final = scan.fold_tails(tail_parts, counts)

    # (2) one pass over the chunks: the plain recurrence for a piece at the prompt start, else from the identity
    summaries = [scan.identity_summary(normed_1TC.device) for _ in mine]
    plain = [lo == 0 and hi > lo for lo, hi in mine]
    states = [None] * len(mine)  # the plain pieces' running state
    tails = list(tails_in)
    held, chunk_starts = [], []  # per chunk: the recurrence's output; (summary or state, tail) at its start
    for (a, b, _), k in zip(spans, owners, strict=True):
        chunk_starts.append((states[k] if plain[k] else summaries[k], tails[k]))
        inputs, tails[k] = scan.inputs(normed_1TC[:, a:b], tails[k])
        if plain[k]:
            out, states[k] = scan.advance(inputs, states[k])
        else:
            out, summaries[k] = scan.extend(summaries[k], inputs)
        held.append(out if hold else None)
        del out, inputs
    for _ in chunks.dummies():
        scan.inputs(dummy, None)
    cp.note_held("gdn_scan_outputs", sum(out.numel() * out.element_size() for out in held if out is not None))
    for k, state in enumerate(states):
        if plain[k]:  # the prompt's first segment: its summary ends in its end state
            summaries[k] = scan.with_end_state(summaries[k], state)

    # (3) the exchange: every piece's initial state and the prompt's final state, folded in prompt order
    gathered = cp.all_gather(_stacked(summaries), layer, "gdn_summary")
    folded = [gathered[rank][index] for rank, index, _, _ in order]
    sizes = [hi - lo for _, _, lo, hi in order]
    initial = [scan.fold_states(folded[:_before(order, lo)], sizes[:_before(order, lo)]) if lo > 0 else None
               for lo, _ in mine]
    final_state = scan.fold_states(folded, sizes)

    if not hold:
        return _second_pass(scan, normed_1TC, chunks, owners, initial, tails_in, boundaries, checkpoints, layer,
                            dummy), (final_state, tail_final)

    # (4) the outputs' initial-state term, then the layer's output chunk by chunk
    outs = []
    # (every rank makes the same module calls in the same order: the gate and the finish of every chunk here)
    for index, ((a, b, _), k, out, (start, tail)) in enumerate(zip(spans, owners, held, chunk_starts, strict=True)):
        if not plain[k]:
            start = scan.apply_summary(start, initial[k]) if initial[k] is not None else None
            out = scan.corrected(out, initial[k])
        if boundaries is not None and start is not None:
            boundaries[index].carry[layer] = checkpoints.save_layer(index, layer, (start, tail))
        outs.append(scan.finish(normed_1TC[:, a:b], out))
    for _ in chunks.dummies():
        scan.finish(dummy, dummy.new_zeros(1, 1, scan.heads, scan.value_dim))
    output = torch.cat(outs, 1) if outs else torch.zeros_like(normed_1TC)
    return output, (final_state, tail_final)


def _second_pass(scan: RecurrentScan, normed_1TC: torch.Tensor, chunks: ShardChunks, owners: Sequence[int],
                 initial: Sequence[torch.Tensor | None], tails_in: Sequence[torch.Tensor | None],
                 boundaries: list[ChunkBoundary] | None,
                 checkpoints: CarryCheckpoints | PooledCarryCheckpoints | None, layer: int,
                 dummy: torch.Tensor) -> torch.Tensor:
    """"two_pass": the layer chunk by chunk from each piece's true initial state and tail (the single-process code
    path), checkpointing each chunk start's carry (exact mode). owners: each chunk's piece."""
    states, tails, outs = list(initial), list(tails_in), []
    for index, ((a, b, _), k) in enumerate(zip(chunks.spans, owners, strict=True)):
        if boundaries is not None and states[k] is not None:
            boundaries[index].carry[layer] = checkpoints.save_layer(index, layer, (states[k], tails[k]))
        out, states[k], tails[k] = scan.forward(normed_1TC[:, a:b], states[k], tails[k])
        outs.append(out)
    for _ in chunks.dummies():
        scan.forward(dummy, None, None)
    return torch.cat(outs, 1) if outs else torch.zeros_like(normed_1TC)


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).contiguous()


def _before(order: Sequence[tuple[int, int, int, int]], lo: int) -> int:
    """How many segments (in prompt order) end at or before prompt position lo."""
    return sum(1 for _, _, _, hi in order if hi <= lo)
