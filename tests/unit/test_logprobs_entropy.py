"""The log-probs and the softmax's entropy from one vocabulary-chunked pass (kernels/logprobs/entropy.py).

Equivalence chains:
  chunked_logprobs_entropy == torch.distributions.Categorical(logits).log_prob / .entropy (a library's own
      functions on the full [T, V] logits), values and gradients w.r.t. hidden, weight and bias, float64, 1e-12
      (only the summation order differs: per-chunk sums and rescaling), for chunk sizes that divide V, do not,
      exceed it, or are one id; with either output unused;
  float32: within 4x the float32 reference's own error against float64 (plus 1e-6);
  grpo_backward with an entropy bonus and chunks of 10 ids over the tiny model's 97 == the same on the plain path
      (full logits, log_softmax), float64;
  memory: at a 248,320-id vocabulary a step with the bonus peaks within 10% of the step without it (fresh
      processes, the kernel's high-water mark, bench/bench_logprobs.py), while the bonus through full logits
      needs several times more.
"""

import os
import sys

import pytest
import torch
from models import float64_model, tiny_qwen3_5

from ds_longstraw.arch.base import CausalLMAdapter
from ds_longstraw.group import GRPOGroup
from ds_longstraw.grpo.transaction import grpo_backward
from ds_longstraw.kernels import chunked_logprobs_entropy, logprobs_entropy_reference
from ds_longstraw.objective import GRPOObjective

TOL64 = 1e-12
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(dtype, bias=True, tokens=13, channels=8, vocab=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, channels, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(vocab, channels, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    weights = torch.randn(2, tokens, generator=gen, dtype=torch.float64)
    return hidden, weight, b, targets, weights


def _library(hidden, weight, bias, targets):
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    distribution = torch.distributions.Categorical(logits=logits)
    return distribution.log_prob(targets), distribution.entropy()


def _values_and_grads(fn, hidden, weight, bias, targets, weights, use=(True, True)):
    logp, entropy = fn(hidden, weight, targets, bias) if fn is not _library else fn(hidden, weight, bias, targets)
    loss = sum((out.double() * w).sum() for out, w, used in zip((logp, entropy), weights, use, strict=True) if used)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    return [logp.detach().double(), entropy.detach().double()] + [g.double() for g in torch.autograd.grad(loss,
                                                                                                         leaves)]


@pytest.mark.parametrize("chunk", [1, 7, 13, 100, 1000])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("use", [(True, True), (False, True), (True, False)])
def test_float64_equals_torch_distributions(chunk, bias, use):
    hidden, weight, b, targets, weights = _inputs(torch.float64, bias)

    def chunked(h, w, t, bb):
        return chunked_logprobs_entropy(h, w, t, bb, vocab_chunk=chunk)

    mine = _values_and_grads(chunked, hidden, weight, b, targets, weights, use)
    theirs = _values_and_grads(_library, hidden, weight, b, targets, weights, use)
    for a, c in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, c, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_temperature_equals_torch_distributions_of_tempered_logits(temperature, bias):
    """At a temperature: Categorical(logits / tau)'s log_prob and entropy, values and gradients, float64, chunks
    of 7 over 100 ids (the plain reference too)."""
    hidden, weight, b, targets, weights = _inputs(torch.float64, bias)

    def tempered_library(h, w, bb, t):
        logits = torch.nn.functional.linear(h, w, bb) / temperature
        distribution = torch.distributions.Categorical(logits=logits)
        return distribution.log_prob(t), distribution.entropy()

    def chunked(h, w, t, bb):
        return chunked_logprobs_entropy(h, w, t, bb, vocab_chunk=7, temperature=temperature)

    def plain(h, w, t, bb):
        return logprobs_entropy_reference(h, w, t, bb, temperature=temperature)

    theirs = _values_and_grads(_library, hidden, weight, b, targets, weights)  # at tau = 1: must differ
    want = _values_and_grads(lambda h, w, t, bb: tempered_library(h, w, bb, t), hidden, weight, b, targets, weights)
    for fn in (chunked, plain):
        for a, c in zip(_values_and_grads(fn, hidden, weight, b, targets, weights), want, strict=True):
            torch.testing.assert_close(a, c, rtol=TOL64, atol=TOL64)
    assert (want[1] - theirs[1]).abs().max() > 1e-2


def test_plain_reference_equals_torch_distributions():
    hidden, weight, b, targets, weights = _inputs(torch.float64)
    mine = _values_and_grads(logprobs_entropy_reference, hidden, weight, b, targets, weights)
    theirs = _values_and_grads(_library, hidden, weight, b, targets, weights)
    for a, c in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, c, rtol=TOL64, atol=TOL64)


def test_float32_within_the_plain_paths_error():
    hidden, weight, b, targets, weights = _inputs(torch.float32, vocab=3000, tokens=40, channels=32)
    exact = _values_and_grads(_library, *(x.detach().double().requires_grad_() if x is not None else None
                                          for x in (hidden, weight, b)), targets, weights)
    plain = _values_and_grads(logprobs_entropy_reference, hidden, weight, b, targets, weights)

    def chunked(h, w, t, bb):
        return chunked_logprobs_entropy(h, w, t, bb, vocab_chunk=256)

    mine = _values_and_grads(chunked, hidden, weight, b, targets, weights)
    for m, p, e in zip(mine, plain, exact, strict=True):
        assert float((m - e).abs().max()) <= 4 * float((p - e).abs().max()) + 1e-6


def test_entropy_bonus_through_the_transaction_equals_the_plain_path(monkeypatch):
    """The chunked pass (10 ids per chunk over the tiny model's 97) against full logits, the whole transaction."""
    model = tiny_qwen3_5()
    gen = torch.Generator().manual_seed(2)
    group = GRPOGroup(torch.randint(0, 97, (19,), generator=gen),
                      [torch.randint(0, 97, (n,), generator=gen) for n in (5, 8)], rewards=[0.2, 0.9])
    objective = GRPOObjective(entropy_coef=0.1)
    config = {"prefix_grad": "exact", "capture_chunk": 6, "page_tokens": 4, "replay_block": 3}
    grads = []
    for chunk in (10, None):
        monkeypatch.setattr(CausalLMAdapter, "logprobs_vocab_chunk", chunk)
        model.zero_grad(set_to_none=True)
        with float64_model():
            grpo_backward(model, group, objective, longstraw=config)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-10, atol=1e-12)


def test_entropy_bonus_keeps_the_peak_at_a_large_vocabulary():
    """Fresh processes, the kernel's high-water mark (bench/bench_logprobs.py's measurement), a 248,320-id
    vocabulary: the step with the bonus within 10% of the step without; through full logits well above."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_logprobs
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))

    class Args:
        prompt, group, response, head = 256, 2, 512, "trained"

    peaks = {mode: bench_logprobs.run_fresh(248320, mode, Args)["step_peak_bytes"]
             for mode in bench_logprobs.ENTROPY_MODES}
    assert peaks["chunked-entropy"] <= 1.10 * peaks["chunked"], peaks
    assert peaks["reference-entropy"] >= 2 * peaks["chunked-entropy"], peaks
