"""Exact mode's reverse pass over the prompt's capture chunks.

After every member has replayed, the gradient pages hold d(loss)/d(K, V) of every prompt token that replay read,
and the GDN leaves hold d(loss)/d(final state). Walking the chunks last to first, chunk c is recomputed WITH
autograd from its checkpointed boundary state and the pages before it; the accumulated gradients of its outputs
(its K/V rows, its end state and conv tail) are injected; backward adds parameter gradients, adds the gradients
that land on earlier pages to their gradient pages, and yields d(boundary state), carried to chunk c-1.
The live graph is one chunk; every prompt token's contribution is counted once, as in full-sequence autograd.
"""

import torch

from .replay import _to_grad_pages


def _zeros_like_carry(recurrent, tail, like_state, like_tail):
    return (torch.zeros_like(like_state) if recurrent is None else recurrent,
            torch.zeros_like(like_tail) if tail is None else tail)


def prefix_backward(adapter, state, ids, d_final_carry, progress=None):
    """ids: prompt[:-1]; d_final_carry: layer -> (d recurrent state, d conv tail) after the prefix."""
    pool = state.pool
    d_carry = d_final_carry
    for boundary in reversed(state.boundaries):
        start, end = boundary.start, boundary.end
        carry = {}
        for layer in adapter.gdn_layers:
            recurrent, tail = boundary.gdn_carry.get(layer, (None, None))
            if recurrent is None:  # the prompt start: zero state, nothing to carry further back
                carry[layer] = (None, None)
            else:
                carry[layer] = (recurrent.detach().requires_grad_(True), tail.detach().requires_grad_(True))
        past = {}
        for layer in adapter.attn_layers:
            pair = []
            for name in ("k", "v"):
                leaf = pool.read(layer, name, 0, start).detach().requires_grad_(True)
                leaf.register_post_accumulate_grad_hook(_to_grad_pages(pool, layer, name, 0))
                pair.append(leaf)
            past[layer] = [tuple(pair)]
        with torch.enable_grad():
            out = adapter.forward_segment(ids[start:end], start, carry, past)
            outputs, grads = [], []
            for layer in adapter.gdn_layers:
                d_state, d_tail = d_carry[layer]
                outputs += [out.gdn_state[layer], out.conv_tail[layer]]
                grads += [d_state.to(out.gdn_state[layer]), d_tail.to(out.conv_tail[layer])]
            for layer in adapter.attn_layers:
                outputs += [out.keys[layer], out.values[layer]]
                grads += [pool.read_grad(layer, "k", start, end).to(out.keys[layer]),
                          pool.read_grad(layer, "v", start, end).to(out.values[layer])]
            # A frozen model part (say a LoRA policy whose adapters miss a layer) can leave an output graph-free.
            live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            if live:
                torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        d_carry = {}
        for layer in adapter.gdn_layers:
            recurrent, tail = carry[layer]
            if recurrent is not None:
                d_carry[layer] = _zeros_like_carry(recurrent.grad, tail.grad, recurrent, tail)
        del out, outputs, grads, live
        if progress is not None:
            progress(end - start)
