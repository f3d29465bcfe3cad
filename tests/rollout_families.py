"""The two families' tiny float64 models as the rollout tests decode them (test_rollout.py, test_rollout_turns.py).

FAMILIES: per family its builder, the float64 reference mode it runs under, a prompt length whose prompt[:-1]
(22 and 44 tokens) neither the capture chunk nor the page size divides, and the longstraw block. glm_moe_dsa's
index_topk 8 < 44 prompt tokens: each sample's selection is sparse over the prompt's pages and its own rows.
poison_rows: generate's response-row buffers start as NaN, so a row read before it is written shows up.
"""

import torch
from glm_models import glm_reference, tiny_glm_moe_dsa
from models import float64_model, tiny_qwen3_5

import ds_longstraw.rollout.generate as rollout

FAMILIES = {
    "qwen3_5": dict(build=tiny_qwen3_5, reference=float64_model, prompt_len=23,
                    longstraw={"capture_chunk": 5, "page_tokens": 4, "replay_block": 3}),
    "glm_moe_dsa": dict(build=tiny_glm_moe_dsa, reference=glm_reference, prompt_len=45,
                        longstraw={"capture_chunk": 7, "page_tokens": 4, "replay_block": 3}),
}


def family_prompt(family, seed=1):
    return torch.randint(0, 97, (FAMILIES[family]["prompt_len"],), generator=torch.Generator().manual_seed(seed))


def poison_rows(monkeypatch):
    """Response-row buffers start as NaN: only rows written may be read."""
    def poisoned(part, shape):
        return part.new_full((shape, *part.shape[1:]) if isinstance(shape, int) else shape, float("nan"))

    monkeypatch.setattr(rollout, "_new_buffer", poisoned)
