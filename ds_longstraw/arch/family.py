"""One entry per model family: everything the package asks of a family outside its adapter, in one dataclass.

A family module (qwen3_5.py, glm_moe_dsa.py) ends with its FAMILY; arch/__init__.py keys them by the model types
transformers gives its configs. A hook a family does not have is None, and the registry's functions say what that
means (no LoRA targets, no ZeRO-3 leaves, no routed experts), so no caller probes a module for attributes.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """name: the family (its module's name); model_types: the config model types it serves; adapter: its
    CausalLMAdapter class; state_specs(config, dtype) -> the layer-state specs (specs.py) from a config alone;
    kernel_dims(config) -> the sizes the kernels' workspaces scale with; config_fields(fields) -> a shape config's
    fields with the family's shorthands expanded; lora_targets: default LoRA target modules;
    zero3_leaf_modules(model) -> module classes ZeRO-3 should gather whole; expert_shape(config) -> the routed
    experts as the planner sizes them; shard_experts(model, group, gather), expert_parallel(model) and
    unregister_slices(model): expert parallelism (parallel/experts.py); replay_graph(config, dtype_bytes) ->
    {"lora" | "full": (bytes per response token, bytes per member)} a replayed member's autograd graph keeps
    (qwen3_5_graph.py), for the planner."""

    name: str
    model_types: tuple[str, ...]
    adapter: type
    state_specs: Callable
    kernel_dims: Callable
    config_fields: Callable | None = None
    lora_targets: tuple[str, ...] | None = None
    zero3_leaf_modules: Callable | None = None
    expert_shape: Callable | None = None
    shard_experts: Callable | None = None
    expert_parallel: Callable | None = None
    unregister_slices: Callable | None = None
    replay_graph: Callable | None = None
