"""Architecture adapters: one per model family, chosen from the model's config.

Each family module declares what its layers retain (`state_specs(config, dtype)`, specs.py) from a config alone,
runs its layers for the transaction through its adapter, and ends with its registry entry (family.Family): the one
place the rest of the package learns what a family has.
"""

from . import glm_moe_dsa, qwen3_5
from .contract import check_contract
from .family import Family
from .glm_moe_dsa import GlmMoeDsaAdapter
from .qwen3_5 import Qwen35Adapter

# model_type -> its family (qwen3_5_text is the text-only config of Qwen3_5ForCausalLM)
FAMILIES: dict[str, Family] = {t: family for family in (qwen3_5.FAMILY, glm_moe_dsa.FAMILY)
                               for t in family.model_types}

__all__ = ["FAMILIES", "Family", "GlmMoeDsaAdapter", "Qwen35Adapter", "adapter_for", "config_fields",
           "expert_parallel", "expert_shape", "kernel_dims", "lora_targets", "replay_graph", "shard_experts",
           "specs_for_config", "unregister_expert_slices", "zero3_leaf_modules"]


def _model_type(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper, or the model
    return getattr(getattr(base, "config", None), "model_type", None)


def _family_of(model) -> Family | None:
    return FAMILIES.get(_model_type(model))


def lora_targets(model_type) -> list | None:
    """The family's default LoRA target modules (None: it declares none)."""
    family = FAMILIES.get(model_type)
    return None if family is None or family.lora_targets is None else list(family.lora_targets)


def zero3_leaf_modules(model) -> list:
    """Module classes of `model` that ZeRO-3 should gather whole, as its family declares (none by default)."""
    family = _family_of(model)
    return [] if family is None or family.zero3_leaf_modules is None else family.zero3_leaf_modules(model)


def config_fields(model_type, fields) -> dict:
    """A shape config's fields with the family's shorthands expanded (say qwen3_5's full_attention_interval)."""
    family = FAMILIES.get(model_type)
    return dict(fields) if family is None or family.config_fields is None else family.config_fields(fields)


def expert_shape(config) -> dict | None:
    """The routed experts of a model of `config` as the planner sizes them (offload/plan.MoEShape's fields), or
    None where its family has no routed experts."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return None if family is None or family.expert_shape is None else family.expert_shape(config)


def kernel_dims(config) -> dict:
    """The sizes the kernels' workspaces scale with (offload/plan.ModelShape's vocab_size, hidden_size,
    attention_heads, attention_head_dim, attention_kv_heads, delta_heads, delta_head_dims), as the model's family
    declares them."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return {} if family is None else family.kernel_dims(config)


def replay_graph(config, dtype_bytes: int) -> dict:
    """{"lora" | "full": (bytes per response token, bytes per member)} of one replayed member's autograd graph, as
    the model's family declares it; {} where it declares none (the planner then says it is not counted)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return {} if family is None or family.replay_graph is None else family.replay_graph(config, dtype_bytes)


def adapter_for(model):
    family = _family_of(model)
    if family is None:
        raise ValueError(f"unsupported architecture {_model_type(model)!r}; supported: {sorted(FAMILIES)}")
    adapter = family.adapter(model)
    check_contract(adapter)  # a family missing what its layers' cross-rank code calls says so before any work
    return adapter


def specs_for_config(config, dtype) -> list:
    """The layer-state specs of a model of `config` computing in `dtype` (no weights needed)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r}: the planner knows {sorted(FAMILIES)}")
    return FAMILIES[model_type].state_specs(config, dtype)


def shard_experts(model, ep_group, gather=None) -> range:
    """Keep only this rank's contiguous slice of every MoE layer's routed experts (rank r of E owns experts
    [r n/E, (r+1) n/E)); returns that range. ValueError when E does not divide n or the model has no routed
    experts."""
    family = _family_of(model)
    if family is None or family.shard_experts is None:
        raise ValueError("shard_experts: the model has no routed experts (no MoE layer)")
    return family.shard_experts(model, ep_group, gather)


def expert_parallel(model):
    """The parallel.experts.ExpertParallel the model's experts are sharded with, or None."""
    family = _family_of(model)
    return None if family is None or family.expert_parallel is None else family.expert_parallel(model)


def unregister_expert_slices(model) -> dict:
    """{qualified name: slice} of the sharded experts, taken out of the module's registered parameters."""
    family = _family_of(model)
    if family is None or family.unregister_slices is None:
        raise ValueError("unregister_expert_slices: the model has no routed experts (no MoE layer)")
    return family.unregister_slices(model)
