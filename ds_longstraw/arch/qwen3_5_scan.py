"""qwen3_5's Gated DeltaNet across context-parallel ranks: segment transitions, an exclusive combine, conv tails.

The family-specific half of the "affine_scan" combine (arch/specs.py): the context-parallel capture
(ds_longstraw.grpo.cp.capture) calls the adapter's capture_scan_layer, which lands here with the CP group's
exchanges (cp.all_gather) as its only view of the other ranks.

Legend: Hv value heads, dk/dv key/value head dims; state S [1, Hv, dk, dv]; a transition summary [1, Hv, dk, dv + dk]
holds [B | P]; conv tail [1, conv_dim, k-1] (the last k-1 tokens of the pre-convolution projection).

Derivation. The delta rule per token (kernels/gated_delta/reference.py) is
    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T
that is  S_t = A_t S_{t-1} + beta_t k_t v_t^T  with  A_t = exp(g_t) (I - beta_t k_t k_t^T)  (dk x dk per head).
Over a segment of T tokens, S_end = P S_0 + B with P = A_T ... A_1 and B = S_end(S_0 = 0): the end state is affine
in the initial state. (In the row-vector convention of the issue, S_end^T = S_0^T M + B^T with M = P^T.)
Every column of S evolves under the same A_t, so one run of the delta rule with the augmented value [v_t | 0_dk]
from the initial state [0 | I] ends in [B | P]. Segment 1 then segment 2 compose as
    (P, B) = (P2 P1, P2 B1 + B2),
so rank r's true initial state is the fold of ranks 0..r-1's summaries in order (an exclusive scan); the fold of
all ranks' summaries is the prompt's final state, which replay needs. The summaries are all-gathered (N small
tensors per GDN layer) and every rank folds them itself, in the same order, so every rank holds the same final
state bit for bit. `tests/unit/test_cp_units.py` checks the affine form and the fold against the plain recurrence.

Output with an unknown initial state, in the same pass. The delta rule is linear in (S_0, v) together, so a
token's output is o_t = o_t(S_0 = 0) + q~_t S_0, where q~_t [dk] (the query as it reads the segment's initial state
through every update since) does not depend on S_0. The same augmented run gives both: its output's first dv
columns are o_t(0) and its last dk columns are q~_t (the state's P columns read by the query). So a rank runs the
delta rule ONCE over its shard, from [0 | I], keeping the outputs' [o(0) | q~] until the exchange has given it S_0,
then adds q~ S_0 (one [T, dk] x [dk, dv] product per head) and finishes the layer. A segment at the prompt start
needs no correction (S_0 = 0): it runs the plain rule and finishes at once.

Conv tails cross ranks too: each segment contributes the last min(T_s, k-1) tokens of its pre-conv projection; a
segment's incoming tail is the last k-1 tokens of zeros(k-1) ++ contributions of every earlier segment (segments
shorter than k-1 make the tail span several of them).

Segments: a rank owns one or more pieces of the prompt (parallel/groups.py, shard_pieces: contiguous or zigzag);
every piece is a segment of the scan, and the scan folds all ranks' segments in PROMPT order.

Capture schedule per GDN layer (layer-major, see ds_longstraw/grpo/cp/capture.py):
(1) all-gather the pieces' tail contributions -> each piece's incoming tail;
(2) one pass over this rank's chunks: projections, convolution, the delta rule from [0 | I] (the plain rule for a
    piece at the prompt start: its outputs), keeping [o(0) | q~] per chunk (exact mode: the summary at each
    chunk start);
(3) all-gather the pieces' summaries; fold in prompt order -> each piece's initial state and the final state;
(4) per chunk: o = o(0) + q~ S_0, the output gate z (projected here from the layer input, which the layer-major
    capture keeps anyway, rather than held), gated norm and out projection (exact mode: each chunk start's carry
    P_c S_0 + B_c checkpointed).
"cp_scan": "two_pass" keeps nothing across the exchange instead and runs (4) as the layer's own forward from the
true initial state (the projections and the plain rule again).
Memory: what waits for the exchange is the delta rule's outputs over the shard, in the model's dtype: [T, Hv, dv + dk]
for pieces that do not start the prompt, [T, Hv, dv] for the one that does (`held_bytes`; the planner's
"gdn_scan_outputs").
"""

from contextlib import contextmanager

import torch

from ds_longstraw.kernels import chunk_gated_delta_rule
from ds_longstraw.parallel.groups import local_starts, piece_index, segments_in_order


@contextmanager
def forward_replaced(module, fn):
    """Call `module(...)` with `fn` as its forward, so that module hooks (ZeRO-3's parameter gathering) still run
    for parameters the module owns directly (GDN's A_log and dt_bias are read outside any submodule)."""
    module.forward = fn
    try:
        yield
    finally:
        del module.forward


def _call_module(module, fn):
    """Run fn() as module's forward, so module hooks (ZeRO-3 parameter gathering) fire for its own parameters."""
    result = {}

    def forward(*_):
        result["value"] = fn()
        return None

    with forward_replaced(module, forward):
        module()
    return result["value"]


def identity_summary(heads, dk, dv, dtype, device):
    """[B | P] of an empty segment: B = 0, P = I."""
    eye = torch.eye(dk, dtype=dtype, device=device).expand(1, heads, dk, dk)
    return torch.cat([torch.zeros(1, heads, dk, dv, dtype=dtype, device=device), eye], dim=-1).contiguous()


def extend_summary(summary, query, key, value, g, beta):
    """Extend a segment's [B | P] summary by the tokens (query, key, value, g, beta) (delta-rule layouts)."""
    return extend_with_outputs(summary, query, key, value, g, beta)[1]


def extend_with_outputs(summary, query, key, value, g, beta):
    """The augmented rule over tokens from `summary` [B | P]: (outputs [1, T, Hv, dv + dk] = [o(0) | q~ P], the
    summary after them)."""
    dk = key.shape[-1]
    augmented = torch.cat([value, value.new_zeros(value.shape[:-1] + (dk,))], dim=-1)
    return chunk_gated_delta_rule(query, key, augmented, g=g, beta=beta, initial_state=summary,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)


def apply_summary(summary, state, dv):
    """The state after a segment with summary [B | P] that starts from `state` (None: zeros)."""
    bias, product = summary[..., :dv], summary[..., dv:]
    return bias if state is None else product @ state.to(product.dtype) + bias


def fold_states(summaries, sizes, dv):
    """Fold segment summaries in order (empty segments skipped); None when every segment is empty."""
    state = None
    for summary, size in zip(summaries, sizes, strict=True):
        if size:
            state = apply_summary(summary, state, dv)
    return state


def fold_tails(parts, counts, width):
    """The conv tail after segments whose last counts[j] pre-conv tokens are right-aligned in parts[j]."""
    tail = torch.zeros_like(parts[0])
    for part, count in zip(parts, counts, strict=True):
        if count:
            tail = torch.cat([tail, part[:, :, width - count:]], dim=-1)[:, :, -width:]
    return tail


def _stacked(tensors):
    return torch.stack(tensors).contiguous()


def capture_gdn_layer(adapter, module, normed_1TC, chunks, cp, pieces, boundaries, layer, checkpoints=None,
                      hold=True):
    """One GDN layer of the layer-major capture on this rank's shard (no autograd).

    hold: keep the first pass's outputs and correct them after the exchange ("cp_scan": "one_pass"), or keep
    nothing and run the layer again from the true initial state ("two_pass": the projections and the plain rule a
    second time, for the memory of [o(0) | q~] over the shard).

    spans: this rank's chunks [(a, b, position)] in local order (groups.local_spans); pieces: every rank's pieces
    (groups.shard_pieces). Returns (output [1, T, C], (final state, final conv tail) of the whole prompt).
    boundaries: None, or the exact-mode ChunkBoundary list of this rank, whose carries get this layer's
    (state, tail) at each chunk start, kept in `checkpoints` (ds_longstraw.grpo.state's checkpoint store).
    chunks: the schedule's chunks (grpo/lockstep.ShardChunks): the real ones (`spans`), then a one-token dummy call
    for each of its dummies() after each per-chunk loop (ZeRO-3 lockstep; see grpo/cp/capture.py); where it pads
    (`padded`), an empty piece also makes a dummy call in place of its conv-tail projection.
    """
    width = module.conv_kernel_size - 1
    heads, dk, dv = module.num_v_heads, module.head_k_dim, module.head_v_dim
    mine, order = pieces[cp.rank], segments_in_order(pieces)
    starts = local_starts(mine)
    spans = chunks.spans
    owners = [piece_index(mine, position) for _, _, position in spans]  # each chunk's piece
    dummy = normed_1TC.new_zeros(1, 1, normed_1TC.shape[-1])

    # (1) conv tails across segment boundaries
    parts = []
    for (lo, hi), a in zip(mine, starts[:-1], strict=True):
        count = min(hi - lo, width)
        part = normed_1TC.new_zeros(1, module.conv_dim, width)
        if count:
            b = a + hi - lo
            part[:, :, width - count:] = module.in_proj_qkv(normed_1TC[:, b - count:b]).transpose(1, 2)
        elif chunks.padded:
            module.in_proj_qkv(dummy)
        parts.append(part)
    gathered = cp.all_gather(_stacked(parts), layer, "gdn_tail")
    tail_parts = [gathered[rank][index] for rank, index, _, _ in order]
    counts = [min(hi - lo, width) for _, _, lo, hi in order]
    tails_in = [fold_tails(tail_parts[:_before(order, lo)], counts[:_before(order, lo)], width) if lo > 0 else None
                for lo, _ in mine]
    tail_final = fold_tails(tail_parts, counts, width)

    # (2) one pass over the chunks: the plain rule for a piece at the prompt start, else from [0 | I]
    summaries = [identity_summary(heads, dk, dv, adapter.state_dtype(), normed_1TC.device) for _ in mine]
    plain = [lo == 0 and hi > lo for lo, hi in mine]
    states = [None] * len(mine)  # the plain pieces' running state
    tails = list(tails_in)
    held, chunk_starts = [], []  # per chunk: the delta rule's output; (summary or state, tail) at its start
    for (a, b, _), k in zip(spans, owners, strict=True):
        chunk_starts.append((states[k] if plain[k] else summaries[k], tails[k]))

        def inputs(a=a, b=b, tail=tails[k]):
            return adapter.gdn_inputs(module, normed_1TC[:, a:b], tail, with_gate=False)

        query, key, value, g, beta, _, tails[k] = _call_module(module, inputs)
        if plain[k]:
            out, states[k] = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=states[k],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:
            out, summaries[k] = extend_with_outputs(summaries[k], query, key, value, g, beta)
        held.append(out if hold else None)
        del out
    for _ in chunks.dummies():
        _call_module(module, lambda: adapter.gdn_inputs(module, dummy, None, with_gate=False))
    cp.note_held("gdn_scan_outputs", sum(out.numel() * out.element_size() for out in held if out is not None))
    for k, state in enumerate(states):
        if plain[k]:  # the prompt's first segment: its summary's B is its end state (its P is never read)
            summaries[k] = torch.cat([state.to(summaries[k].dtype), summaries[k][..., dv:]], dim=-1)

    # (3) the exchange: every piece's initial state and the prompt's final state, folded in prompt order
    gathered = cp.all_gather(_stacked(summaries), layer, "gdn_summary")
    folded = [gathered[rank][index] for rank, index, _, _ in order]
    sizes = [hi - lo for _, _, lo, hi in order]
    initial = [fold_states(folded[:_before(order, lo)], sizes[:_before(order, lo)], dv) if lo > 0 else None
               for lo, _ in mine]
    final_state = fold_states(folded, sizes, dv)

    if not hold:
        return _second_pass(adapter, module, normed_1TC, chunks, owners, initial, tails_in, boundaries, checkpoints,
                            layer, dummy), (final_state, tail_final)

    # (4) the outputs' initial-state term, then the layer's output chunk by chunk
    outs = []
    # (every rank makes the same module calls in the same order: the gate and the finish of every chunk here)
    for index, ((a, b, _), k, out, (start, tail)) in enumerate(zip(spans, owners, held, chunk_starts, strict=True)):
        if not plain[k]:
            start = apply_summary(start, initial[k], dv) if initial[k] is not None else None
            out = _corrected(out, initial[k], dv)
        z = adapter.gdn_gate(module, normed_1TC[:, a:b])
        if boundaries is not None and start is not None:
            boundaries[index].carry[layer] = checkpoints.save_layer(index, layer, (start, tail))
        outs.append(adapter.gdn_finish(module, out, z))
    for _ in chunks.dummies():
        adapter.gdn_finish(module, dummy.new_zeros(1, 1, heads, dv), adapter.gdn_gate(module, dummy))
    output = torch.cat(outs, 1) if outs else torch.zeros_like(normed_1TC)
    return output, (final_state, tail_final)


def _second_pass(adapter, module, normed_1TC, chunks, owners, initial, tails_in, boundaries, checkpoints, layer, dummy):
    """"two_pass": the layer chunk by chunk from each piece's true initial state and tail (the single-process code
    path), checkpointing each chunk start's carry (exact mode). owners: each chunk's piece."""
    states, tails, outs = list(initial), list(tails_in), []
    for index, ((a, b, _), k) in enumerate(zip(chunks.spans, owners, strict=True)):
        if boundaries is not None and states[k] is not None:
            boundaries[index].carry[layer] = checkpoints.save_layer(index, layer, (states[k], tails[k]))
        out, states[k], tails[k] = adapter.gdn_forward(module, normed_1TC[:, a:b], states[k], tails[k])
        outs.append(out)
    for _ in chunks.dummies():
        adapter.gdn_forward(module, dummy, None, None)
    return torch.cat(outs, 1) if outs else torch.zeros_like(normed_1TC)


def _before(order, lo):
    """How many segments (in prompt order) end at or before prompt position lo."""
    return sum(1 for _, _, _, hi in order if hi <= lo)


def _corrected(out_aug, initial, dv):
    """o = o(0) + q~ S_0 from the augmented outputs (S_0 None: zeros)."""
    zero_state = out_aug[..., :dv]
    if initial is None:
        return zero_state
    term = torch.einsum("bthk,bhkv->bthv", out_aug[..., dv:].to(initial.dtype), initial)
    return (zero_state.to(term.dtype) + term).to(out_aug.dtype)
