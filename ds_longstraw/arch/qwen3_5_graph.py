"""What one replayed member's autograd graph keeps alive, per response token, for a qwen3_5 model: the planner's
"replay graph" term (offload/plan.py).

A member's replay runs [prompt[-1], response[:-1]] through every layer with autograd, and its graph holds every
layer's saved activations until that member's backward: over Qwen3.6-27B's 64 layers that was 31.8 GiB of the
H200 step's 82.3 GiB at 1,024 response tokens (BENCHMARKS.md, "The whole Qwen3.6-27B shape on one H200"), the
largest term of the step above the weights. The prompt's pages are not in it (the graph keeps handles and re-stages
them in backward: grpo/replay.py).

The coefficients are bytes per response token per unit of each width, for a bfloat16 model; two sets:
  "lora"  peft LoRA on every projection of a frozen body (peft keeps adapters in float32, so every adapted
          projection saves a float32 copy of its input)
  "full"  every weight trained (each projection saves its input in the model's dtype)
They were fitted to the bytes autograd's saved-tensor hooks count during a member's replay (storages counted once,
parameters excluded) over 15 widths, Qwen3.6-27B's and half of it among them, and match those counts to 4% (LoRA,
whose rank-16 terms the widths do not carry) and 0.4% (full); tests/unit/test_replay_graph.py counts them again at
widths of its own. Per layer kind:
  common to both   two RMSNorms' float32 inputs, the MLP's gate, up and product, and the inputs of its projections
  full attention   + q/k norms (float32), q, k, v, the output gate and the attention's out and lse
  Gated DeltaNet   + the conv's input and tail, the normalised q/k, g and beta, the gated norm (float32), and per
                   member the float32 initial state the scan starts from
Another dtype scales them by dtype_bytes / 2 (an overestimate for float32 models: their float32 norms do not
double).
"""

# bytes per response token per unit width, by layer kind and training
_PER_TOKEN = {
    "lora": {
        "full_attention": {"H": 30, "I": 9, "HqD": 15, "HkD": 11, "Hq": 48, "Hk": 35},
        "linear_attention": {"H": 34, "I": 10, "HkDk": 12, "HvDv": 23, "Hv": 72, "Hk": 40},
        "head": {"H": 8},  # the final norm's float32 input
    },
    "full": {
        "full_attention": {"H": 20, "I": 8, "HqD": 18, "HkD": 13, "Hq": 13, "Hk": -14},
        "linear_attention": {"H": 20, "I": 8, "HkDk": 12, "HvDv": 24, "Hv": 19, "Hk": 0},
        "head": {"H": 10},  # + the LM head's input, kept for its weight's gradient
    },
}
# bytes per replayed member of a Gated DeltaNet layer (per unit of Hv*Dk*Dv and of the conv's channels)
_PER_MEMBER = {"HvDkDv": 4, "C": 22}
TRAINS = tuple(_PER_TOKEN)


def _widths(config) -> dict:
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    return {"H": config.hidden_size, "I": config.intermediate_size,
            "HqD": config.num_attention_heads * config.head_dim, "HkD": config.num_key_value_heads * config.head_dim,
            "Hq": config.num_attention_heads, "Hk_attention": config.num_key_value_heads,
            "HkDk": hk * dk, "HvDv": hv * dv, "Hv": hv, "Hk": hk, "HvDkDv": hv * dk * dv, "C": 2 * hk * dk + hv * dv}


def _bytes(coefficients: dict, widths: dict, kind: str) -> int:
    # the attention's own key heads sit under "Hk" in its coefficients
    key = {"Hk": "Hk_attention"} if kind == "full_attention" else {}
    return sum(c * widths[key.get(name, name)] for name, c in coefficients.items())


def replay_graph(config, dtype_bytes: int) -> dict:
    """{"lora" | "full": (bytes per response token, bytes per member)} over the whole model (every layer and the
    head): a member of n response tokens keeps n * the first + the second until its backward."""
    widths = _widths(config)
    scale = dtype_bytes / 2
    out = {}
    for trains, kinds in _PER_TOKEN.items():
        per_token = _bytes(kinds["head"], widths, "head")
        per_member = 0
        for kind in config.layer_types[:config.num_hidden_layers]:
            per_token += _bytes(kinds[kind], widths, kind)
            if kind == "linear_attention":
                per_member += sum(c * widths[name] for name, c in _PER_MEMBER.items())
        out[trains] = (int(per_token * scale), int(per_member * scale))
    return out
