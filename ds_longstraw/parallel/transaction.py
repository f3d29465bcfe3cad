"""The GRPO transaction with the prompt sharded over a context-parallel (CP) group.

Every rank of the CP group calls grpo_backward with the same group, config and cp_group; the phases are those of
the single-process transaction (../transaction.py), with what crosses ranks made explicit:

  reference  (kl_coef > 0) CP capture of the reference policy, scoring replayed on every rank, state freed
  capture    layer-major CP capture (capture.py): each rank keeps the K/V pages of its own prompt shard; GDN
             states cross ranks as transition summaries; every rank ends with the prompt's final GDN carry;
             attention meets earlier pages by LSE-merged partials, or (cp_attention="ulysses") by all-to-alls
  replay     every rank replays every member, identically: its attention layers reach the prompt pages of all
             ranks through all-gathered (out, lse) partials (cp_attention.PagesAttention), so logits, losses
             and the gradients replay produces are the same on every rank. Queries never move; compute outside
             attention over the pages is replicated (responses are short next to the prompt; distributing
             members over ranks would need the ranks' autograd graphs in lockstep).
             Exact mode: dK/dV of each rank's pages go to its own gradient pages, d(final carry) is on all ranks.
  prefix     (exact) ranks take turns last to first (prefix.py); the parameter gradients it produces differ per
             rank (each covers its own tokens)
  reduce     ONE all-reduce over the CP group of (replay's gradients / N + this rank's prefix gradients): the sum
             is the group's gradient, and the same bits land on every rank even where replicated kernels are not
             bit-reproducible (atomics in GPU embedding backward), so CP replicas never drift apart
When the call returns every rank holds the same, complete parameter gradients (accumulated into .grad: what
.grad held before the call is kept apart from the reduction and added back).

With a caller's `backward` (the DeepSpeed engine, ../engine.py) there is no CP all-reduce here: the caller's own
gradient reduction (DeepSpeed's, over every rank of the job) does the summing. Each rank back-propagates the whole
replay (member loss shares as given) and cp.size x its own prefix-pass share (exact mode: the injected gradients
d(final carry) and the gradient pages are scaled by cp.size before the prefix pass; the pass is linear in them).
Summed over the N CP ranks that is N x the group's gradient; averaged over all D x N ranks of D data-parallel
replicas (what DeepSpeed does with no mpu) it is (1/D) sum over replicas of each replica's group gradient: the
data-parallel average. lockstep (ZeRO-3): capture chunks and replay members/blocks are padded with dummy calls so
every rank of the job makes the same module calls; exact mode's prefix turns are mirrored (prefix.py).
"""

import torch

from ds_longstraw.arch import adapter_for
from ds_longstraw.memory import PhaseMeter
from ds_longstraw.replay import PrefixLeaves, final_carry_grads, replay_group, score_group

from .capture import cp_capture_prefix
from .cp_attention import PagesAttention
from .prefix import cp_prefix_backward
from .ulysses import check_heads


def _replay_leaves(adapter, state, requires_grad):
    """The prompt state as replay sees it: the final GDN carry (leaves in exact mode); no local prompt pages (they
    are reached through PagesAttention on every rank)."""
    carry = {layer: (s.detach().requires_grad_(requires_grad), t.detach().requires_grad_(requires_grad))
             for layer, (s, t) in state.gdn_carry.items()}
    return PrefixLeaves(gdn_carry=carry, past={layer: [] for layer in adapter.attn_layers})


def cp_score_reference(ref_model, group, settings, cp, lockstep=None):
    """Reference log-probs of every member on every rank, without a graph; the reference state is freed."""
    adapter = adapter_for(ref_model)
    pad = 0 if lockstep is None else lockstep.capture_pad
    state = cp_capture_prefix(adapter, group.prompt_ids, settings, cp, pad=pad)
    leaves = _replay_leaves(adapter, state, False)
    remote = PagesAttention(cp, state.pool, adapter)
    try:
        return score_group(adapter, leaves, state.length, group, settings.replay_block, lockstep=lockstep,
                           remote_attention=remote)
    finally:
        state.release()


def _take_grads(model):
    """Detach the current .grad of every trainable parameter (to be added back after the reduction)."""
    taken = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            taken[name] = param.grad
            param.grad = None
    return taken


def _scale_grads_(model, factor):
    for param in model.parameters():
        if param.requires_grad and param.grad is not None:
            param.grad.mul_(factor)


def _reduce_and_restore(model, taken, cp):
    """.grad <- taken + (sum over the CP ranks of what accumulated since _take_grads), in one all-reduce."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params]
    flat = torch.cat([g.reshape(-1).to(torch.promote_types(g.dtype, torch.float32)) for g in grads])
    cp.all_reduce_(flat, -1, "param_grads")
    offset = 0
    for (name, param), grad in zip(params, grads):
        count = grad.numel()
        reduced = flat[offset:offset + count].view_as(grad).to(param.dtype)
        offset += count
        before = taken.get(name)
        param.grad = reduced if before is None else before + reduced


def _scale_injected_(state, d_final, factor):
    """Exact mode under a caller's reduction: scale what the prefix pass injects (d final carry, gradient pages)."""
    for layer, (d_state, d_tail) in list(d_final.items()):
        d_final[layer] = (d_state * factor, d_tail * factor)
    pool = state.pool
    for layer, name in pool.streams():
        grad = pool.read_grad(layer, name)
        if grad.numel():
            pool.add_grad(layer, name, 0, grad * (factor - 1))


def cp_grpo_backward(model, group, objective, *, settings, ref_model, cp, backward=None, lockstep=None):
    """The CP transaction (called by grpo_backward when cp_size > 1); returns a GroupResult.

    backward: None (this function all-reduces .grad over the CP group), or a callable that back-propagates and
    whose caller reduces (see the module docstring for what each rank then contributes). lockstep: None, or the
    ZeRO-3 padding of this rank's module calls (../lockstep.py; shape from lockstep.shape_of(..., cp=cp))."""
    from ds_longstraw.transaction import GroupResult, _reference_policy

    exact = settings.prefix_grad == "exact"
    engine_reduce = backward is not None
    adapter = adapter_for(model)
    if settings.cp_attention == "ulysses":
        check_heads(adapter.config.num_attention_heads, adapter.config.num_key_value_heads, cp.size)
    meter = PhaseMeter(adapter.device)
    advantages = objective.advantages(group)
    cp.traffic.reset()
    cp.decisions.clear()

    ref_logprobs = None
    if objective.kl_coef > 0:
        with meter.phase("reference"), cp.phase("reference"), _reference_policy(model, ref_model) as reference:
            ref_logprobs = cp_score_reference(reference, group, settings, cp, lockstep)

    pad = 0 if lockstep is None else lockstep.capture_pad
    with meter.phase("capture"), cp.phase("capture"):
        state = cp_capture_prefix(adapter, group.prompt_ids, settings, cp, keep_boundaries=exact, pad=pad)
    retained = state.retained_bytes()

    try:
        before = None if engine_reduce else _take_grads(model)  # .grad before this group: kept out of the reduction
        with meter.phase("replay"), cp.phase("replay"):
            leaves = _replay_leaves(adapter, state, exact)
            remote = PagesAttention(cp, state.pool, adapter, exact=exact)
            loss, logprobs = replay_group(adapter, leaves, state.length, group, objective, advantages, ref_logprobs,
                                          settings.replay_block, backward=backward, lockstep=lockstep,
                                          remote_attention=remote)

        if not engine_reduce:
            _scale_grads_(model, 1.0 / cp.size)  # replay's gradients are the same on every rank: count them once
        grad_page_bytes = state.pool.grad_bytes()
        if exact:
            with meter.phase("prefix"), cp.phase("prefix"):
                d_final = final_carry_grads(leaves)
                if engine_reduce and cp.size != 1:
                    _scale_injected_(state, d_final, cp.size)
                lo, hi = cp.shards(state.length)[cp.rank]
                ids = group.prompt_ids[:-1][lo:hi]
                cp_prefix_backward(adapter, state, ids, d_final, cp, settings.segment_tokens, backward=backward,
                                   lockstep_chunks=None if lockstep is None else lockstep.common.chunks,
                                   recompute=settings.recompute_layers)
            grad_page_bytes = state.pool.grad_bytes()
        if not engine_reduce:
            with meter.phase("reduce"), cp.phase("reduce"):
                _reduce_and_restore(model, before, cp)
        del leaves
    finally:
        state.release()  # page files of a host/NVMe tier go on error as on success
    lo, hi = cp.shards(state.length)[cp.rank]
    replayed_tokens = group.response_tokens
    extras = {"cp": dict(cp.report(), shard=(lo, hi), replayed_tokens=replayed_tokens)}
    return GroupResult(loss=loss, logprobs=logprobs, ref_logprobs=ref_logprobs, advantages=advantages,
                       phases=meter.phases, retained_bytes=retained, grad_page_bytes=grad_page_bytes, extras=extras)
