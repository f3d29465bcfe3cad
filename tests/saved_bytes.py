"""Bytes autograd saves during a replayed member's forward, counted with saved-tensor hooks (each storage once,
parameters excluded): the measurement the planner's replay-graph figures (arch/qwen3_5_graph.py) are held to."""

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

        leaves = args[1]
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
        grpo_backward(model, group, GRPOObjective(), config={"prefix_grad": "detached", "capture_chunk": 16})
    finally:
        monkeypatch.setattr(replay_module, "replay_member", original)
    return max(counts)
