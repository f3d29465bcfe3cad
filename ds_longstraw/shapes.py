"""Model shapes built with random weights (no hub access needed): the embedded default of the main job and
the benchmarks. Real checkpoints load with transformers' from_pretrained instead."""

import torch

SHAPES = {
    # A small hybrid model: 8 layers, every 4th full attention (as Qwen3.6-27B), GQA 4:2, GDN 2 QK / 4 V heads.
    "small": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4),
    # Qwen3.6-27B's published shape (for planning and for loading real checkpoints; far too big to build here).
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                        linear_num_value_heads=48),
}


def qwen3_5_config(shape="small", max_positions=1 << 22, **overrides):
    from transformers import Qwen3_5TextConfig

    kwargs = dict(SHAPES[shape])
    layers = kwargs["num_hidden_layers"]
    kwargs.update(
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1]},
    )
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def build_model(shape="small", dtype=torch.float32, seed=0, **overrides):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config = qwen3_5_config(shape, **overrides)
    config._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(config).to(dtype)


def synthetic_group(prompt_tokens, group_size, response_tokens, vocab_size, seed=0):
    """A prompt, G responses of lengths evenly spaced from response_tokens / 2 to response_tokens, and rewards.

    Every G has the same shortest and longest member, so what G changes is only the number of members (a group's
    replay peak follows its longest member, which random lengths would tie to G)."""
    from .group import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen)
    shortest = max(1, response_tokens // 2)
    lengths = torch.linspace(shortest, response_tokens, group_size).round().long() if group_size > 1 else \
        torch.tensor([response_tokens])
    responses = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
    rewards = torch.rand(group_size, generator=gen)
    return GRPOGroup(prompt, responses, rewards=rewards)
