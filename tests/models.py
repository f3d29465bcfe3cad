"""Tiny random transformers models for tests, and the float64 reference computations they are checked against."""

import inspect
import types
from contextlib import contextmanager

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from ds_longstraw.kernels.gated_delta import recurrent_gated_delta_rule


def tiny_qwen3_5_config(layers=4, **overrides):
    # Every 4th layer is full attention, as in Qwen3.6-27B; small odd-ish sizes to catch layout bugs.
    types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    kwargs = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=types, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [1, 1, 0]},
    )
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def tiny_qwen3_5(dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_qwen3_5_config(**overrides)
    config._attn_implementation = "sdpa"  # float64 softmax (eager attention casts scores to float32)
    model = Qwen3_5ForCausalLM(config).to(dtype)
    # Random-init norms are all zero-centred ones; perturb everything a little so no path is trivially identity.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _rms_norm_forward(self, x):
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.to(acc) * torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + self.eps)
    return (out * (1.0 + self.weight.to(acc))).type_as(x)


def _rms_norm_gated_forward(self, hidden_states, gate):
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    h = hidden_states.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = self.weight * h.to(hidden_states.dtype)
    return (h * torch.nn.functional.silu(gate.to(acc))).to(hidden_states.dtype)


# transformers' own torch fallbacks, taken before any test swaps them (float64_model replaces the module's names).
TRANSFORMERS_CHUNK_RULE = modeling_qwen3_5.torch_chunk_gated_delta_rule
TRANSFORMERS_RECURRENT_RULE = modeling_qwen3_5.torch_recurrent_gated_delta_rule


class _Float32ReadsAsFloat64:
    """The `torch` module as transformers_in_float64's copies see it: torch.float32 is torch.float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def transformers_in_float64(rule):
    """transformers' torch fallback `rule` (torch_chunk_gated_delta_rule or torch_recurrent_gated_delta_rule) run in
    float64: the same code object, whose one use of torch.float32 (casting its inputs) then casts to float64. The
    hub-kernel wrapper is unwrapped, so no kernel package (fla) can stand in for the torch code."""
    raw = inspect.unwrap(rule)
    twin = types.FunctionType(raw.__code__, dict(raw.__globals__, torch=_Float32ReadsAsFloat64()), raw.__name__,
                              raw.__defaults__, raw.__closure__)
    twin.__kwdefaults__ = raw.__kwdefaults__
    return twin


@contextmanager
def float64_model(delta_rule="token_loop"):
    """Make transformers' qwen3_5 compute in float64 end to end, for both the code under test and the reference.

    Its RMSNorms compute in float32 whatever the input dtype, and its torch delta-rule fallback casts to float32:
    with those casts two correct float64 computations still differ by ~1e-7, which would hide real bugs under a
    loose tolerance. The norms are swapped for the same formula in max(float32, input) precision, and the delta
    rule for the token-by-token recurrence (an implementation independent of the chunked kernel under test), or
    with delta_rule="transformers" for transformers' own torch fallbacks run in float64 (transformers_in_float64;
    the chunked one is ~5x faster than the token loop at 5K tokens; tests/unit/test_kernels_reference.py holds the
    project's kernels to them).
    """
    if delta_rule not in ("token_loop", "transformers"):
        raise ValueError(f"delta_rule must be 'token_loop' or 'transformers', got {delta_rule!r}")
    saved = (modeling_qwen3_5.torch_chunk_gated_delta_rule, modeling_qwen3_5.torch_recurrent_gated_delta_rule,
             modeling_qwen3_5.Qwen3_5RMSNorm.forward, modeling_qwen3_5.Qwen3_5RMSNormGated.forward)
    modeling_qwen3_5.Qwen3_5RMSNorm.forward = _rms_norm_forward
    modeling_qwen3_5.Qwen3_5RMSNormGated.forward = _rms_norm_gated_forward

    def chunked(query, key, value, g, beta, chunk_size=64, **kwargs):
        return recurrent_gated_delta_rule(query, key, value, g, beta, **kwargs)

    if delta_rule == "transformers":
        modeling_qwen3_5.torch_chunk_gated_delta_rule = transformers_in_float64(TRANSFORMERS_CHUNK_RULE)
        modeling_qwen3_5.torch_recurrent_gated_delta_rule = transformers_in_float64(TRANSFORMERS_RECURRENT_RULE)
    else:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = chunked
        modeling_qwen3_5.torch_recurrent_gated_delta_rule = recurrent_gated_delta_rule
    try:
        yield
    finally:
        (modeling_qwen3_5.torch_chunk_gated_delta_rule, modeling_qwen3_5.torch_recurrent_gated_delta_rule,
         modeling_qwen3_5.Qwen3_5RMSNorm.forward, modeling_qwen3_5.Qwen3_5RMSNormGated.forward) = saved


def _functional_recurrent_updates(cache):
    """transformers copies the new recurrent state into the tensor that autograd saved as the initial state
    ("modified by an inplace operation" on backward); for a differentiable continuation, assign instead."""
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            def update(states, state_idx=0, _layer=layer, **kwargs):
                _layer.recurrent_states[state_idx] = states
                return states

            layer.update_recurrent_state = update
    return cache


def member_logprobs(logits_TV, targets):
    acc = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits_TV.to(acc), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def member_entropies(logits_TV):
    """The softmax's entropy at each position, by torch.distributions (an implementation not the project's)."""
    acc = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
    return torch.distributions.Categorical(logits=logits_TV.to(acc)).entropy()


def full_sequence_logprobs(model, prompt, responses, entropies=None, temperature=1.0):
    """Reference for exact mode: each member as one prompt+response forward with autograd (no cache). entropies: a
    list that receives each member's entropies (differentiable) alongside. temperature: the logits are divided by
    it first (TRL's scoring at its sampling temperature)."""
    logps = []
    for response in responses:
        logits = model(torch.cat([prompt, response]).unsqueeze(0), use_cache=False).logits[0] / temperature
        logps.append(member_logprobs(logits[prompt.numel() - 1:-1], response))
        if entropies is not None:
            entropies.append(member_entropies(logits[prompt.numel() - 1:-1]))
    return logps


def cache_continuation_logprobs(model, prompt, responses, entropies=None, temperature=1.0):
    """Reference for detached mode: a no-grad prefill of prompt[:-1] into a transformers cache, then each member
    continues from a copy of it with autograd on [prompt[-1], response[:-1]] (entropies, temperature: as
    full_sequence_logprobs)."""
    import copy

    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt[:-1].unsqueeze(0), past_key_values=cache, use_cache=True)
    logps = []
    for response in responses:
        member_cache = _functional_recurrent_updates(copy.deepcopy(cache))
        ids = torch.cat([prompt[-1:], response[:-1]]).unsqueeze(0)
        logits = model(ids, past_key_values=member_cache, use_cache=True).logits[0] / temperature
        logps.append(member_logprobs(logits, response))
        if entropies is not None:
            entropies.append(member_entropies(logits))
    return logps
