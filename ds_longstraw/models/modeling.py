"""Building the policy: from a model shape config (random weights, no hub access) or from a local checkpoint.

A shape config is a YAML (or dict) of transformers config fields plus `model_type`, and shorthands a family
defines (ds_longstraw.arch: qwen3_5's `full_attention_interval`, which becomes `layer_types`). See configs/models/.

Under ZeRO-3 a big model must be partitioned as it is built (no rank could hold a whole 27B model): the model is
then constructed inside transformers' DeepSpeed integration (`HfDeepSpeedConfig`, which enters
`deepspeed.zero.Init`), for random weights and for from_pretrained alike. zero_init "auto" does that for
checkpoints and for shapes above `ZERO_INIT_ABOVE` parameters; small random models are built whole on every rank
from the same seed (so a single-process reference builds the very same weights).
"""

from __future__ import annotations

import os
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

ZERO_INIT_ABOVE = 1 << 30  # parameters
# configs/ of the checkout, which the package ships as ds_longstraw.configs (pyproject's package-dir mapping). Found
# through the import system: the checkout's folder under an editable install, the installed copy from a wheel. pip
# installs it on the file system, so this is a pathlib.Path that open() and OmegaConf.load take.
CONFIGS_DIR = resources.files("ds_longstraw.configs")
MODELS_DIR = CONFIGS_DIR / "models"  # the shape configs (one per shape)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def as_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"model.dtype = {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_shape(shape: dict[str, Any] | str | os.PathLike[str]) -> dict:
    """A shape config as a plain dict (from a dict or a YAML path)."""
    if isinstance(shape, (str, os.PathLike)):
        from omegaconf import OmegaConf

        shape = OmegaConf.to_container(OmegaConf.load(os.fspath(shape)), resolve=True)
    if not isinstance(shape, dict):
        raise ValueError(f"a model shape must be a dict or a YAML path, got {type(shape).__name__}")
    return dict(shape)


def config_from_shape(shape: dict[str, Any] | str | os.PathLike[str]) -> PretrainedConfig:
    """transformers config for a shape config (dict or YAML path)."""
    from transformers import AutoConfig

    from ds_longstraw.arch import config_fields

    fields = load_shape(shape)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("model shape needs 'model_type' (say qwen3_5_text)")
    fields = config_fields(model_type, fields)  # the family's shorthands (arch/)
    fields.pop("name", None)
    return AutoConfig.for_model(model_type, **fields)


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of a model built from `config`, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _zero3(ds_config: dict[str, Any] | None) -> bool:
    zero = (ds_config or {}).get("zero_optimization") or {}
    return isinstance(zero, dict) and zero.get("stage") == 3


def four_bit_config(dtype: torch.dtype) -> BitsAndBytesConfig:
    """transformers' bitsandbytes config for NF4 base weights (QLoRA) computing in `dtype`.

    The packed 4-bit codes are stored in tensors of `dtype` (bnb_4bit_quant_storage): a DeepSpeed engine in bf16 or
    fp16 casts the module's floating-point parameters to its dtype, which is then a no-op on the codes. (uint8
    storage also partitions and gathers correctly under ZeRO-3 on a float32 engine here.)"""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError("lora.qlora needs bitsandbytes (pip install 'ds_longstraw[qlora]')") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def four_bit_layers(model: torch.nn.Module) -> list:
    """The model's bitsandbytes 4-bit linear layers (none where bitsandbytes is not installed)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, Linear4bit)]


def keep_four_bit_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPUs with AVX512-BF16, bitsandbytes rewrites a Linear4bit's weight in place, on its first graph-free forward
    in eval mode, into an inference layout with bf16 block scales (bitsandbytes 0.50, Linear4bit.forward). In a
    transaction that first forward is the prompt capture: capture would then compute with other weights than
    replay, and under ZeRO-3 the rewrite would land on a gathered copy that the release discards while the layout
    flag stays set on the shared quantization state."""
    for module in four_bit_layers(model):
        module.support_avx512bf16_for_cpu = False
    return model


def accept_saved_quant_state(model: torch.nn.Module) -> torch.nn.Module:
    """Let a 4-bit model load state dicts that it saved itself (DeepSpeed checkpoints of a QLoRA run).

    bitsandbytes writes each 4-bit weight's quantization state beside it (`<weight>.absmax`, `.quant_map`,
    `.quant_state.*`) but its modules do not take those keys back, so a strict load fails on them. The frozen 4-bit
    weights of a resumed run come from model.pretrained again; the saved block scales are compared with the
    loaded ones (a checkpoint of another base is an error naming the layer) and then dropped."""
    for module in four_bit_layers(model):
        def take_quant_state(state_dict: dict[str, torch.Tensor], prefix: str, *args: Any,
                             _module: torch.nn.Module = module) -> None:
            saved = {key: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix + "weight.")]}
            absmax = saved.get(prefix + "weight.absmax")
            ours = getattr(_module.weight, "quant_state", None)
            if absmax is not None and ours is not None and (
                    absmax.shape != ours.absmax.shape or not torch.equal(absmax.to(ours.absmax), ours.absmax)):
                raise ValueError(f"checkpoint entry {prefix}weight: its 4-bit block scales differ from those of the "
                                 "loaded base; it was saved over another model.pretrained")

        module._register_load_state_dict_pre_hook(take_quant_state)
    return model


def build_model(shape: dict[str, Any] | str | os.PathLike[str] | None = None,
                pretrained: str | os.PathLike[str] | None = None, dtype: str | torch.dtype = "float32",
                seed: int = 0, ds_config: dict[str, Any] | None = None, zero_init: bool | Literal["auto"] = "auto",
                attn_implementation: str = "sdpa", four_bit: bool = False) -> PreTrainedModel:
    """The policy model (a transformers causal LM). Exactly one of `shape` (random weights from `seed`) and
    `pretrained` (a local checkpoint directory) must be given; ds_config: the DeepSpeed config dict (for ZeRO-3
    construction-time partitioning); four_bit: load the linear layers' weights as NF4 (QLoRA base; checkpoints
    only). A 4-bit model is loaded whole on every rank (transformers builds quantized models outside
    `deepspeed.zero.Init`) and partitioned when the engine is created: an eighth of the float32 bytes meanwhile."""
    from transformers import AutoModelForCausalLM

    if (shape is None) == (pretrained is None):
        raise ValueError("give exactly one of model.shape (random weights) and model.pretrained (a local path)")
    if four_bit and pretrained is None:
        raise ValueError("lora.qlora loads 4-bit weights from a checkpoint: set model.pretrained (model.shape "
                         "builds random full-precision weights)")
    dtype = as_dtype(dtype)
    if zero_init not in ("auto", True, False):
        raise ValueError(f"model.zero_init = {zero_init!r}: expected auto, true or false")
    config = None if pretrained is not None else config_from_shape(shape)
    if zero_init == "auto":
        zero_init = _zero3(ds_config) and (pretrained is not None or parameter_count(config) > ZERO_INIT_ABOVE)
    elif zero_init and not _zero3(ds_config):
        raise ValueError("model.zero_init = true needs zero_optimization.stage = 3 in the DeepSpeed config")
    hf_ds_config = None
    if zero_init:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 -- must stay alive while the model is built
    torch.manual_seed(seed)
    if pretrained is not None:
        if not os.path.isdir(pretrained):
            raise ValueError(f"model.pretrained = {pretrained!r} is not a local directory (no hub access)")
        extra = {"quantization_config": four_bit_config(dtype)} if four_bit else {}
        model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype, attn_implementation=attn_implementation,
                                                     **extra)
        if four_bit:
            accept_saved_quant_state(keep_four_bit_layout(model))
    else:
        config._attn_implementation = attn_implementation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if not zero_init:  # partitioned parameters are built in `dtype` already; .to would touch only stubs
            model = model.to(dtype)
    model.config.use_cache = False
    return model
