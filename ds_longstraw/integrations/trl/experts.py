"""The trainer's MoE models under ZeRO-3 and expert parallelism ("longstraw": {"ep_size": E}).

ZeRO-3 gathers a MoE block whole only where its class is a leaf module (deepspeed.utils.set_z3_leaf_modules), and
DeepSpeed reads that flag when it builds an engine's hooks. TRL builds two engines: the reference model's inside
GRPOTrainer.__init__ (trl.models.prepare_deepspeed, beta > 0), the policy's when training starts (accelerate).
  leaves     `leaves_before_reference_engine` sets the family's leaf modules (arch.zero3_leaf_modules) on every
             model TRL hands prepare_deepspeed during __init__, just before it builds that engine; the trainer sets
             the policy's after __init__ (the policy's engine comes later).
  experts    with ep_size E > 1 the policy's routed experts leave ZeRO before accelerate builds its engine, as
             ds_longstraw.initialize does (engine/expert_slices.py): consecutive processes form EP groups
             (parallel/parallelism.py), each keeps its slice of every MoE block's experts, the slices are taken out
             of the module's registered parameters (TRL's optimizer and DeepSpeed never see them; the block is then
             no leaf), and once the engine exists the slices get their gradient reduction, an optimizer of the
             client optimizer's class and hyperparameters, and the engine's learning rate at each step
             (`attach_experts`). The reference model keeps whole experts (a ZeRO-3 leaf block): it is only scored.
What expert parallelism does not run here (refused by name before the model loads, `check_expert_parallel`): no
DeepSpeed; cp_size > 1; gradient clipping and fp16 (the engine's global norm and loss scale do not see the
slices); TRL's transformers generation, vLLM and generate_from_capture (they run the model's own MoE forward, or
sync its registered weights, and each process holds only its slice: give a rollout_func); evaluation (TRL's own
forward); TRL's checkpoints (its saved model misses the slices); top_entropy_quantile < 1 (the entropy pass's
dispatches would run on each process alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ds_longstraw.config import LongstrawConfig

BLOCK = "longstraw"


def set_leaf_modules(model: torch.nn.Module) -> None:
    """The model family's ZeRO-3 leaf modules (arch registry: glm_moe_dsa's MoE block), if it declares any."""
    import deepspeed

    from ds_longstraw.arch import zero3_leaf_modules

    leaves = zero3_leaf_modules(model)
    if leaves:
        deepspeed.utils.set_z3_leaf_modules(model, leaves)


@contextlib.contextmanager
def leaves_before_reference_engine() -> Iterator[None]:
    """While it lasts, TRL's prepare_deepspeed (the reference model's and reward models' ZeRO engines, built in
    GRPOTrainer.__init__) sets the model's leaf modules before building the engine. Restored on exit."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.prepare_deepspeed

    def prepare_deepspeed(model: Any, accelerator: Any) -> Any:
        if isinstance(model, torch.nn.Module) and accelerator.state.deepspeed_plugin.zero_stage == 3:
            set_leaf_modules(model)
        return original(model, accelerator)

    grpo_trainer.prepare_deepspeed = prepare_deepspeed
    try:
        yield
    finally:
        grpo_trainer.prepare_deepspeed = original


def _clipping(args: Any, ds_config: dict) -> float:
    """The gradient clipping the engine will run: the config's, args.max_grad_norm where it says "auto", DeepSpeed's
    default 1.0 where it says nothing."""
    value = ds_config.get("gradient_clipping", 1.0)
    return float(args.max_grad_norm or 0.0) if value == "auto" else float(value or 0.0)


def check_expert_parallel(args: Any, longstraw: LongstrawConfig, ds_config: dict | None, kwargs: dict,
                          generate_from_capture: bool) -> None:
    """ValueError naming every setting that expert parallelism does not run through the trainer (module
    docstring), all at once, before the model is loaded."""
    size = longstraw.ep_size
    if size == 1:
        return
    name = f"'{BLOCK}.ep_size' = {size}"
    if ds_config is None:
        raise ValueError(f"{name} needs DeepSpeed (GRPOConfig(deepspeed=...)): the expert slices reduce and step "
                         "beside its engine")
    fp16 = (ds_config.get("fp16") or {}).get("enabled", False) is True or bool(args.fp16)
    rollout_func = kwargs.get("rollout_func")
    eval_strategy, save_strategy = (getattr(value, "value", value) for value in (args.eval_strategy,
                                                                                 args.save_strategy))
    clipping = _clipping(args, ds_config)
    refused = [(setting, value, why) for setting, value, why, refuse in (
        (f"'{BLOCK}.cp_size'", longstraw.cp_size, "expert and context parallelism together are not run through the "
         "trainer yet", longstraw.cp_size > 1),
        ("world size", args.world_size, "ep_size must divide it", args.world_size % size != 0),
        ("gradient clipping (max_grad_norm or gradient_clipping)", clipping,
         "the engine's global norm does not see the expert slices: set max_grad_norm = 0", clipping > 0),
        ("fp16", True, "the expert slices are not loss-scaled: bf16 or float32", fp16),
        ("use_vllm", True, "vLLM's weight sync reads the registered experts, each process's slice", args.use_vllm),
        ("rollout_func", None, "TRL's transformers generation runs the model's own MoE forward over this process's "
         "slice: give one", rollout_func is None and not (args.use_vllm or generate_from_capture)),
        ("generate_from_capture", True, "its decode is not run with sharded experts yet", generate_from_capture),
        ("eval_strategy", eval_strategy, "evaluation runs TRL's own forward", eval_strategy != "no"),
        ("save_strategy", save_strategy, "TRL's saved model would miss the expert slices (engine.save_checkpoint "
         "and `longstraw export` keep them)", save_strategy != "no"),
        ("top_entropy_quantile", args.top_entropy_quantile, "its entropy pass runs each process's prompts alone, "
         "and the experts' dispatches are collectives", args.top_entropy_quantile < 1.0))
        if refuse]
    if refused:
        lines = "; ".join(f"{setting} = {value!r} ({why})" for setting, value, why in refused)
        raise ValueError(f"{name} (the policy's routed experts sharded over {size} processes): {lines}")


def shard_policy_experts(model: torch.nn.Module, longstraw: LongstrawConfig) -> tuple[Any, Any]:
    """(Parallelism, ExpertSlices): the EP groups (a collective: every process calls this alike) and the policy's
    expert slices taken out of ZeRO (engine/expert_slices.py), before accelerate builds the policy's engine."""
    from deepspeed import comm as dist

    from ds_longstraw.engine.expert_slices import ExpertSlices
    from ds_longstraw.parallel.parallelism import build_parallelism

    parallelism = build_parallelism(longstraw.cp_size, longstraw.ep_size)
    experts = ExpertSlices(model, parallelism.ep_group, parallelism.expert_dp_group, dist.get_world_size())
    return parallelism, experts


def attach_experts(engine: Any, experts: Any, weight_decay: float) -> None:
    """The expert slices join accelerate's engine (engine.grpo_step reduces and steps them): their data-parallel
    world, and an optimizer of the client optimizer's (TRL's) class and defaults, with TRL's weight decay (the
    slices are weights, in the decay group transformers' create_optimizer would have put them in)."""
    from deepspeed import comm as dist

    client = getattr(engine, "client_optimizer", None)
    experts.world = dist.get_world_size(group=engine.data_parallel_group)
    experts.make_optimizer(client if isinstance(client, torch.optim.Optimizer) else None, engine.config)
    if experts.optimizer is not None:
        for group in experts.optimizer.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = weight_decay
    engine.longstraw_experts = experts
