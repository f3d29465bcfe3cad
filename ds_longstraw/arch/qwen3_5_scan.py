"""qwen3_5's Gated DeltaNet across context-parallel ranks: segment transitions, an exclusive combine, conv tails.

The family-specific half of the "affine_scan" combine (arch/specs.py): the context-parallel capture
(ds_longstraw.parallel.capture) calls the adapter's capture_scan_layer, which lands here with the CP group's
exchanges (cp.all_gather) as its only view of the other ranks.

Legend: Hv value heads, dk/dv key/value head dims; state S [1, Hv, dk, dv]; a transition summary [1, Hv, dk, dv + dk]
holds [B | P]; conv tail [1, conv_dim, k-1] (the last k-1 tokens of the pre-convolution projection).

Derivation. The delta rule per token (kernels/gated_delta.py) is
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
state bit for bit. `tests/test_cp_units.py` checks the affine form and the fold against the plain recurrence.

Conv tails cross ranks too: each rank contributes the last min(T_r, k-1) tokens of its pre-conv projection; rank r's
incoming tail is the last k-1 tokens of zeros(k-1) ++ contributions of ranks 0..r-1 (shards shorter than k-1 make
the tail span several ranks).

Capture schedule per GDN layer (layer-major, see ds_longstraw/parallel/capture.py):
(1) all-gather tail contributions -> incoming tail;
(2) pass 1 over this rank's chunks from zero state -> [B | P]; all-gather; fold -> initial and final state;
(3) pass 2 over the chunks with the true initial state through the adapter's own GDN forward (the single-process
code path), which gives the layer's outputs and the exact-mode chunk checkpoints. Pass 1 recomputes the
projections rather than keeping them: memory stays one chunk.
"""

from contextlib import contextmanager

import torch

from ds_longstraw.kernels import chunk_gated_delta_rule


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
    dk = key.shape[-1]
    augmented = torch.cat([value, value.new_zeros(value.shape[:-1] + (dk,))], dim=-1)
    _, summary = chunk_gated_delta_rule(query, key, augmented, g=g, beta=beta, initial_state=summary,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return summary


def apply_summary(summary, state, dv):
    """The state after a segment with summary [B | P] that starts from `state` (None: zeros)."""
    bias, product = summary[..., :dv], summary[..., dv:]
    return bias if state is None else product @ state.to(product.dtype) + bias


def fold_states(summaries, sizes, dv):
    """Fold segment summaries in order (empty segments skipped); None when every segment is empty."""
    state = None
    for summary, size in zip(summaries, sizes):
        if size:
            state = apply_summary(summary, state, dv)
    return state


def fold_tails(parts, counts, width):
    """The conv tail after segments whose last counts[j] pre-conv tokens are right-aligned in parts[j]."""
    tail = torch.zeros_like(parts[0])
    for part, count in zip(parts, counts):
        if count:
            tail = torch.cat([tail, part[:, :, width - count:]], dim=-1)[:, :, -width:]
    return tail


def capture_gdn_layer(adapter, module, normed_1TC, spans, cp, bounds, boundaries, layer, pad=0, checkpoints=None):
    """One GDN layer of the layer-major capture on this rank's shard (no autograd).

    Returns (output [1, T, C], (final state, final conv tail) of the whole prompt). boundaries: None, or the
    exact-mode ChunkBoundary list of this rank, whose carries get this layer's (state, tail) at each chunk start,
    kept in `checkpoints` (ds_longstraw.state's checkpoint store).
    pad: extra one-token dummy calls after each per-chunk loop (ZeRO-3 lockstep; see parallel/capture.py); an empty
    shard also makes a dummy call in place of its conv-tail projection.
    """
    width = module.conv_kernel_size - 1
    tokens = normed_1TC.shape[1]
    sizes = [hi - lo for lo, hi in bounds]
    lo = bounds[cp.rank][0]

    # (1) conv tails across rank boundaries
    count = min(tokens, width)
    part = normed_1TC.new_zeros(1, module.conv_dim, width)
    if count:
        part[:, :, width - count:] = module.in_proj_qkv(normed_1TC[:, tokens - count:]).transpose(1, 2)
    dummy = normed_1TC.new_zeros(1, 1, normed_1TC.shape[-1])
    if pad and not count:
        module.in_proj_qkv(dummy)
    parts = cp.all_gather(part, layer, "gdn_tail")
    counts = [min(n, width) for n in sizes]
    tail_in = fold_tails(parts[:cp.rank], counts[:cp.rank], width) if lo > 0 else None
    tail_final = fold_tails(parts, counts, width)

    # (2) this rank's transition from zero state, the exclusive combine and the final state
    heads, dk, dv = module.num_v_heads, module.head_k_dim, module.head_v_dim
    summary = identity_summary(heads, dk, dv, adapter.state_dtype(), normed_1TC.device)
    tail = tail_in
    for a, b in spans:
        def inputs(a=a, b=b, tail=tail):
            return adapter.gdn_inputs(module, normed_1TC[:, a:b], tail)

        query, key, value, g, beta, _, tail = _call_module(module, inputs)
        summary = extend_summary(summary, query, key, value, g, beta)
    for _ in range(pad):
        _call_module(module, lambda: adapter.gdn_inputs(module, dummy, None))
    summaries = cp.all_gather(summary, layer, "gdn_summary")
    state = fold_states(summaries[:cp.rank], sizes[:cp.rank], dv) if lo > 0 else None
    final_state = fold_states(summaries, sizes, dv)

    # (3) the layer itself, chunk by chunk from the true carry (the single-process code path)
    outs, tail = [], tail_in
    for index, (a, b) in enumerate(spans):
        if boundaries is not None and state is not None:
            boundaries[index].carry[layer] = checkpoints.save_layer(index, layer, (state, tail))
        out, state, tail = adapter.gdn_forward(module, normed_1TC[:, a:b], state, tail)
        outs.append(out)
    for _ in range(pad):
        adapter.gdn_forward(module, dummy, None, None)
    output = torch.cat(outs, 1) if outs else torch.zeros_like(normed_1TC)
    return output, (final_state, tail_final)
