"""QLoRA: peft adapters over NF4 base weights loaded from a checkpoint (bitsandbytes), single process.

Equivalence chain (float64, float64_model() making transformers compute in float64 end to end):
  grpo_backward(exact) on the 4-bit policy
      == full-sequence autograd of a plain float64 model whose linear weights are the 4-bit layers' dequantized
         weights, carrying the same adapters (the reference of the KL term: that model with adapters disabled)
Tolerance: relative L2 <= 1e-8 over the adapter gradients, as in test_transaction: both sides compute the same
function in float64 in different orders. bitsandbytes' CPU matmul returns garbage for float64 inputs (seen: values
~1e-309), so in float64 the 4-bit layers multiply by their dequantized weight (what matmul_4bit computes, minus
the fused kernel; float64_four_bit). With bitsandbytes' own float32 kernels the same chain holds to float32
rounding (relative 1e-4; measured 7e-7). Measured in float64: 1e-10, and detached mode on the same case 0.69.
The ZeRO-3 engine path (2 ranks, the real launcher) is tests/launcher/test_engine.py::qlora.
"""

from contextlib import contextmanager

import pytest
import torch
from grads import grads_of, relative_l2
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.models.lora import apply_lora
from ds_longstraw.models.modeling import build_model

TOL = 1e-8
CONFIG = {"capture_chunk": 7, "page_tokens": 5, "replay_block": 4}  # divides neither prompt nor responses


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qlora") / "base"
    tiny_qwen3_5(torch.float32, seed=8).save_pretrained(path)
    return str(path)


def _adapters(model):
    with torch.no_grad():  # peft starts lora_B at zero (adapters a no-op): make them matter
        gen = torch.Generator().manual_seed(6)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return model


@contextmanager
def float64_four_bit():
    """bitsandbytes' 4-bit matmul as dequantize-then-multiply in the input's dtype (float64 here)."""
    import bitsandbytes
    import bitsandbytes.functional as bnb_functional

    def matmul_4bit(A, B, out=None, bias=None, quant_state=None):
        weight = bnb_functional.dequantize_4bit(B.view(-1, 1), quant_state).to(A.dtype)
        return torch.nn.functional.linear(A, weight, bias)

    saved = bitsandbytes.matmul_4bit
    bitsandbytes.matmul_4bit = matmul_4bit
    try:
        yield
    finally:
        bitsandbytes.matmul_4bit = saved


def _four_bit_float64(checkpoint):
    """The 4-bit base (quantized from the float32 checkpoint: bitsandbytes quantizes 16/32-bit floats only) with
    everything else in float64 and the 4-bit layers computing in float64 (each weight is dequantized, then cast to
    the input's dtype: float32 values, exact in float64)."""
    model = build_model(pretrained=checkpoint, dtype="float32", four_bit=True)
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.compute_dtype = torch.float64
            if module.bias is not None:
                module.bias.data = module.bias.data.double()
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.is_floating_point():
                tensor.data = tensor.data.double()
    return model


def _dequantized_twin(policy, checkpoint):
    """A plain float64 model with the policy's effective weights: each 4-bit layer's dequantized weight, every
    other parameter (adapters included) copied."""
    import bitsandbytes.functional as bnb_functional

    twin = apply_lora(build_model(pretrained=checkpoint, dtype="float64"), r=4, alpha=8, seed=0)
    sources = dict(policy.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            source = sources[name]
            if type(source).__name__ == "Linear4bit":
                weight = source.weight
                module.weight.copy_(bnb_functional.dequantize_4bit(weight.data, weight.quant_state).to(torch.float64))
            else:
                for pname, p in module.named_parameters(recurse=False):
                    p.copy_(getattr(source, pname))
    return twin


def _group():
    gen = torch.Generator().manual_seed(3)
    return GRPOGroup(torch.randint(0, 97, (23,), generator=gen),
                     [torch.randint(0, 97, (n,), generator=gen) for n in (5, 1, 3)], rewards=[0.2, 0.9, -0.4])


def test_four_bit_policy_gradients_equal_full_sequence_autograd(checkpoint):
    policy = _adapters(apply_lora(_four_bit_float64(checkpoint), r=4, alpha=8, seed=0))
    four_bit = [m for m in policy.modules() if type(m).__name__ == "Linear4bit"]
    assert four_bit, "no layer was loaded in 4 bits"
    for module in four_bit:  # two codes a byte, whatever dtype stores them
        weight = module.weight
        assert weight.numel() * weight.element_size() * 2 == module.in_features * module.out_features
    twin = _dequantized_twin(policy, checkpoint)
    group, objective = _group(), GRPOObjective(kl_coef=0.1)
    with float64_model(), float64_four_bit():
        ours, result = grads_of(policy, lambda: grpo_backward(policy, group, objective,
                                                              longstraw={**CONFIG, "prefix_grad": "exact"}))
        detached, _ = grads_of(policy, lambda: grpo_backward(policy, group, objective,
                                                             longstraw={**CONFIG, "prefix_grad": "detached"}))

        def reference_loss():
            with torch.no_grad(), twin.disable_adapter():
                ref = full_sequence_logprobs(twin, group.prompt_ids, group.response_ids)
            logps = full_sequence_logprobs(twin, group.prompt_ids, group.response_ids)
            objective.group_loss(group, logps, ref).backward()
            return ref

        expected, ref_logps = grads_of(twin, reference_loss)
    assert set(ours) == set(expected) and all("lora_" in name for name in ours)
    error = relative_l2(ours, expected)
    assert error <= TOL, error
    assert relative_l2(detached, expected) > 1e3 * TOL  # the modes differ on this case
    for got, want in zip(result.ref_logprobs, ref_logps, strict=True):  # the reference is the 4-bit base, adapters off
        assert torch.allclose(got, want, rtol=0, atol=1e-10)


def test_bitsandbytes_float32_kernels_match_to_float32_rounding(checkpoint):
    """The same chain with bitsandbytes' own kernels computing in float32 (capture without a graph first, as a
    transaction does), against the float64 reference."""
    policy = _adapters(apply_lora(build_model(pretrained=checkpoint, dtype="float32", four_bit=True),
                                  r=4, alpha=8, seed=0))
    twin = _dequantized_twin(policy, checkpoint)
    group, objective = _group(), GRPOObjective(kl_coef=0.1)
    ours, _ = grads_of(policy, lambda: grpo_backward(policy, group, objective,
                                                     longstraw={**CONFIG, "prefix_grad": "exact"}))
    with float64_model():
        def reference_loss():
            with torch.no_grad(), twin.disable_adapter():
                ref = full_sequence_logprobs(twin, group.prompt_ids, group.response_ids)
            objective.group_loss(group, full_sequence_logprobs(twin, group.prompt_ids, group.response_ids),
                                 ref).backward()

        expected, _ = grads_of(twin, reference_loss)
    error = relative_l2({n: g.double() for n, g in ours.items()}, expected)
    assert error <= 1e-4, error  # float32 rounding through 4 layers and 3 members: measured ~1e-6


def test_no_layer_may_repack_its_weights_for_cpu_inference(checkpoint, monkeypatch):
    """This machine's CPU lacks AVX512-BF16, so bitsandbytes' in-place inference repacking (see
    keep_four_bit_layout) never runs here: claim the CPU has it while the layers are built, and check it is off."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    model = build_model(pretrained=checkpoint, dtype="float32", four_bit=True)
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)


def test_a_four_bit_model_loads_its_own_state_dict_and_refuses_another_base(checkpoint, tmp_path):
    saved = apply_lora(build_model(pretrained=checkpoint, four_bit=True), r=4, alpha=8, seed=0).state_dict()
    assert any(key.endswith("weight.absmax") for key in saved)  # bitsandbytes writes its quantization state
    fresh = apply_lora(build_model(pretrained=checkpoint, four_bit=True), r=4, alpha=8, seed=1)
    fresh.load_state_dict(saved)  # strict: every other key matches
    for name, p in fresh.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, saved[name]), name
    tiny_qwen3_5(torch.float32, seed=9).save_pretrained(tmp_path / "other")
    other = apply_lora(build_model(pretrained=str(tmp_path / "other"), four_bit=True), r=4, alpha=8, seed=0)
    with pytest.raises(ValueError, match=r"weight: its 4-bit block scales differ"):
        other.load_state_dict(saved)


def test_four_bit_needs_a_checkpoint():
    with pytest.raises(ValueError, match="model.pretrained"):
        build_model(shape="configs/models/tiny_qwen3_5.yaml", four_bit=True)
