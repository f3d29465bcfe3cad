"""The embedded default of the main job and the benchmarks: named shape configs of configs/models/, built with
random weights by the one model builder (modeling.build_model). Real checkpoints load with from_pretrained."""

import torch

from ds_longstraw.models.modeling import MODELS_DIR, build_model, load_shape

SHAPE_FILES = {"small": MODELS_DIR / "small_qwen3_5.yaml", "small-glm": MODELS_DIR / "small_glm_moe_dsa.yaml"}


def build_named(shape="small", dtype=torch.float32, seed=0, **overrides):
    """A random-weight model of the named shape, with config fields overridden by `overrides`."""
    if shape not in SHAPE_FILES:
        raise ValueError(f"shape {shape!r}: expected one of {sorted(SHAPE_FILES)}")
    return build_model(shape={**load_shape(SHAPE_FILES[shape]), **overrides}, dtype=dtype, seed=seed)


def synthetic_group(prompt_tokens, group_size, response_tokens, vocab_size, seed=0):
    """A prompt, G responses of lengths evenly spaced from response_tokens / 2 to response_tokens, and rewards.

    Every G has the same shortest and longest member, so what G changes is only the number of members (a group's
    replay peak follows its longest member, which random lengths would tie to G)."""
    from ds_longstraw.group import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen)
    shortest = max(1, response_tokens // 2)
    lengths = torch.linspace(shortest, response_tokens, group_size).round().long() if group_size > 1 else \
        torch.tensor([response_tokens])
    responses = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
    rewards = torch.rand(group_size, generator=gen)
    return GRPOGroup(prompt, responses, rewards=rewards)
