"""Model shapes for planning: what each layer type retains, in bytes, read from a transformers config.

Retained state (ARCHITECTURE.md, "Retained state"), per rank, for `tokens` prompt tokens on that rank:
  attention_kv_pages   full attention (qwen3_5): K and V per KV head, model dtype       tokens * 2 * Hkv * D * e
  gdn_state            Gated DeltaNet: recurrent state [Hv, dk, dv] (fp32; fp64 for fp64 models) and the conv
                       tail [conv_dim, kernel - 1] (model dtype); per sequence, not per token
  gdn_checkpoints      exact mode: gdn_state again at every capture-chunk start but the prompt's first
  mla_latent_pages     MLA (glm_moe_dsa): latent after norm (kv_lora_rank) + rope key (qk_rope_head_dim)
  indexer_key_pages    DSA indexer, "full" layers only (index_head_dim); "shared" layers reuse a selection
  gradient pages       exact mode: one gradient page per state page, same bytes
MoE / MLP layers retain nothing. Parameter counts (for the weights' share of device memory) are estimates from
the same config: projections, experts, embeddings; norms and biases are ignored (well under 0.1%).

Built-in shapes "qwen3.6-27b" and "glm-5.2" carry the figures of mission/NUMBERS.md. For glm-5.2 only the
number of "full" indexer layers (21 of 78) matters here; where they sit is illustrative.
"""

import json
import os
from dataclasses import dataclass, field

_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _qwen36_27b():
    layers = 64
    return {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": layers, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "tie_word_embeddings": False,
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        "dtype": "bfloat16",
    }


def _glm52():
    layers, full = 78, 21
    full_at = {round(k * layers / full) for k in range(full)}
    return {
        "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "v_head_dim": 256, "index_head_dim": 128, "index_n_heads": 32, "n_routed_experts": 256,
        "n_shared_experts": 1, "first_k_dense_replace": 3, "tie_word_embeddings": False,
        "indexer_types": ["full" if i in full_at else "shared" for i in range(layers)], "dtype": "bfloat16",
    }


BUILTIN = {"qwen3.6-27b": _qwen36_27b, "glm-5.2": _glm52}


@dataclass
class ModelShape:
    name: str
    family: str  # "qwen3_5" or "glm_moe_dsa"
    dtype_bytes: int
    state_dtype_bytes: int  # GDN recurrent state
    page_bytes_per_token: dict = field(default_factory=dict)  # layer type -> bytes per token, all layers of it
    layer_bytes_per_token: dict = field(default_factory=dict)  # layer type -> bytes per token of ONE layer
    layer_counts: dict = field(default_factory=dict)
    gdn_state_bytes: int = 0  # per sequence, all GDN layers
    kept_attention_bytes_per_token: int = 0  # exact mode's prefix_keep_attention: out + lse, all attention layers
    params: int = 0

    @property
    def bytes_per_token(self) -> int:
        return sum(self.page_bytes_per_token.values())

    @property
    def staged_layer_bytes_per_token(self) -> int:
        """Bytes per token of the largest layer's pages (every page type a layer can hold): one staged layer."""
        return sum(self.layer_bytes_per_token.values())


def load_config(model: str) -> tuple[str, dict]:
    """A built-in name, or the path of a transformers config.json (a multimodal config's text_config is used)."""
    if model in BUILTIN:
        return model, BUILTIN[model]()
    if not os.path.isfile(model):
        raise ValueError(f"model {model!r} is neither a built-in shape ({sorted(BUILTIN)}) nor a config file")
    with open(model) as handle:
        config = json.load(handle)
    if "text_config" in config and "layer_types" not in config:
        config = {**config["text_config"], "dtype": config.get("dtype", config["text_config"].get("dtype"))}
    return os.path.basename(os.path.dirname(os.path.abspath(model))) or model, config


def _dtype_bytes(config, override):
    if override is not None:
        return override
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 2)


def shape_from_config(name: str, config: dict, dtype_bytes: int | None = None) -> ModelShape:
    family = config.get("model_type", "")
    e = _dtype_bytes(config, dtype_bytes)
    if family in ("qwen3_5", "qwen3_5_text"):
        return _qwen3_5(name, config, e)
    if family == "glm_moe_dsa":
        return _glm(name, config, e)
    raise ValueError(f"model_type {family!r} of {name!r}: the planner knows qwen3_5 and glm_moe_dsa")


def _qwen3_5(name, c, e):
    types = list(c.get("layer_types") or [])[: c["num_hidden_layers"]]
    attn = sum(t == "full_attention" for t in types)
    gdn = sum(t == "linear_attention" for t in types)
    h, kv, d = c["hidden_size"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    hk, hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    kernel = c["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    state_e = 8 if e == 8 else 4
    per_layer = 2 * kv * d * e
    shape = ModelShape(name, "qwen3_5", e, state_e)
    shape.layer_counts = {"full_attention": attn, "gated_deltanet": gdn}
    shape.layer_bytes_per_token = {"attention_kv_pages": per_layer}
    shape.page_bytes_per_token = {"attention_kv_pages": attn * per_layer}
    shape.gdn_state_bytes = gdn * (hv * dk * dv * state_e + conv_dim * (kernel - 1) * e)
    nq = c["num_attention_heads"]
    shape.kept_attention_bytes_per_token = attn * nq * (d * e + state_e)  # out in the model dtype, lse in float32/64
    attn_params = h * nq * d * 2 + 2 * h * kv * d + nq * d * h
    gdn_params = h * conv_dim + h * hv * dv + 2 * h * hv + hv * dv * h + conv_dim * kernel
    mlp = 3 * h * c["intermediate_size"]
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    shape.params = attn * attn_params + gdn * gdn_params + (attn + gdn) * mlp + embed
    return shape


def _glm(name, c, e):
    layers = c["num_hidden_layers"]
    indexer = list(c.get("indexer_types") or ["full"] * layers)[:layers]
    full = sum(t == "full" for t in indexer)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * e
    index_key = c["index_head_dim"] * e
    shape = ModelShape(name, "glm_moe_dsa", e, 4)
    shape.layer_counts = {"mla": layers, "indexer_full": full, "indexer_shared": layers - full}
    shape.layer_bytes_per_token = {"mla_latent_pages": latent, "indexer_key_pages": index_key}
    shape.page_bytes_per_token = {"mla_latent_pages": layers * latent, "indexer_key_pages": full * index_key}
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q_lora, kv_lora = c.get("q_lora_rank") or 0, c["kv_lora_rank"]
    q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
    mla = (q + h * (kv_lora + c["qk_rope_head_dim"]) + kv_lora * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
           + heads * c["v_head_dim"] * h)
    idx = (q_lora or h) * c["index_n_heads"] * c["index_head_dim"] + h * c["index_head_dim"] + h * c["index_n_heads"]
    dense = c.get("first_k_dense_replace", 0)
    moe = 3 * h * c["moe_intermediate_size"] * (c["n_routed_experts"] + c.get("n_shared_experts", 0)) \
        + h * c["n_routed_experts"]
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    shape.params = layers * mla + full * idx + dense * 3 * h * c["intermediate_size"] + (layers - dense) * moe + embed
    return shape
