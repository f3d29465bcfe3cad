"""Run ds_longstraw.generate on 2 forked gloo ranks with the prompt sharded over a CP group; collect each rank's
rollouts in files.

`run_rollouts(cases, out_dir)` forks WORLD processes that join one gloo process group, build the CP group with
new_group (not the default group: generate must use the group it is given), run every case and write
`<case>.rank<r>.pt` with the rank's response ids, log-probs, finished flags and seed. Forking reuses the parent's
imports (as tests/cp_scripts/harness.py does, whose fork_ranks this uses).

A case is a dict: name, family ("qwen3_5" or "glm_moe_dsa"), prompt_len, samples, max_new, config (the longstraw
block without cp_size), and generate's keyword arguments in `sampling` (temperature, top_p, eos_token_id, seed,
max_turns); a case with `environment` (tests/turn_envs.ToolTable's arguments) decodes multi-turn.
A case with `rewards` also trains on its rollouts (case_train): generate(keep_capture=True), then grpo_backward on
rollouts.group(rewards) with capture=rollouts; the rank's file then holds the parameter gradients too.
"""

import os

import torch
import torch.distributed as dist

from .harness import fork_ranks

WORLD = 2


def case_model(case):
    """(model, the float64 reference mode it runs under) of a case: tests/models.py or tests/glm_models.py."""
    if case["family"] == "glm_moe_dsa":
        from glm_models import glm_reference, tiny_glm_moe_dsa

        return tiny_glm_moe_dsa(), glm_reference
    from models import float64_model, tiny_qwen3_5

    return tiny_qwen3_5(**case.get("model", {})), float64_model


def case_prompt(case):
    return torch.randint(0, 97, (case["prompt_len"],), generator=torch.Generator().manual_seed(case.get("seed", 0)))


def case_rollouts(case, cp_size=1, cp_group=None):
    """generate() of the case on this rank (cp_size 1 and no group: the single-process reference)."""
    from ds_longstraw import generate

    model, reference = case_model(case)
    sampling = dict(case["sampling"])
    if "environment" in case:  # a multi-turn case: tests/turn_envs.ToolTable's arguments
        from turn_envs import ToolTable

        sampling["environment"] = ToolTable(**case["environment"])
    with reference():
        return generate(model, case_prompt(case), case["samples"], case["max_new"], longstraw=dict(case["longstraw"],
                        cp_size=cp_size), cp_group=cp_group, **sampling)


def case_train(case, cp_size=1, cp_group=None, reuse=True):
    """(rollouts, {name: grad}, the transaction's result) of the case's on-policy step on this rank: generate, then
    grpo_backward on rollouts.group(case["rewards"]) with the capture reused (reuse) or captured again."""
    from ds_longstraw import GRPOObjective, generate, grpo_backward

    model, reference = case_model(case)
    config = dict(case["longstraw"], cp_size=cp_size)
    with reference():
        rollouts = generate(model, case_prompt(case), case["samples"], case["max_new"], longstraw=config,
                            cp_group=cp_group, keep_capture=reuse, **case["sampling"])
        model.zero_grad(set_to_none=True)
        result = grpo_backward(model, rollouts.group(case["rewards"]), GRPOObjective(), longstraw=config,
                               cp_group=cp_group, capture=rollouts if reuse else None)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return rollouts, grads, result


def worker(rank, world, cases, out_dir):
    """One rank of run_rollouts (inside fork_ranks' process group). A case without rewards runs generate on a
    CPContext of the group, whose traffic counts the token exchanges (op "rollout_token") it made and names what
    the decode phase exchanged."""
    from ds_longstraw.parallel.groups import CPContext

    group = dist.new_group(list(range(world)), backend="gloo")
    for case in cases:
        grads = extras = exchanges = decode_ops = None
        if "rewards" in case:
            result, grads, trained = case_train(case, world, group)
            extras = {"capture_reused": trained.extras["capture_reused"], "phases": sorted(trained.phases)}
        else:
            cp = CPContext(group)
            result = case_rollouts(case, world, cp)
            exchanges = sum(n for (_, _, op), n in cp.traffic.messages.items() if op == "rollout_token")
            decode_ops = sorted({op for (phase, _, op) in cp.traffic.received if phase == "decode"})
        torch.save({"response_ids": result.response_ids, "logprobs": result.logprobs,
                    "finished": result.finished, "seed": result.seed, "grads": grads, "extras": extras,
                    "response_masks": result.response_masks, "turns": result.turns,
                    "token_exchanges": exchanges, "decode_ops": decode_ops},
                   os.path.join(out_dir, f"{case['name']}.rank{rank}.pt"))


def run_rollouts(cases, out_dir, timeout=600):
    """Fork WORLD ranks, run `cases`; return {case name: [results by rank]}; raise with the ranks' tracebacks."""
    fork_ranks(WORLD, worker, (cases, out_dir), out_dir, timeout, what="rollouts")
    return {case["name"]: [torch.load(os.path.join(out_dir, f"{case['name']}.rank{r}.pt"), weights_only=False)
                           for r in range(WORLD)] for case in cases}
