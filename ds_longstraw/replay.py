"""Replay of one group member from captured prompt state, in blocks, with or without autograd.

A member's replay input is [prompt[-1], response[:-1]] at positions len(prompt)-1 onward, and its targets are
the response tokens: every response token's log-prob (the first one too) comes out of the replay. Blocks of
`replay_block` tokens carry GDN state forward and append their K/V to the past of later blocks, so attention
score memory is bounded by one block while the member's graph spans the whole response.

The prompt's K/V pages reach attention through a StagedPast (ds_longstraw.offload): each block's forward stages
one layer's pages at a time from the pool's tier, and the graph keeps handles instead of staged copies
(re-staged in backward), so with a host or NVMe tier no more than a few layers of pages are on the device.
"""

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ds_longstraw.memory import return_freed_host_memory
from ds_longstraw.offload import StagedPast, Stager, staged_saves


@dataclass
class PrefixLeaves:
    """The captured state as seen by replay: constants (detached mode) or leaves whose gradients are collected
    onto gradient pages (exact mode)."""

    gdn_carry: dict
    past: dict  # layer -> list of (K, V): a StagedPast, or a plain dict (context parallelism: no local pages)
    kv_leaves: list = field(default_factory=list)  # unused since pages are staged (kept for callers that set it)
    stager: object = None  # the StagedPast's stager, closed by release()

    def release(self):
        """Drop every staged layer (in-flight reads complete first)."""
        if self.stager is not None:
            self.stager.close()


def prefix_leaves(adapter, state, requires_grad):
    """Replay's view of the captured state. requires_grad (exact mode): the GDN carry tensors are leaves, and the
    K/V pages' gradients go to the pool's gradient pages as each block's backward produces them."""
    carry = {}
    for layer, (recurrent, tail) in state.gdn_carry.items():
        carry[layer] = (recurrent.detach().requires_grad_(requires_grad), tail.detach().requires_grad_(requires_grad))
    # wrap: every block walks all layers, so the read-ahead after the last layer is the first one.
    stager = Stager(state.pool, adapter.attn_layers, wrap=True)
    past = StagedPast(stager, adapter.attn_layers, 0, state.length, with_grad=requires_grad)
    return PrefixLeaves(gdn_carry=carry, past=past, stager=stager)


def replay_member(adapter, leaves, start, inputs, targets, block, remote_attention=None):
    """Log-probs of `targets` given the captured prefix (differentiable when grad mode is on).

    remote_attention: None, or the context-parallel attention over every rank's prompt pages (then
    `leaves.past` holds no prompt pages; see ds_longstraw.parallel)."""
    carry = dict(leaves.gdn_carry)
    staged = isinstance(leaves.past, StagedPast)
    past = leaves.past.fresh() if staged else {layer: list(segments) for layer, segments in leaves.past.items()}
    logps = []
    with staged_saves(past.stager) if staged else nullcontext():
        for offset in range(0, inputs.numel(), block):
            end = min(inputs.numel(), offset + block)
            out = adapter.forward_segment(inputs[offset:end], start + offset, carry, past, remote_attention)
            carry = {layer: (out.gdn_state[layer], out.conv_tail[layer]) for layer in out.gdn_state}
            for layer in out.keys:
                if staged:
                    past.append(layer, (out.keys[layer], out.values[layer]))
                else:
                    past[layer].append((out.keys[layer], out.values[layer]))
            logps.append(adapter.logprobs(out.hidden, targets[offset:end]))
    return torch.cat(logps)


def member_inputs(group, member):
    response = group.response_ids[member]
    inputs = torch.cat([group.prompt_ids[-1:], response[:-1]])
    return inputs, response


def replay_group(adapter, leaves, start, group, objective, advantages, ref_logprobs, block, *, backward=None,
                 lockstep=None, remote_attention=None):
    """Replay every member one at a time WITH autograd, back-propagate its loss share, drop its graph.

    backward: how a share is back-propagated (default loss.backward(); the DeepSpeed engine passes its own);
    lockstep: pads this rank's module calls to the other ranks' (dummy tokens and members; results unchanged).
    Returns (group loss as a float, per-member log-probs detached on the CPU in float64).
    """
    def replay(adapter_, leaves_, start_, inputs, targets, block_):
        return replay_member(adapter_, leaves_, start_, inputs, targets, block_, remote_attention)

    logprobs, loss = [], 0.0
    for member in range(group.size):
        inputs, targets = member_inputs(group, member)
        real = targets.numel()
        if lockstep is not None:
            inputs, targets = lockstep.pad_member(member, inputs, targets)
        with torch.enable_grad():
            logp = replay(adapter, leaves, start, inputs, targets, block)[:real]
            ref = None if ref_logprobs is None else ref_logprobs[member].to(logp.device)
            share = objective.member_loss(group, member, logp, advantages, ref)
            if share.requires_grad:
                share.backward() if backward is None else backward(share)
        loss += float(share.detach())
        logprobs.append(logp.detach().double().cpu())
        del logp, share
        return_freed_host_memory(adapter.device)
    if lockstep is not None:
        lockstep.replay_dummy_members(adapter, leaves, start, replay, backward)
    return loss, logprobs


def final_carry_grads(leaves):
    """d(loss)/d(GDN state, conv tail after the prefix), accumulated over the members (zeros where none)."""
    return {layer: (torch.zeros_like(recurrent) if recurrent.grad is None else recurrent.grad,
                    torch.zeros_like(tail) if tail.grad is None else tail.grad)
            for layer, (recurrent, tail) in leaves.gdn_carry.items()}


def score_group(adapter, leaves, start, group, block, *, lockstep=None, remote_attention=None):
    """Log-probs of every member's response WITHOUT a graph (reference scoring), float64 on the CPU."""
    def replay(adapter_, leaves_, start_, inputs, targets, block_):
        return replay_member(adapter_, leaves_, start_, inputs, targets, block_, remote_attention)

    scores = []
    with torch.no_grad():
        for member in range(group.size):
            inputs, targets = member_inputs(group, member)
            real = targets.numel()
            if lockstep is not None:
                inputs, targets = lockstep.pad_member(member, inputs, targets)
            scores.append(replay(adapter, leaves, start, inputs, targets, block)[:real].double().cpu())
        if lockstep is not None:
            lockstep.replay_dummy_members(adapter, leaves, start, replay, with_grad=False)
    return scores
