"""Masked groups (GRPOGroup.response_masks) under context parallelism: CP 2 and CP 3 in ONE launch of 3 ranks.

The three forked ranks join one gloo process group and create two CP groups: {0, 1, 2} (CP 3) and {0, 1} (CP 2;
rank 2 waits at the barrier while those cases run). Every case runs on both; each rank writes
`<case>.cp<N>.rank<r>.pt` with its gradients, loss and log-probs. Ranks are forked like tests/cp_scripts/harness.py
(the parent's imports are reused), whose port and group helpers this uses.

A case is a dict: name, prompt_len, members [(response length, [(lo, hi) context-only spans])], mode, chunk, page,
block, optional objective kwargs, optional ref_seed (KL to a separate reference model), optional tier ("cpu" or
"nvme": page files under <out_dir>/nvme), optional seed.
"""

import os

import torch
import torch.distributed as dist

from .harness import fork_ranks, nvme_dir

# As test_cp_transaction.py: attention layers before GDN layers, so prompt attention feeds later state.
MODEL = dict(layers=5, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                                    "linear_attention"])
CP_SIZES = (2, 3)
WORLD = max(CP_SIZES)


def case_group(case):
    from masked_loss import masked_group

    return masked_group(case["prompt_len"], case["members"], seed=case.get("seed", 0))


def _config(case, cp_size, out_dir):
    config = {"prefix_grad": case["mode"], "capture_chunk": case["chunk"], "page_tokens": case["page"],
              "replay_block": case["block"], "cp_size": cp_size, **case.get("longstraw", {})}
    if "tier" in case:
        config["offload"] = {"tier": case["tier"]}
        if case["tier"] == "nvme":
            config["offload"]["nvme_path"] = nvme_dir(out_dir)
    return config


def _run_case(case, cp_size, cp_group, out_dir, rank):
    from models import float64_model, tiny_qwen3_5

    from ds_longstraw import GRPOObjective, grpo_backward
    from ds_longstraw.parallel import CPContext

    model = tiny_qwen3_5(**MODEL)
    ref_model = tiny_qwen3_5(seed=case["ref_seed"], **MODEL) if "ref_seed" in case else None
    group = case_group(case)
    model.zero_grad(set_to_none=True)
    with float64_model():
        result = grpo_backward(model, group, GRPOObjective(**case.get("objective", {})),
                               longstraw=_config(case, cp_size, out_dir), ref_model=ref_model,
                               cp_group=CPContext(cp_group))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"grads": grads, "loss": result.loss, "logprobs": result.logprobs,
                "members_in_steps": result.extras["members_in_steps"]},
               os.path.join(out_dir, f"{case['name']}.cp{cp_size}.rank{rank}.pt"))


def worker(rank, world, cases, out_dir):
    """One rank of run_masks (inside fork_ranks' process group): CP 3 on every rank, CP 2 on the first two."""
    groups = {size: dist.new_group(list(range(size)), backend="gloo") for size in CP_SIZES}  # collective
    for size in CP_SIZES:
        if rank < size:
            for case in cases:
                _run_case(case, size, groups[size], out_dir, rank)
        dist.barrier()


def run_masks(cases, out_dir, timeout=600):
    """Fork WORLD ranks, run every case on CP 2 and CP 3; return {(case name, cp size): [results by rank]}."""
    fork_ranks(WORLD, worker, (cases, out_dir), out_dir, timeout, what="masked CP run")
    return {(case["name"], size): [torch.load(os.path.join(out_dir, f"{case['name']}.cp{size}.rank{r}.pt"),
                                              weights_only=False) for r in range(size)]
            for case in cases for size in CP_SIZES}
