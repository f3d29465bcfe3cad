"""The Triton per-chunk steps of the chunked log-probs (kernels/logprobs/triton_steps.py) against the torch steps.

Equivalence chains:
  forward_step / backward_step (Triton) == forward_step_reference / backward_step_reference (torch) on one chunk:
      the running (max, sum, target logit), the rescale, p and dz, in float64 to 1e-12 (the same arithmetic, reduced
      in another order), with the chunk holding no target, every target, and partial tiles of tokens and columns;
  chunked_logprobs with the Triton steps taken (USE_TRITON_STEPS, the dispatch forced on CPU tensors) ==
      logprobs_reference in float64, values and gradients, trained and frozen head; a bias gradient keeps the torch
      steps.
Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); CPU tiles
are (4 tokens, 64 columns), so T 11 and c 150 leave partial tiles of both. The CUDA test compiles them (bfloat16
and float32), within 2x the torch steps' error against float64.
"""

import os

import pytest
import torch

from ds_longstraw.kernels import chunked_logprobs, logprobs_reference
from ds_longstraw.kernels.logprobs import chunked as logprobs_module

pytestmark = pytest.mark.triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs the kernels under the Triton interpreter")
F64 = dict(dtype=torch.float64)
# float64, the same terms summed in another order (tiles of 64 columns against one torch reduction): ~1e-15
# measured; 1e-12 leaves room without hiding a wrong term.
TOL64 = 1e-12


def _steps():
    from ds_longstraw.kernels.logprobs import triton_steps

    return triton_steps


def _chunk(tokens, cols, v0, targets_in_chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, cols, generator=gen, **F64) * 3
    targets = torch.randint(0, 1000, (tokens,), generator=gen) + 2000  # none in the chunk
    if targets_in_chunk:
        targets = torch.randint(v0, v0 + cols, (tokens,), generator=gen)
        targets[0], targets[-1] = v0, v0 + cols - 1
    state = (torch.randn(tokens, generator=gen, **F64) + 4, torch.rand(tokens, generator=gen, **F64) + 0.5,
             torch.randn(tokens, generator=gen, **F64))
    return z, targets, state


@interpreted
@pytest.mark.parametrize("targets_in_chunk", [True, False], ids=["targets-inside", "targets-outside"])
@pytest.mark.parametrize("first_chunk", [True, False], ids=["first-chunk", "later-chunk"])
def test_forward_step_matches_the_torch_step(targets_in_chunk, first_chunk):
    z, targets, state = _chunk(11, 150, 300, targets_in_chunk, seed=1)
    if first_chunk:  # the empty state: max -inf, sum 0
        state = (torch.full((11,), float("-inf"), **F64), torch.zeros(11, **F64), torch.zeros(11, **F64))
    mine, ref = [s.clone() for s in state], [s.clone() for s in state]
    p, rescale = _steps().forward_step(z.clone(), targets, 300, *mine, True)
    p_ref, rescale_ref = logprobs_module.forward_step_reference(z.clone(), targets, 300, *ref, True)
    for got, want in zip([*mine, rescale, p], [*ref, rescale_ref, p_ref], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    assert not torch.equal(mine[2], state[2]) if targets_in_chunk else torch.equal(mine[2], state[2])
    p_none, _ = _steps().forward_step(z.clone(), targets, 300, *[s.clone() for s in state], False)
    assert p_none is None


@interpreted
@pytest.mark.parametrize("targets_in_chunk", [True, False], ids=["targets-inside", "targets-outside"])
def test_backward_step_matches_the_torch_step(targets_in_chunk):
    z, targets, _ = _chunk(11, 150, 300, targets_in_chunk, seed=2)
    gen = torch.Generator().manual_seed(3)
    lse = torch.logsumexp(z, dim=-1) + torch.rand(11, generator=gen, **F64)
    dlogp = torch.randn(11, generator=gen, **F64).expand(2, 11)[0]  # any stride: autograd gives expanded ones
    dz = _steps().backward_step(z.clone(), targets, 300, lse, dlogp)
    torch.testing.assert_close(dz, logprobs_module.backward_step_reference(z, targets, 300, lse, dlogp), rtol=0,
                               atol=TOL64)


@pytest.fixture
def triton_steps(monkeypatch):
    """chunked_logprobs with the Triton steps: USE_TRITON_STEPS, and the dispatch forced for CPU tensors; counts
    the Triton calls so a test knows they ran."""
    steps = _steps()
    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(logprobs_module, "USE_TRITON_STEPS", True)
    monkeypatch.setattr(logprobs_module, "fast_path", lambda tensor, library=None: True)
    monkeypatch.setattr(steps, "forward_step", counted("forward", steps.forward_step))
    monkeypatch.setattr(steps, "backward_step", counted("backward", steps.backward_step))
    return calls


@interpreted
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_chunked_logprobs_with_triton_steps_match_full_log_softmax(triton_steps, head):
    gen = torch.Generator().manual_seed(4)
    tokens, channels, vocab = 9, 16, 130
    hidden = torch.randn(tokens, channels, generator=gen, **F64).requires_grad_()
    weight = (torch.randn(vocab, channels, generator=gen, **F64) * 0.5).requires_grad_(head == "trained")
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[0], targets[-1] = 0, vocab - 1
    dlogp = torch.randn(tokens, generator=gen, **F64)
    wanted = (hidden, weight) if head == "trained" else (hidden,)
    got = chunked_logprobs(hidden, weight, targets, vocab_chunk=50)
    got_grads = torch.autograd.grad((got * dlogp).sum(), wanted)
    want = logprobs_reference(hidden, weight, targets)
    want_grads = torch.autograd.grad((want * dlogp).sum(), wanted)
    assert triton_steps == {"forward": 3, "backward": 3 if head == "trained" else 0}
    torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL64)


@interpreted
def test_a_bias_gradient_keeps_the_torch_backward_step(triton_steps):
    """d(bias) sums dz in float32 before the cast: the Triton backward step (dz in the inputs' dtype) is not taken."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, 8, generator=gen, **F64).requires_grad_()
    weight, bias = torch.randn(40, 8, generator=gen, **F64), torch.randn(40, generator=gen, **F64).requires_grad_()
    targets = torch.randint(0, 40, (5,), generator=gen)
    got = torch.autograd.grad(chunked_logprobs(hidden, weight, targets, bias, vocab_chunk=16).sum(), (hidden, bias))
    want = torch.autograd.grad(logprobs_reference(hidden, weight, targets, bias).sum(), (hidden, bias))
    assert triton_steps == {"forward": 3, "backward": 0}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_steps_on_cuda(monkeypatch, dtype):
    """Compiled on the device: chunked log-probs with the Triton steps against float64, values and d(hidden) of a
    trained and a frozen head, at most 2x (plus float32's floor) the torch steps' error in the same dtype."""
    gen = torch.Generator().manual_seed(6)
    tokens, channels, vocab = 300, 256, 20000
    hidden = torch.randn(tokens, channels, generator=gen, **F64)
    weight = torch.randn(vocab, channels, generator=gen, **F64) * channels ** -0.5
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    dlogp = torch.randn(tokens, generator=gen, **F64)

    def run(h, w, use_triton):
        monkeypatch.setattr(logprobs_module, "USE_TRITON_STEPS", use_triton)
        h = h.clone().requires_grad_()
        logp = chunked_logprobs(h, w, targets.to(h.device), vocab_chunk=8192)
        (dh,) = torch.autograd.grad((logp * dlogp.to(h.device)).sum(), h)
        return logp.double().cpu(), dh.double().cpu()

    for frozen in (False, True):
        w64 = weight.clone().requires_grad_(not frozen)
        exact = run(hidden, w64, False)
        low_h, low_w = hidden.to("cuda", dtype), weight.to("cuda", dtype).requires_grad_(not frozen)
        mine, plain = run(low_h, low_w, True), run(low_h, low_w, False)
        for got, base, ref in zip(mine, plain, exact, strict=True):
            err, plain_err = (got - ref).abs().max().item(), (base - ref).abs().max().item()
            assert err <= 2 * plain_err + 1e-5, (frozen, err, plain_err)
