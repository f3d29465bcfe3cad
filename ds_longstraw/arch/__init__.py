"""Architecture adapters: one per model family, chosen from the model's config.

Each family module declares what its layers retain (`state_specs(config, dtype)`, specs.py) from a config alone;
a family with an adapter also runs its layers for the transaction.
"""

from . import glm_moe_dsa, qwen3_5
from .glm_moe_dsa import GlmMoeDsaAdapter
from .qwen3_5 import Qwen35Adapter

# model_type -> adapter. qwen3_5_text is the text-only config of Qwen3_5ForCausalLM.
ADAPTERS = {"qwen3_5": Qwen35Adapter, "qwen3_5_text": Qwen35Adapter, "glm_moe_dsa": GlmMoeDsaAdapter}
# model_type -> state_specs(config, dtype): every family the planner can size
STATE_SPECS = {"qwen3_5": qwen3_5.state_specs, "qwen3_5_text": qwen3_5.state_specs,
               "glm_moe_dsa": glm_moe_dsa.state_specs}


FAMILIES = {"qwen3_5": qwen3_5, "qwen3_5_text": qwen3_5, "glm_moe_dsa": glm_moe_dsa}  # model_type -> module


def lora_targets(model_type) -> list | None:
    """The family's default LoRA target modules (None: it declares none)."""
    family = FAMILIES.get(model_type)
    return list(family.LORA_TARGETS) if family is not None and hasattr(family, "LORA_TARGETS") else None


def zero3_leaf_modules(model) -> list:
    """Module classes of `model` that ZeRO-3 should gather whole, as its family declares (none by default)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = FAMILIES.get(getattr(getattr(base, "config", None), "model_type", None))
    return family.zero3_leaf_modules(model) if family is not None and hasattr(family, "zero3_leaf_modules") else []


def config_fields(model_type, fields) -> dict:
    """A shape config's fields with the family's shorthands expanded (say qwen3_5's full_attention_interval)."""
    family = FAMILIES.get(model_type)
    return family.config_fields(fields) if family is not None and hasattr(family, "config_fields") else dict(fields)


def expert_shape(config) -> dict | None:
    """The routed experts of a model of `config` as the planner sizes them (offload/plan.MoEShape's fields), or
    None where its family has no routed experts."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family.expert_shape(config) if family is not None and hasattr(family, "expert_shape") else None


def kernel_dims(config) -> dict:
    """The sizes the kernels' workspaces scale with (offload/plan.ModelShape's vocab_size, hidden_size,
    attention_heads, attention_head_dim, attention_kv_heads, delta_heads, delta_head_dims), as the model's family
    declares them."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family.kernel_dims(config) if family is not None and hasattr(family, "kernel_dims") else {}


def adapter_for(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type](model)


def specs_for_config(config, dtype) -> list:
    """The layer-state specs of a model of `config` computing in `dtype` (no weights needed)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in STATE_SPECS:
        raise ValueError(f"model_type {model_type!r}: the planner knows {sorted(STATE_SPECS)}")
    return STATE_SPECS[model_type](config, dtype)


def _family_of(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return FAMILIES.get(getattr(getattr(base, "config", None), "model_type", None))


def shard_experts(model, ep_group, gather=None) -> range:
    """Keep only this rank's contiguous slice of every MoE layer's routed experts (rank r of E owns experts
    [r n/E, (r+1) n/E)); returns that range. ValueError when E does not divide n or the model has no routed
    experts."""
    family = _family_of(model)
    if family is None or not hasattr(family, "shard_experts"):
        raise ValueError("shard_experts: the model has no routed experts (no MoE layer)")
    return family.shard_experts(model, ep_group, gather)


def expert_parallel(model):
    """The parallel.experts.ExpertParallel the model's experts are sharded with, or None."""
    family = _family_of(model)
    return family.expert_parallel(model) if family is not None and hasattr(family, "expert_parallel") else None


def unregister_expert_slices(model) -> dict:
    """{qualified name: slice} of the sharded experts, taken out of the module's registered parameters."""
    return _family_of(model).unregister_slices(model)
