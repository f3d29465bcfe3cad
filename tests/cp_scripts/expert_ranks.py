"""Run grpo_backward with GLM's routed experts sharded over N gloo ranks (forked local processes), and each rank's
single-process float64 references on the unsharded model, into files.

`run_ep(world, cases, out_dir)` forks `world` ranks in one gloo process group; the EP group is a new_group of all
of them. A case is a dict: name, layout, mode, chunk, page, block, optional tier, kl (a separate, unsharded
reference model at this seed), seed, worlds; and
  layout "cp": one group (prompt_len, response_lens) on every rank, the prompt sharded over the same ranks
               (cp_size = ep_size = N): expected, on every rank, the unsharded model's gradients, the experts'
               sliced to the rank's experts;
  layout "dp": rank r brings groups[r] (cp_size 1, ep_size N; the groups differ in prompt length, member count
               and response lengths, so the ranks pad to a common shape): expected, on rank r, group r's
               gradients of the unsharded model, except the experts': the sum over every rank's group, sliced.
Optional objective: GRPOObjective settings (default: kl_coef 0.2 where kl is given, else none); with
objective_group, the groups are tests/objective_cases.py's objective_group (tool masks, an all-masked member, old
and sampler log-probs of the unsharded model) at seed 10 * seed (+ r for rank r's group under "dp") instead.
Each rank writes <name>.rank<r>.pt: its gradients, the expected ones, loss, log-probs and the EP report; and
generate.rank<r>.pt: generate's samples on the sharded model beside the unsharded model's (_record_generate).
"""

import copy
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .harness import fork_ranks, make_group

# 8 routed experts in 2 groups of 4, top-2 from one group: every EP size here (2, 4) divides them
EP_MODEL = {"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}


def config_of(case, cp_size, ep_size):
    config = {"prefix_grad": case["mode"], "capture_chunk": case["chunk"], "page_tokens": case["page"],
              "replay_block": case["block"], "cp_size": cp_size, "ep_size": ep_size}
    if "tier" in case:
        config["offload"] = {"tier": case["tier"]}
    return config


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(full, group, case, objective, ref_model):
    from ds_longstraw import grpo_backward

    full.zero_grad(set_to_none=True)
    grpo_backward(full, group, objective, longstraw=config_of(case, 1, 1), ref_model=ref_model)
    return _grads(full)


def _run_case(case, world, ep_group, out_dir, rank):
    from glm_models import tiny_glm_moe_dsa

    from ds_longstraw import GRPOObjective, grpo_backward, shard_experts

    model = tiny_glm_moe_dsa(seed=case.get("seed", 0), **EP_MODEL)
    full = copy.deepcopy(model)
    ref_model = tiny_glm_moe_dsa(seed=case["kl"], **EP_MODEL) if "kl" in case else None
    objective = GRPOObjective(**{"kl_coef": 0.2 if ref_model is not None else 0.0, **case.get("objective", {})})
    experts = shard_experts(model, ep_group)
    if case.get("objective_group"):  # already under glm_reference() (worker): no context of its own
        from objective_cases import objective_group

        seed = 10 * case.get("seed", 0)
        groups = [objective_group(full, seed=seed + (0 if case["layout"] == "cp" else i), context=nullcontext)
                  for i in range(world)]
    elif case["layout"] == "cp":
        groups = [make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))] * world
    else:
        groups = [make_group(p, r, seed=10 * case.get("seed", 0) + i) for i, (p, r) in enumerate(case["groups"])]
    cp_group, cp_size = (ep_group, world) if case["layout"] == "cp" else (None, 1)
    result = grpo_backward(model, groups[rank], objective, longstraw=config_of(case, cp_size, world),
                           ref_model=ref_model, cp_group=cp_group, ep_group=ep_group)
    own = _reference(full, groups[rank], case, objective, ref_model)
    everyone = own if case["layout"] == "cp" else [_reference(full, g, case, objective, ref_model) for g in groups]
    expected = {}
    for name, grad in own.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            total = grad if case["layout"] == "cp" else sum(g[name] for g in everyone if name in g)
            expected[name] = total[experts.start:experts.stop]
        else:
            expected[name] = grad
    torch.save({"grads": _grads(model), "expected": expected, "loss": result.loss, "logprobs": result.logprobs,
                "experts": (experts.start, experts.stop), "ep": result.extras["ep"],
                "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"{case['name']}.rank{rank}.pt"))


def _record_indivisible(world, ep_group, out_dir, rank):
    """shard_experts' refusal of 6 experts over an EP group they do not divide (4 ranks; 2 divide them)."""
    from glm_models import tiny_glm_moe_dsa

    from ds_longstraw import shard_experts

    model = tiny_glm_moe_dsa(n_routed_experts=6, n_group=2, topk_group=1)
    try:
        message = f"sharded: {shard_experts(model, ep_group)}"
    except ValueError as error:
        message = str(error)
    with open(os.path.join(out_dir, f"indivisible.rank{rank}.txt"), "w") as handle:
        handle.write(message)


# generate on the sharded model: eos ids that stop samples at different steps on different ranks
GENERATE_EOS = list(range(0, 97, 4))


def _record_generate(world, ep_group, out_dir, rank):
    """generate with the experts sharded: "dp", rank r its own prompt (30 + 7 r tokens) and 3 - r % 2 samples,
    batched and one at a time, in lockstep over the EP group (the default: no dp_group); "cp", one prompt sharded
    over the same ranks (cp_size = ep_size = N). Beside each, single-process generate on the unsharded model."""
    from glm_models import tiny_glm_moe_dsa

    from ds_longstraw import generate, shard_experts

    model = tiny_glm_moe_dsa(seed=5, **EP_MODEL)
    full = copy.deepcopy(model)
    shard_experts(model, ep_group)
    config = {"capture_chunk": 8, "page_tokens": 4}
    prompt = torch.randint(0, 97, (30 + 7 * rank,), generator=torch.Generator().manual_seed(40 + rank))
    shared = torch.randint(0, 97, (41,), generator=torch.Generator().manual_seed(50))
    out = {}
    for name, batched in (("dp-batched", True), ("dp-each", False)):
        kwargs = dict(eos_token_id=GENERATE_EOS, seed=rank, batched=batched)
        out[name] = (generate(model, prompt, 3 - rank % 2, 6, longstraw=dict(config, ep_size=world), **kwargs),
                     generate(full, prompt, 3 - rank % 2, 6, longstraw=config, **kwargs))
    kwargs = dict(eos_token_id=GENERATE_EOS, seed=9)
    out["cp"] = (generate(model, shared, 3, 6, longstraw=dict(config, ep_size=world, cp_size=world), cp_group=ep_group,
                          **kwargs),
                 generate(full, shared, 3, 6, longstraw=config, **kwargs))
    record = {name: {"ids": [x.tolist() for x in got.response_ids], "ref_ids": [x.tolist() for x in want.response_ids],
                     "logprob_diff": max(float((a - b).abs().max())
                                         for a, b in zip(got.logprobs, want.logprobs, strict=True))}
              for name, (got, want) in out.items()}
    torch.save(record, os.path.join(out_dir, f"generate.rank{rank}.pt"))


def worker(rank, world, cases, out_dir):
    """One rank of run_ep (inside fork_ranks' process group)."""
    from glm_models import glm_reference

    ep_group = dist.new_group(list(range(world)), backend="gloo")
    with glm_reference():
        for case in cases:
            if world in case.get("worlds", (world,)):
                _run_case(case, world, ep_group, out_dir, rank)
        _record_generate(world, ep_group, out_dir, rank)
    _record_indivisible(world, ep_group, out_dir, rank)


def run_ep(world, cases, out_dir, timeout=600):
    """Fork `world` ranks, run `cases`, return {case name: [results by rank]}; raise with the ranks' tracebacks."""
    fork_ranks(world, worker, (cases, out_dir), out_dir, timeout, what="EP run")
    return {case["name"]: [torch.load(os.path.join(out_dir, f"{case['name']}.rank{r}.pt"), weights_only=False)
                           for r in range(world)] for case in cases if world in case.get("worlds", (world,))}
