"""Architecture adapters: one per model family, chosen from the model's config."""

from .qwen3_5 import Qwen35Adapter

# model_type -> adapter. qwen3_5_text is the text-only config of Qwen3_5ForCausalLM.
ADAPTERS = {"qwen3_5": Qwen35Adapter, "qwen3_5_text": Qwen35Adapter}


def adapter_for(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type](model)
