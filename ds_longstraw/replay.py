"""Replay of one group member from captured prompt state, in blocks, with or without autograd.

A member's replay input is [prompt[-1], response[:-1]] at positions len(prompt)-1 onward, and its targets are
the response tokens: every response token's log-prob (the first one too) comes out of the replay. Blocks of
`replay_block` tokens carry GDN state forward and append their K/V to the past of later blocks, so attention
score memory is bounded by one block while the member's graph spans the whole response.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class PrefixLeaves:
    """The captured state as seen by replay: constants (detached mode) or leaves whose gradients are collected
    onto gradient pages (exact mode)."""

    gdn_carry: dict
    past: dict  # layer -> list of (K, V)
    kv_leaves: list = field(default_factory=list)  # (layer, name, leaf) for exact mode


def prefix_leaves(adapter, state, requires_grad):
    carry = {}
    for layer, (recurrent, tail) in state.gdn_carry.items():
        carry[layer] = (recurrent.detach().requires_grad_(requires_grad), tail.detach().requires_grad_(requires_grad))
    leaves = PrefixLeaves(gdn_carry=carry, past={})
    for layer in adapter.attn_layers:
        pair = []
        for name in ("k", "v"):
            tensor = state.pool.read(layer, name).detach()
            if requires_grad:
                tensor.requires_grad_(True)
                tensor.register_post_accumulate_grad_hook(_to_grad_pages(state.pool, layer, name, 0))
                leaves.kv_leaves.append((layer, name, tensor))
            pair.append(tensor)
        leaves.past[layer] = [tuple(pair)]
    return leaves


def _to_grad_pages(pool, layer, name, start):
    """After autograd accumulates a page leaf's gradient, move it onto the gradient pages and free it, so at most
    one layer's transient gradient is alive at a time."""

    def hook(leaf):
        pool.add_grad(layer, name, start, leaf.grad)
        leaf.grad = None

    return hook


def replay_member(adapter, leaves, start, inputs, targets, block):
    """Log-probs of `targets` given the captured prefix (differentiable when grad mode is on)."""
    carry = dict(leaves.gdn_carry)
    past = {layer: list(segments) for layer, segments in leaves.past.items()}
    logps = []
    for offset in range(0, inputs.numel(), block):
        end = min(inputs.numel(), offset + block)
        out = adapter.forward_segment(inputs[offset:end], start + offset, carry, past)
        carry = {layer: (out.gdn_state[layer], out.conv_tail[layer]) for layer in out.gdn_state}
        for layer in out.keys:
            past[layer].append((out.keys[layer], out.values[layer]))
        logps.append(adapter.logprobs(out.hidden, targets[offset:end]))
    return torch.cat(logps)


def member_inputs(group, member):
    response = group.response_ids[member]
    inputs = torch.cat([group.prompt_ids[-1:], response[:-1]])
    return inputs, response
