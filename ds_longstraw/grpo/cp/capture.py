"""Capture of a prompt sharded over context-parallel ranks: layer-major, one exchange per layer.

Rank r owns pieces of prompt[:-1] (`groups.shard_pieces`: one contiguous shard, or under the zigzag layout segments
r and 2N-1-r of 2N), kept in prompt order as its local tokens. Layer l+1's input on rank r depends on layer l's
output there, and for a recurrent layer that output depends on every earlier segment's layer-l carry, so capture
walks the layers in order and, per layer, all ranks exchange what crosses the rank boundaries before anyone moves
on, as the layer's kind does it (grpo/cp/kinds/, found by the spec's `combine`):
  "affine_scan"  kinds/scan/: segment summaries all-gathered and folded in prompt order (the family's own math, the
                 adapter's recurrent_scan(layer); qwen3_5: arch/qwen3_5_scan.py);
  "lse"          this rank's rows go onto its own pages; queries meet the other ranks' earlier pages (kinds/attention/:
                 in turns for contiguous shards, all ranks at once in a ring for zigzag ones), or, with
                 cp_attention="ulysses", a head/sequence all-to-all (kinds/attention/ulysses.py);
  "topk_lse"     this rank's rows go onto its own pages; its queries' global top-k selection gathers the earlier
                 ranks' candidates and the selected rows' partials come back from their owners (kinds/sparse/); a
                 layer that selects nothing reuses the last selection.
The last layer runs for its state alone (LayerKind.capture_rows: its rows onto the pages, no exchange, no MLP), since
no token reads its output over the prompt (last_layer_rows_only; with the attention kept it runs whole).
Inside a layer the shard is processed `capture_chunk` tokens (exact mode: at most `prefix_block`) at a time;
what stays alive across a layer is the shard's hidden states [1, T_r, C] (smaller than the shard's pages of all
paged layers for the target models). Every rank keeps the pages of its own tokens only, the prompt's final carry
(the same, bit for bit, on every rank) and, in exact mode, the carries at its own chunk starts (with
prefix_keep_attention also its own tokens' merged attention output and LSE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.grpo.cp.kinds import CaptureFrame, kind_of, kinds_in
from ds_longstraw.grpo.lockstep import Schedule, ShardChunks
from ds_longstraw.grpo.state import (
    INPUT_STREAM,
    SELECTION_STREAM,
    ChunkBoundary,
    PrefixState,
    encode_selection,
    open_prefix_state,
    selection_bases,
)
from ds_longstraw.parallel.groups import local_spans

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.parallel.groups import CPContext


def cp_capture_prefix(adapter: CausalLMAdapter, prompt_ids: torch.Tensor, longstraw: LongstrawConfig, cp: CPContext,
                      prefix_grad: str = "detached", progress: Callable[[int], Any] | None = None,
                      schedule: Schedule | None = None, keep_inputs: bool = False) -> PrefixState:
    """Capture this rank's shard of prompt_ids[:-1] (every CP rank calls it with the same prompt).

    schedule: the transaction's (../lockstep.py; None: no padding), whose chunks(spans) every per-chunk loop of a
    layer walks: under ZeRO-3 a Lockstep adds dummy chunks (one zero token each, outputs discarded), so that every
    rank of the job, whatever its shard's chunk count, makes the same calls in the same order, with the
    context-parallel exchanges at the same places in between.
    keep_inputs: also keep the inputs over the shard of every longstraw.prefix_inputs_every-th layer (exact mode's
    layer-major prefix pass, prefix_layers.py)."""
    ids_all = prompt_ids[:-1]
    pieces = cp.pieces(ids_all.numel())
    mine = pieces.mine
    ids = pieces.local_tokens(ids_all)
    tokens = ids.numel()
    # The pages of this rank's shard live on the configured tier (device, host or NVMe files of this rank); with
    # prefix_keep_attention it keeps the MERGED attention of its tokens (every rank's keys), so the prefix pass
    # skips the attention and its remote exchanges in forward. (offset: where a contiguous shard starts.)
    state = open_prefix_state(adapter, longstraw, tokens, prefix_grad, cp.rank, length=ids_all.numel(),
                              offset=mine[0][0], chunks=len(local_spans(mine, longstraw.segment_tokens)),
                              keep_inputs=keep_inputs)
    try:
        spans = local_spans(mine, longstraw.segment_tokens)  # [(a, b, prompt position of a)]
        frame = CaptureFrame(
            adapter, longstraw, cp, pieces, chunks=(schedule or Schedule()).chunks(spans),  # then the dummy chunks
            state=state, largest=pieces.largest,
            boundaries=[ChunkBoundary(a, b, {}, position) for a, b, position in spans]
            if state.checkpoints is not None else None)
        _capture_layers(frame, ids, progress)
    except BaseException:
        state.release()  # page files of a host/NVMe tier go on error as on success
        raise
    return state


def _capture_layers(frame: CaptureFrame, ids: torch.Tensor, progress: Callable[[int], Any] | None) -> None:
    """Fill the frame's state (its pages, boundaries and final carry) layer by layer, each by its kind
    (grpo/cp/kinds/); ids: this rank's shard in local order."""
    adapter, longstraw, state = frame.adapter, frame.longstraw, frame.state
    for kind in kinds_in(adapter.specs):
        kind.begin_capture(frame)
    every = longstraw.prefix_inputs_every
    bases = ({layer: adapter.sparse_geometry(layer).topk for layer in selection_bases(adapter.specs, every)}
             if state.input_pool is not None else {})
    last = adapter.specs[-1].layer if last_layer_rows_only(state) else None
    with torch.no_grad():
        hidden = adapter.embed(ids)
        for spec in adapter.specs:
            index = spec.layer
            if state.input_pool is not None and index % every == 0:
                state.input_pool.append(index, INPUT_STREAM, hidden[0])
                if index in bases:  # the selection this base reuses, made in a group below
                    state.input_pool.append(index, SELECTION_STREAM, encode_selection(*frame.selection, bases[index]))
            normed = adapter.mixer_input(index, hidden)
            if index == last:  # its state only: no attention, exchange or MLP over the shard
                kind_of(spec).capture_rows(frame, spec, normed)
                if progress is not None:
                    progress(index)
                break
            mixed = kind_of(spec).capture(frame, spec, normed)
            del normed
            hidden = mlp_over_chunks(adapter, index, hidden + mixed, frame.chunks)
            del mixed
            if progress is not None:
                progress(index)
    state.flush()  # the last partial pages too: after capture every page is on its tier
    state.carry, state.boundaries = frame.final_carry, frame.boundaries or []


def last_layer_rows_only(state: PrefixState) -> bool:
    """Whether the capture runs the last layer for its state alone (LayerKind.capture_rows). No token reads a
    captured layer's output over the prompt: the prompt's last token is replayed with the members, later layers
    read pages and carries, and exact mode's prefix pass computes its own (the layer-major pass from the layers'
    kept inputs, the turns from the pages). Only the kept attention (prefix_keep_attention) stores the last
    layer's output for the prefix pass; with it the layer runs whole. Every rank decides alike (the same settings).
    One rank: capture_prefix's need_hidden=False (grpo/state.py) does the same for the whole segment."""
    return state.kept_pool is None


def mlp_over_chunks(adapter: CausalLMAdapter, layer: int, hidden_1TC: torch.Tensor,
                    chunks: ShardChunks) -> torch.Tensor:
    """hidden + mlp(post_norm(hidden)) of `layer` over a shard, chunk by chunk (the lockstep's dummy chunks' results
    discarded)."""
    outs = [adapter.mlp_residual(layer, chunk.of(hidden_1TC)) for chunk in chunks][:len(chunks.spans)]
    return torch.cat(outs, 1) if outs else hidden_1TC
