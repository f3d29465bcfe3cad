"""grpo_backward refuses bad input before any work, with messages that name the problem."""

import pytest
import torch
from models import tiny_qwen3_5

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5(dtype=torch.float32)


def _group():
    return GRPOGroup(torch.arange(10), [torch.tensor([1, 2])], advantages=[1.0])


@pytest.mark.parametrize("config,message", [
    ({"prefix_grad": "approximate"}, "prefix_grad"),
    ({"capture_chunk": -4}, "capture_chunk"),
    ({"capture_chunks": 4}, "capture_chunks"),
    ({"offload": {"tier": "tape"}}, "offload.tier"),
    ("exact", "must be a dict"),
])
def test_bad_config(model, config, message):
    with pytest.raises(ValueError, match=message):
        grpo_backward(model, _group(), longstraw=config)
    assert all(p.grad is None for p in model.parameters()), "nothing may run before the config is checked"


def test_unsupported_architecture():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="unsupported architecture 'llama'; supported: .*qwen3_5"):
        grpo_backward(llama, _group())


def test_token_outside_vocab(model):
    group = GRPOGroup(torch.arange(10), [torch.tensor([1, 500])], advantages=[1.0])
    with pytest.raises(ValueError, match="response_ids\\[0\\] holds token id 500"):
        grpo_backward(model, group)


def test_kl_without_reference(model):
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_model"):
        grpo_backward(model, _group(), GRPOObjective(kl_coef=0.1))
    assert all(p.grad is None for p in model.parameters())


def test_not_a_group(model):
    with pytest.raises(ValueError, match="must be a GRPOGroup"):
        grpo_backward(model, {"prompt_ids": [1, 2]})
