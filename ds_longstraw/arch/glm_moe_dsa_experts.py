"""glm_moe_dsa's MoE block under expert parallelism (parallel/experts.py): its routed experts sharded over an EP
group, and the block's forward with the routed pairs dispatched to their owners.

The block (transformers' GlmMoeDsaMoE) is `gate` (the sigmoid router with its correction bias, group-limited
top-k, normalisation and scaling: run as the module, replicated on every rank), `experts` (two fused 3-D
parameters, gate_up_proj [n, 2I, H] and down_proj [n, H, I]) and `shared_experts` (an MLP every token runs
locally). Sharding keeps this rank's contiguous slice of both fused parameters; the forward is the module's own,
with the experts' loop replaced by the dispatch and the same per-expert math on the owner.
"""

from contextlib import nullcontext

import torch
import torch.nn as nn

from ds_longstraw.parallel.experts import EXPERT_SLICE, ExpertParallel, dispatch, dispatch_reference


def moe_blocks(model) -> list:
    """The MoE blocks (layer.mlp with routed experts) of a glm_moe_dsa model, or of a peft wrapper of one."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [layer.mlp for layer in lm.model.layers if hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj")]


def shard_experts(model, ep_group, gather=None) -> range:
    """Keep, in every MoE block, only this rank's slice of the routed experts; returns the slice (global expert
    indices). The block's experts module then reaches the other slices through its ExpertParallel.
    gather: None, or gather(params) -> a context in which partitioned parameters are whole (a model built under
    ZeRO-3's zero.Init: one block's experts at a time, never the whole model)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("shard_experts: the model has no routed experts (no MoE layer)")
    first = blocks[0].experts
    if getattr(first, "expert_parallel", None) is not None:
        raise ValueError(f"shard_experts: the experts are already sharded over {first.expert_parallel.size} ranks")
    ep = ExpertParallel(ep_group, first.num_experts)
    lo, hi = ep.local.start, ep.local.stop
    ep.replaced = set()  # ids of the whole fused parameters (an optimizer built before sharding may hold them)
    for block in blocks:
        experts = block.experts
        if experts.num_experts != ep.experts:
            raise ValueError(f"shard_experts: MoE layers differ in routed experts ({experts.num_experts} vs "
                             f"{ep.experts})")
        names = ("gate_up_proj", "down_proj")
        with gather([getattr(experts, name) for name in names]) if gather is not None else nullcontext():
            parts = {}
            for name in names:
                full = getattr(experts, name)
                ep.replaced.add(id(full))
                parts[name] = nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad)
                setattr(parts[name], EXPERT_SLICE, (lo, hi, ep.experts))
        for name, part in parts.items():
            setattr(experts, name, part)
        experts.num_experts = hi - lo
        experts.expert_parallel = ep
    return ep.local


def unregister_slices(model) -> dict:
    """Take the sharded slices out of their experts modules' registered parameters (they stay readable as
    experts.gate_up_proj / down_proj, where this family's forward reads them); returns {qualified name: slice}.
    The DeepSpeed engine keeps them out of ZeRO this way (engine/expert_slices.py)."""
    slices = {}
    for name, module in model.named_modules():
        if getattr(module, "expert_parallel", None) is not None:
            for attr in ("gate_up_proj", "down_proj"):
                param = module._parameters.pop(attr)
                object.__setattr__(module, attr, param)
                slices[f"{name}.{attr}"] = param
    return slices


def expert_parallel(model):
    """The ExpertParallel the model's experts are sharded with (None: not sharded)."""
    blocks = moe_blocks(model)
    return getattr(blocks[0].experts, "expert_parallel", None) if blocks else None


def _expert(experts, index, tokens_RC):
    """One expert of the fused parameters (index into this rank's slice) over tokens: the model's own math."""
    gate, up = nn.functional.linear(tokens_RC, experts.gate_up_proj[index]).chunk(2, dim=-1)
    return nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[index])


def local_experts(experts, tokens_RC, local_R):
    """This rank's experts over the pairs it received: one expert at a time over its pairs (pairs sorted by
    expert), results back in the pairs' order."""
    order = torch.argsort(local_R, stable=True)
    counts = torch.bincount(local_R, minlength=experts.num_experts).tolist()
    pieces, start = [], 0
    for index, count in enumerate(counts):
        if count:
            pieces.append(_expert(experts, index, tokens_RC[order[start:start + count]]))
        start += count
    if not pieces:  # nothing received: an empty result still in the graph, so the return's backward runs here too
        return tokens_RC * 0
    return torch.cat(pieces)[torch.argsort(order)]


def moe_forward(block, hidden_1TC):
    """The MoE block's output for hidden [.., T, C] with its experts sharded: router here, routed pairs on their
    owners (parallel/experts.dispatch), shared expert here."""
    experts = block.experts
    _, weights, indices = block.gate(hidden_1TC)
    flat = hidden_1TC.reshape(-1, hidden_1TC.shape[-1])
    routed = dispatch(experts.expert_parallel, flat, indices, weights,
                      lambda tokens, local: local_experts(experts, tokens, local))
    return routed.view(hidden_1TC.shape) + block.shared_experts(hidden_1TC)


def moe_forward_reference(block, hidden_1TC):
    """Plain version of the block with every expert here (the model's math, expert by expert)."""
    _, weights, indices = block.gate(hidden_1TC)
    flat = hidden_1TC.reshape(-1, hidden_1TC.shape[-1])
    routed = dispatch_reference(flat, indices, weights, lambda tokens, e: _expert(block.experts, e, tokens))
    return routed.view(hidden_1TC.shape) + block.shared_experts(hidden_1TC)
