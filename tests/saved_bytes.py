"""Bytes autograd saves during a replayed member's forward, counted with saved-tensor hooks (each storage once,
parameters excluded): the measurement the planner's replay-graph figures (arch/qwen3_5_graph.py) are held to.

    python tests/saved_bytes.py '[[{"hidden_size": 112, ...}, "lora"], ...]'   -> bytes per response token of each

A fresh process per count: inside a long test session the same count came out 10% higher for LoRA after other
tests had run (state left behind by one of them, not the code path a user runs).
"""

import json
import sys

import torch

from ds_longstraw.grpo import replay as replay_module
from ds_longstraw.grpo.transaction import grpo_backward
from ds_longstraw.models.shapes import synthetic_group
from ds_longstraw.objective import GRPOObjective


class _Counting:
    """The member's own saved-tensor hooks (staged pages), with a counting pair installed inside them."""

    def __init__(self, inner, pack):
        self.inner, self.pack = inner, pack

    def __enter__(self):
        self.outer = self.inner()
        self.outer.__enter__()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()

    def __exit__(self, *error):
        self.hooks.__exit__(*error)
        self.outer.__exit__(*error)


class _Patch:
    def setattr(self, owner, name, value):
        setattr(owner, name, value)


def qwen3_5_model(widths, trains):
    """A 4-layer bfloat16 qwen3_5 (3 Gated DeltaNet + 1 attention) of `widths`, vocabulary 512; "lora": peft LoRA
    rank 16 on a frozen body. Returns (model, config)."""
    from transformers import AutoModelForCausalLM

    from ds_longstraw.models.lora import apply_lora
    from ds_longstraw.models.modeling import config_from_shape

    fields = {"model_type": "qwen3_5_text", "full_attention_interval": 4, "num_hidden_layers": 4, "vocab_size": 512,
              "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, **widths}
    config = config_from_shape(fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    return (apply_lora(model, r=16, seed=0) if trains == "lora" else model), config


def per_token_saved_bytes(widths, trains, short=32, long=64):
    """Bytes saved per response token: the difference of two response lengths, so that what a member keeps once
    (its initial state, the prompt's pages) drops out."""
    model, _ = qwen3_5_model(widths, trains)
    counts = [replay_saved_bytes(model, n, monkeypatch=_Patch()) for n in (short, long)]
    return (counts[1] - counts[0]) / (long - short)


def replay_saved_bytes(model, response_tokens, prompt_tokens=32, monkeypatch=None):
    """The largest number of bytes one member's forward saved for backward in a detached GRPO step of `model` with
    one member of `response_tokens` tokens."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counts = []

    def member(*args, **kwargs):
        seen = set()
        counts.append(0)

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counts[-1] += storage.nbytes()
            return t

        leaves = args[0].leaves  # replay_member(source: MemberReplay, ...)
        inner = leaves.saves
        leaves.saves = lambda: _Counting(inner, pack)
        try:
            return original(*args, **kwargs)
        finally:
            leaves.saves = inner

    original = replay_module.replay_member
    monkeypatch.setattr(replay_module, "replay_member", member)
    try:
        group = synthetic_group(prompt_tokens, 1, response_tokens, model.config.vocab_size, seed=response_tokens)
        grpo_backward(model, group, GRPOObjective(), longstraw={"prefix_grad": "detached", "capture_chunk": 16})
    finally:
        monkeypatch.setattr(replay_module, "replay_member", original)
    return max(counts)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([per_token_saved_bytes(widths, trains) for widths, trains in json.loads(sys.argv[1])]))
