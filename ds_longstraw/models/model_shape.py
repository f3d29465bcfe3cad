"""A model's shape for planning, read from its layer-state specs (arch/specs.py) and its config alone.

The built-in names are the shape configs in configs/models/ (the one definition of each published shape, shipped in
the package as ds_longstraw.configs: modeling.MODELS_DIR); any transformers config.json of a family the architecture
package knows works too. Parameters are counted on the meta
device (nothing allocated).
"""

import json
import os

import torch

from ds_longstraw.arch import expert_shape, kernel_dims, replay_graph, specs_for_config
from ds_longstraw.arch.specs import combine_rule
from ds_longstraw.models.modeling import MODELS_DIR, config_from_shape, parameter_count
from ds_longstraw.offload.state_shape import ModelShape, MoEShape

BUILTIN = {"qwen3.6-27b": "qwen3_6_27b.yaml", "glm-5.2": "glm_5_2.yaml"}
_DTYPES = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}
_DTYPE_NAMES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def load_config(model: str):
    """(name, transformers config) of a built-in name or the path of a config.json (a multimodal config's
    text_config is used)."""
    if model in BUILTIN:
        return model, config_from_shape(MODELS_DIR / BUILTIN[model])
    if not os.path.isfile(model):
        raise ValueError(f"model {model!r} is neither a built-in shape ({sorted(BUILTIN)}) nor a config file")
    with open(model) as handle:
        fields = json.load(handle)
    if "text_config" in fields and "num_hidden_layers" not in fields:
        fields = {**fields["text_config"], "dtype": fields.get("dtype", fields["text_config"].get("dtype"))}
    name = os.path.basename(os.path.dirname(os.path.abspath(model))) or model
    return name, config_from_shape(fields)


def _dtype_bytes(config, override):
    if override is not None:
        if override not in _DTYPES:
            raise ValueError(f"--dtype-bytes {override}: expected one of {sorted(_DTYPES)}")
        return override
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    return _DTYPE_NAMES.get(str(dtype).replace("torch.", ""), 2)


def shape_from_config(name: str, config, dtype_bytes: int | None = None, parameters: bool = True) -> ModelShape:
    """The planner's view of a model: bytes per token by label, per-sequence carry, kept attention, parameters,
    routed experts (the family's expert_shape; None where it has none). parameters=False leaves params 0 and builds
    no model on the meta device (a transaction's own rules read only the per-token state)."""
    if isinstance(config, dict):
        config = config_from_shape(config)
    e = _dtype_bytes(config, dtype_bytes)
    specs = specs_for_config(config, _DTYPES[e])
    shape = ModelShape(name=name, family=config.model_type, dtype_bytes=e)
    for spec in specs:
        shape.layer_counts[spec.kind] = shape.layer_counts.get(spec.kind, 0) + 1
        shape.combine_counts[spec.combine] = shape.combine_counts.get(spec.combine, 0) + 1
        if spec.select:
            shape.selecting += (spec.layer,)
        elif spec.reuses_selection:
            shape.reusing += (spec.layer,)
        labels = set()
        for stream in spec.streams:
            label = spec.stream_label(stream)
            shape.page_bytes_per_token[label] = shape.page_bytes_per_token.get(label, 0) + stream.bytes_per_token
            labels.add(label)
            if stream.grad:
                shape.grad_bytes_per_token += stream.bytes_per_token
        for label in labels:
            shape.page_layers[label] = shape.page_layers.get(label, 0) + 1
        shape.staged_layer_bytes_per_token = max(shape.staged_layer_bytes_per_token, spec.bytes_per_token)
        if spec.carry:
            shape.carry_bytes[spec.label] = shape.carry_bytes.get(spec.label, 0) + spec.carry_bytes
            shape.carry_layers[spec.label] = shape.carry_layers.get(spec.label, 0) + 1
        if spec.kept:
            shape.kept_bytes_per_token += spec.kept_bytes_per_token
            shape.kept_layers += 1
    shape.kept_last_bytes_per_token = specs[-1].kept_bytes_per_token if specs else 0
    shape.not_layer_major = tuple(sorted(name for name in shape.combine_counts if not combine_rule(name).layer_major))
    shape.kind_costs = {name: combine_rule(name).cost for name in shape.combine_counts}
    shape.params = parameter_count(config) if parameters else 0
    for name, value in kernel_dims(config).items():  # what the kernels' workspaces scale with
        setattr(shape, name, value)
    experts = expert_shape(config)
    shape.moe = MoEShape(**experts) if experts else None
    shape.replay_graph = replay_graph(config, e)
    return shape

