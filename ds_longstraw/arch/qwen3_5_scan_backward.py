"""qwen3_5's Gated DeltaNet in the layer-major exact prefix pass: every context-parallel rank's backward at once.

The family half of the "affine_scan" combine in ds_longstraw.grpo.cp.prefix_layers (the capture's half is
qwen3_5_scan.py). The pass walks the layers top to bottom on all ranks together; at this layer each rank holds
d(layer output) for its own tokens and the layer's input over its shard (saved at capture), and must produce
d(layer input), the parameter gradients of its tokens, and nothing else across ranks but two small exchanges.

What crosses ranks backward, and why it is cheap:
  state  the backward of the delta rule's state recurrence is affine in the gradient D of a segment's end state:
         d(start state) = A D + L, where L (from the segment's output gradients) and A (the transposed transition)
         do not depend on the forward state (kernels/gated_delta/chunked.PreparedDeltaRule.state_adjoint). Each rank
         summarises its pieces, the summaries are all-gathered, and every rank folds them from the prompt's end
         (D of the last segment: replay's gradient of the prompt's final state) to get its pieces' true D. Each
         piece then runs its own backward from its D, chunk by chunk, last chunk first.
  tail   a segment's end conv tail is the last k-1 tokens of its pre-convolution projection (fewer when the segment
         is shorter, the rest coming from its start tail). Its gradient touches only those projections, not the
         recurrence, so the pieces' backwards run with zero d(end tail); afterwards the d(start tail) of every
         piece is all-gathered, every rank folds them from the prompt's end (replay's gradient of the final tail
         first) and back-propagates its pieces' share through the last tokens' projection.
Per rank that is about its share of the layer's backward: the layer's forward recomputed twice (the output side
once, the input side with the delta rule once) plus the summary's recurrence over [dS | X], (dv + dk) / dv of
the backward's own state loop.

Steps per GDN layer (the schedule's dummy chunks after each per-chunk loop: ZeRO-3 lockstep, as the capture makes):
(0, 1) per chunk: the delta rule's inputs and output from its checkpointed carry without a graph; then with
    autograd y = mlp_residual(x + finish(o, z)) with o and z as leaves: d(o), d(z), a d(x) part; and the chunk's
    (L, A), composed into its piece's, so that no input of the delta rule outlives its chunk;
(2) all-gather the pieces' (L, A); fold from the prompt's end -> each piece's D;
(3) per piece, chunks last first, with autograd from the chunk's checkpointed carry (leaves): the delta rule's
    roots (o, z, end state, end tail) get (d(o), d(z), D or the next chunk's d(start state), the next chunk's
    d(start tail)); a d(x) part;
(4) all-gather the pieces' d(start tail); fold; each piece's last tokens' projection gets its share; a d(x) part.
Held across the layer: d(o) and d(z) over the shard.
"""

import torch

from ds_longstraw.kernels.gated_delta import PreparedDeltaRule
from ds_longstraw.parallel.groups import local_starts, piece_index, segments_in_order

from .base import grad_leaf, grad_of, inject_gradients
from .qwen3_5_scan import _call_module, forward_replaced, identity_summary


def _core(adapter, module, h_1TC, state, tail):
    """(o, z, end state, end tail) of the layer's delta rule on input h (the adapter's gdn_core), as the module's
    call (ZeRO-3's hooks gather A_log and dt_bias around it, forward and backward)."""

    def forward(h):
        return adapter.gdn_core(module, h, state, tail)

    with forward_replaced(module, forward):
        return tuple(module(h_1TC))


def prefix_gdn_layer(adapter, module, layer, read_input, dy_1TC, state, chunks, cp, pieces, d_final, backward=None):
    """d(layer input) [1, T, C] of GDN layer `layer` over this rank's shard (see the module docstring); parameter
    gradients accumulate. read_input(a, b): the layer's input [1, b - a, C] of local tokens [a, b) (capture's);
    dy_1TC: d(layer output); chunks: the schedule's chunks (grpo/lockstep.ShardChunks): `spans`, this rank's
    chunks [(a, b, position)] in local order, one per state.boundaries entry, then dummies() after each per-chunk
    loop; d_final: replay's (d state, d tail) of the prompt's final carry of this layer, or None."""
    spans = chunks.spans
    width = module.conv_kernel_size - 1
    heads, dk, dv = module.num_v_heads, module.head_k_dim, module.head_v_dim
    mine, order = pieces[cp.rank], segments_in_order(pieces)
    starts = local_starts(mine)
    owners = [piece_index(mine, position) for _, _, position in spans]  # each chunk's piece
    acc = adapter.state_dtype()
    device = dy_1TC.device
    zero = torch.zeros(1, 1, adapter.hidden_size, dtype=adapter.dtype, device=device)
    d_x = torch.zeros(dy_1TC.shape, dtype=dy_1TC.dtype, device=device)
    carries = [_carry(state, boundary, layer) for boundary in state.boundaries]

    # (0, 1) per chunk: the delta rule's inputs and output without a graph, then the output side with autograd:
    # d(o), d(z), the residual's and MLP's d(x); (2, first half) the chunk's state adjoint summary [L | A], composed
    # into its piece's (d start = A_1 (A_2 D + L_2) + L_1), so no input of the delta rule outlives its chunk
    d_outs, d_gates = [], []
    summaries = [identity_summary(heads, dk, dv, acc, device) for _ in mine]
    for (a, b, _), (start_state, start_tail), k in zip(spans, carries, owners, strict=True):
        x = read_input(a, b)
        rule, out, z = _forward_no_graph(adapter, module, layer, x, start_state, start_tail)
        d_out, d_gate, d_part = _output_side(adapter, module, layer, x, out, z, dy_1TC[:, a:b], backward)
        d_outs.append(d_out)
        d_gates.append(d_gate)
        d_x[:, a:b] += d_part
        if mine[k][0] > 0:  # the prompt's first segment: nothing before it reads its D
            bias, product = rule.state_adjoint(d_out)
            summaries[k] = _compose(summaries[k], bias.to(acc), product.to(acc), dv)
        del rule, out, z
    for _ in chunks.dummies():  # the calls of a real chunk, in its order
        _, out, z = _forward_no_graph(adapter, module, layer, zero, None, None)
        _output_side(adapter, module, layer, zero, out, z, zero, backward)

    # (2, second half) the fold from the prompt's end gives each piece its D
    gathered = cp.all_gather(torch.stack(summaries).contiguous(), layer, "gdn_adjoint_summary")
    d_end = torch.zeros(1, heads, dk, dv, dtype=acc, device=device)
    if d_final is not None and d_final[0] is not None:
        d_end = d_final[0].to(acc).clone()
    d_ends = {}  # (rank, piece) -> D
    for rank, index, lo, hi in reversed(order):
        d_ends[(rank, index)] = d_end
        if hi > lo:
            summary = gathered[rank][index]
            d_end = summary[..., dv:] @ d_end + summary[..., :dv]

    # (3) each piece's backward from its D, last chunk first; d(start tail) of each piece kept for (4)
    d_tail_starts = []
    for k in range(len(mine)):
        d_state, d_tail = d_ends[(cp.rank, k)], None
        for j in reversed([j for j, owner in enumerate(owners) if owner == k]):
            a, b, _ = spans[j]
            d_part, d_state, d_tail = _input_side(adapter, module, layer, read_input(a, b), carries[j],
                                                  (d_outs[j], d_gates[j], d_state, d_tail), backward)
            d_x[:, a:b] += d_part
        d_tail_starts.append(torch.zeros(1, module.conv_dim, width, dtype=adapter.dtype, device=device)
                             if d_tail is None else d_tail.to(adapter.dtype))
    for _ in chunks.dummies():
        _input_side(adapter, module, layer, zero, (None, None), None, backward)

    # (4) the conv tails: fold the pieces' d(start tail) from the prompt's end; each piece's share of it goes
    # through its last tokens' pre-convolution projection
    gathered = cp.all_gather(torch.stack(d_tail_starts).contiguous(), layer, "gdn_tail_grad")
    t_end = torch.zeros_like(d_tail_starts[0])
    if d_final is not None and d_final[1] is not None:
        t_end = d_final[1].to(t_end.dtype).clone()
    shares = {}  # (rank, piece) -> d(the piece's end tail)
    for rank, index, lo, hi in reversed(order):
        n = hi - lo
        shares[(rank, index)] = t_end
        passed = torch.zeros_like(t_end)
        if n < width:  # a short segment's end tail holds part of its start tail
            passed[..., n:] = t_end[..., : width - n]
        t_end = gathered[rank][index] + passed
    for k, (lo, hi) in enumerate(mine):
        count = min(hi - lo, width)
        end = starts[k] + hi - lo
        if count == 0:
            _tail_projection(adapter, module, layer, zero, zero.new_zeros(1, module.conv_dim, 1), backward)
            continue
        d_part = _tail_projection(adapter, module, layer, read_input(end - count, end),
                                  shares[(cp.rank, k)][..., width - count:], backward)
        d_x[:, end - count:end] += d_part
    return d_x


def _forward_no_graph(adapter, module, layer, x_1TC, start_state, start_tail):
    """(the chunk's PreparedDeltaRule, o, z) of the layer's delta rule on a chunk, without a graph: the prepared
    rule gives o now and the state adjoint once d(o) is known, its chunk quantities built once."""
    with torch.no_grad():
        h = adapter.mixer_input(layer, x_1TC)

        def project():
            return adapter.gdn_inputs(module, h, start_tail)

        query, key, value, g, beta, z, _ = _call_module(module, project)
        rule = PreparedDeltaRule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True)
        return rule, rule.output(start_state), z


def _compose(summary, bias, product, dv):
    """[L | A] of a piece so far, extended by a later chunk's (bias L_c, product A_c): A A_c and A L_c + L."""
    earlier_bias, earlier_product = summary[..., :dv], summary[..., dv:]
    return torch.cat([earlier_product @ bias + earlier_bias, earlier_product @ product], -1)


def forward_gdn_layer(adapter, module, layer, normed_1TC, chunks, state):
    """The layer's mixer output of each chunk [a, b) of the shard (no graph), from the chunk's checkpointed carry:
    the rank's own work alone, no exchange (the carries at every chunk start were kept by capture)."""
    outs = []
    with torch.no_grad():
        for (a, b, _), boundary in zip(chunks.spans, state.boundaries, strict=True):
            start_state, start_tail = _carry(state, boundary, layer)
            outs.append(adapter.gdn_forward(module, normed_1TC[:, a:b], start_state, start_tail)[0])
        zero = normed_1TC.new_zeros(1, 1, normed_1TC.shape[-1])
        for _ in chunks.dummies():
            adapter.gdn_forward(module, zero, None, None)
    return outs


def _carry(state, boundary, layer):
    """(state, tail) of `layer` checkpointed at the chunk's start ((None, None) at the prompt start)."""
    got = state.begin_carry(boundary, {layer}).result().get(layer)
    return (None, None) if got is None else got


def _output_side(adapter, module, layer, x_1TC, out, z, dy_1TC, backward):
    """Step (1) for one chunk: (d o, d z, d x) of y = mlp_residual(x + finish(o, z)) given d y."""
    x, out, z = grad_leaf(x_1TC), grad_leaf(out), grad_leaf(z)
    with torch.enable_grad():
        y = adapter.mlp_residual(layer, x + adapter.gdn_finish(module, out, z))
        inject_gradients([y], [dy_1TC], backward)
    return grad_of(out), grad_of(z), grad_of(x)


def _input_side(adapter, module, layer, x_1TC, carry, injected, backward):
    """Step (3) for one chunk from its checkpointed carry: (d x, d start state, d start tail). injected: the
    gradients of (o, z, end state, end tail), None for a lockstep dummy (zero)."""
    x = grad_leaf(x_1TC)
    start_state, start_tail = (grad_leaf(t) for t in carry)
    with torch.enable_grad():
        roots = _core(adapter, module, adapter.mixer_input(layer, x), start_state, start_tail)
        inject_gradients(roots, injected or [None] * len(roots), backward)
    return grad_of(x), grad_of(start_state), grad_of(start_tail)


def _tail_projection(adapter, module, layer, x_1TC, d_tail, backward):
    """Step (4): d(x) of the pre-convolution projection of the tokens x_1TC given its gradient d_tail."""
    x = grad_leaf(x_1TC)
    with torch.enable_grad():
        projected = module.in_proj_qkv(adapter.mixer_input(layer, x)).transpose(1, 2)
        inject_gradients([projected], [d_tail], backward)
    return grad_of(x)
