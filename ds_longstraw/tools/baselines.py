"""What long-context GRPO does without ds_longstraw, measured with the same meter.

conventional: one prompt forward WITH autograd shared by all G responses, then one backward of the summed group
    loss. Exact gradients; the prompt's graph and every response's graph are alive together.
per_member: a full prompt+response forward/backward per member (as common GRPO trainers do), through the same
    layer kernels as the transaction. Exact gradients; the prompt is recomputed G times.
Both accumulate into .grad like grpo_backward and return a GroupResult.
"""

import torch

from ds_longstraw.arch import adapter_for
from ds_longstraw.config import parse_config
from ds_longstraw.grpo.memory import PhaseMeter
from ds_longstraw.grpo.replay import member_inputs
from ds_longstraw.grpo.transaction import GroupResult, reference_policy, score_reference
from ds_longstraw.objective import GRPOObjective


def _start(model, group, objective, longstraw, ref_model):
    """What both baselines do first: check the input, score the reference (kl_coef > 0) under a meter."""
    longstraw = parse_config(longstraw)
    objective = objective or GRPOObjective()
    adapter = adapter_for(model)
    adapter.logprobs_temperature = objective.temperature  # as the transaction scores them
    group.check_vocab(adapter.vocab_size)
    meter = PhaseMeter(adapter.device)
    ref_logprobs = None
    with meter.phase("reference"):
        if objective.kl_coef > 0:
            with reference_policy(model, ref_model) as reference:
                ref_logprobs = score_reference(reference, group, longstraw, temperature=objective.temperature)
    return objective, adapter, meter, objective.advantages(group), ref_logprobs


def conventional(model, group, objective=None, *, longstraw=None, ref_model=None) -> GroupResult:
    objective, adapter, meter, advantages, ref_logprobs = _start(model, group, objective, longstraw, ref_model)
    with meter.phase("forward"), torch.enable_grad():
        ids = group.prompt_ids[:-1]
        prompt = adapter.forward_segment(ids, 0, {}, {})
        carry = prompt.carry
        logps, total = [], 0.0
        for member in range(group.size):
            inputs, targets = member_inputs(group, member)
            past = {layer: [rows] for layer, rows in prompt.rows.items()}
            out = adapter.forward_segment(inputs, ids.numel(), carry, past)
            logp = adapter.logprobs(out.hidden, targets)
            ref = None if ref_logprobs is None else ref_logprobs[member].to(logp.device)
            total = total + objective.member_loss(group, member, logp, advantages, ref)
            logps.append(logp)
    with meter.phase("backward"):
        if total.requires_grad:
            total.backward()
    retained = {}  # what the prompt's forward keeps for the members, by the specs' labels
    for spec in adapter.specs:
        rows = prompt.rows.get(spec.layer, ())
        retained[spec.label] = retained.get(spec.label, 0) + sum(t.numel() * t.element_size() for t in rows)
    return GroupResult(loss=float(total.detach()), logprobs=[lp.detach().double().cpu() for lp in logps],
                       ref_logprobs=ref_logprobs, advantages=advantages, phases=meter.phases, retained_bytes=retained)


def per_member(model, group, objective=None, *, longstraw=None, ref_model=None) -> GroupResult:
    objective, adapter, meter, advantages, ref_logprobs = _start(model, group, objective, longstraw, ref_model)
    logps, loss = [], 0.0
    with meter.phase("forward_backward"):
        for member in range(group.size):
            response = group.response_ids[member]
            ids = torch.cat([group.prompt_ids, response[:-1]])
            with torch.enable_grad():
                # The whole sequence through the same layer kernels as the transaction (so the comparison is of
                # schedules, not of kernels); logits only where they are used.
                out = adapter.forward_segment(ids, 0, {}, {})
                logp = adapter.logprobs(out.hidden[:, group.prompt_ids.numel() - 1:], response)
                ref = None if ref_logprobs is None else ref_logprobs[member].to(logp.device)
                share = objective.member_loss(group, member, logp, advantages, ref)
                if share.requires_grad:
                    share.backward()
            loss += float(share.detach())
            logps.append(logp.detach().double().cpu())
            del out, logp, share
    return GroupResult(loss=loss, logprobs=logps, ref_logprobs=ref_logprobs, advantages=advantages,
                       phases=meter.phases, retained_bytes={})


BASELINES = {"conventional": conventional, "per_member": per_member}
