"""LoRA / QLoRA policies through peft.

Only the adapter parameters train; the base weights are frozen (and, under ZeRO-3, still partitioned and gathered
module by module like any other weight). The reference policy of the KL term is the same module with its adapters
disabled (`grpo_backward` enters `model.disable_adapter()`): no second copy of the weights.

LoRA dropout must be 0 for the transaction: capture, replay and exact mode's prefix pass run the same tokens more
than once and must see the same function each time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch import lora_targets

if TYPE_CHECKING:
    from peft import PeftModel


def apply_lora(model: torch.nn.Module, r: int = 16, alpha: float = 32, dropout: float = 0.0,
               target_modules: Iterable[str] | None = None, seed: int | None = None) -> PeftModel:
    """Wrap `model` in a peft LoRA model; returns the PeftModel (only adapter parameters require grad).

    seed: when given, the adapter initialisation draws from this seed (so every rank builds the same adapters)."""
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise ValueError(f"lora.r must be > 0, got {r}")
    if dropout != 0.0:
        raise ValueError(f"lora.dropout = {dropout}: must be 0 (capture, replay and the prefix pass re-run tokens "
                         "and must see the same function every time)")
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    targets = list(target_modules) if target_modules else lora_targets(model_type)
    if not targets:
        raise ValueError(f"no default LoRA target modules for model type {model_type!r}: set lora.target_modules")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    if seed is not None:
        torch.manual_seed(seed)
    return get_peft_model(model, config)


def adapter_parameter_names(model: torch.nn.Module) -> list:
    """Names of the parameters that train (peft's adapters): everything with requires_grad."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _count(p: torch.Tensor) -> int:
    """Parameters a tensor stands for: the full count under ZeRO-3 partitioning, and a 4-bit weight's unpacked
    count (bitsandbytes packs two codes a byte into a tensor of another shape; its quant_state has the real one)."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:
        return int(torch.Size(quant_state.shape).numel())
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()


def trainable_summary(model: torch.nn.Module) -> dict:
    trainable = sum(_count(p) for p in model.parameters() if p.requires_grad)
    total = sum(_count(p) for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total}
