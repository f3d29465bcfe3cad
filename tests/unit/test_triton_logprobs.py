"""The Triton log-probs kernels (ds_longstraw.kernels.logprobs.triton_fused) against the float64 full log-softmax.

Equivalence chain: triton_logprobs (forward: online log-sum-exp per (token tile, vocabulary split), partials merged
on the host; backward: logits recomputed per (token tile, vocabulary tile), float32 atomic sums) on float32 inputs
== logprobs_reference (full [T, V] logits, log_softmax, gather) on the same inputs upcast to float64, values and
gradients w.r.t. hidden, weight and bias; on CUDA (bfloat16 and float32) within 2x the error of the same-precision
plain path.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on CPU
float32 tensors (the interpreter has no bfloat16 tl.dot); the CUDA test compiles them and is skipped elsewhere.
Sizes: T 37 (not a multiple of the 16-token tile: three tiles, the last partial), C 48 (three 16-channel steps), V 300
in splits of 64 ids (five splits, the last 44 ids: a partial 32-id tile), targets at the first and last id and at
both ends of every split.
"""

import os

import pytest
import torch

from ds_longstraw.kernels import logprobs_reference
from ds_longstraw.kernels.logprobs import triton_fused as tlp

pytestmark = pytest.mark.triton

# The kernels run where Triton can run them: under the interpreter on CPU tensors, else compiled on CUDA ones.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda" if torch.cuda.is_available() else None
kernels_run = pytest.mark.skipif(DEVICE is None, reason="neither the Triton interpreter nor a CUDA device")

# float32 against float64, absolute: |log p| here is at most ~25 (float32 ulp 2e-6 there) and each logit sums 48
# products, each gradient entry ~300 (d hidden, d bias) or 37 (d weight) float32 terms of size <= ~3. Measured (with /
# without bias): kernel errors 1.7e-6 / 1.1e-6 (log p), 1.2e-6 / 1.1e-6 (d hidden), 1.6e-6 / 1.8e-6 (d weight),
# 6.8e-7 (d bias); the plain float32 path's on the same inputs 3.2e-6 / 2.8e-6, 1.1e-6 / 1.8e-6, 1.6e-6 / 2.4e-6,
# 8e-7. 1e-5 is ~5x that; every compared tensor holds entries > 100x it (test_comparison_would_catch_a_wrong_kernel).
F32_ATOL = 1e-5
TILES = (16, 32, 16, 1, 1)  # (BLOCK_T, BLOCK_V, BLOCK_C, warps, stages): tl.dot's smallest, several of each
T, C, V, CHUNK = 37, 48, 300, 64


@pytest.fixture(autouse=True)
def small_tiles_and_poisoned_buffers(monkeypatch):
    """Small tiles (the interpreter is slow; many tiles per axis), and the buffers the kernels must fully write
    (split partials, d(weight)) start as NaN."""
    monkeypatch.setattr(tlp, "_tiles", lambda kind: TILES)
    monkeypatch.setattr(tlp, "_uninitialised", lambda *shape, **kw: torch.full(*shape, float("nan"), **kw))


def _inputs(tokens=T, vocab=V, channels=C, chunk=CHUNK, seed=0):
    """float32 (hidden, weight, bias, targets, dlogp); targets hit the first and last id and both ends of every
    split of `chunk` ids (then tile-boundary ids), the rest drawn."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(vocab, channels, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    edges = [0, vocab - 1] + [i for s in range(0, vocab, chunk) for i in (s, min(vocab, s + chunk) - 1)]
    edges = (edges + [31, 32, 33])[:tokens]
    targets[:len(edges)] = torch.tensor(edges)
    dlogp = torch.randn(tokens, generator=gen)
    return [x.to(DEVICE) for x in (hidden, weight, bias, targets, dlogp)]


def _values_and_grads(fn, hidden, weight, bias, targets, dlogp, **kwargs):
    """(log p, [d hidden, d weight, d bias]) of sum(dlogp * log p); None for a gradient not asked for."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (hidden, weight, bias)]
    logp = fn(leaves[0], leaves[1], targets, leaves[2], **kwargs)
    wanted = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad((logp * dlogp.to(logp.dtype)).sum(), wanted))
    return logp.detach(), [None if x is None else next(grads) for x in leaves]


def _exact(hidden, weight, bias, targets, dlogp):
    """The float64 reference on the float32 inputs upcast."""
    up = [None if x is None else x.double() for x in (hidden, weight, bias)]
    return _values_and_grads(logprobs_reference, *up, targets, dlogp.double())


def _errors(got, want):
    """Max absolute errors {name: error} of (log p, grads) against the reference's."""
    names = ("logp", "hidden", "weight", "bias")
    pairs = zip(names, [got[0], *got[1]], [want[0], *want[1]], strict=True)
    return {name: (g.double() - w).abs().max().item() for name, g, w in pairs if w is not None}


@kernels_run
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_values_and_gradients_match_float64_reference(with_bias):
    hidden, weight, bias, targets, dlogp = _inputs()
    bias = bias if with_bias else None
    got = _values_and_grads(tlp.triton_logprobs, hidden, weight, bias, targets, dlogp, vocab_chunk=CHUNK)
    want = _exact(hidden, weight, bias, targets, dlogp)
    assert got[0].dtype == torch.float32 and got[0].shape == (T,)
    assert [g is None for g in got[1]] == [False, False, not with_bias]
    for g, x in zip(got[1], (hidden, weight, bias), strict=True):
        assert g is None or (g.dtype == x.dtype and torch.isfinite(g).all())
    errors = _errors(got, want)
    assert max(errors.values()) <= F32_ATOL, errors


@kernels_run
def test_comparison_would_catch_a_wrong_kernel():
    """The tolerance is far below what a wrong kernel would change: every compared tensor holds entries > 100x
    F32_ATOL (no gradient is all zeros), and the usual slips (one token's target moved to the next id, the bias
    left out, one split's ids left out of the log-sum-exp) move the reference by > 100x F32_ATOL."""
    hidden, weight, bias, targets, dlogp = _inputs()
    got = _values_and_grads(tlp.triton_logprobs, hidden, weight, bias, targets, dlogp, vocab_chunk=CHUNK)
    want = _exact(hidden, weight, bias, targets, dlogp)
    assert max(_errors(got, want).values()) <= F32_ATOL
    for name, g in zip(("logp", "hidden", "weight", "bias"), [got[0], *got[1]], strict=True):
        assert g.abs().max().item() > 100 * F32_ATOL, name
    h64, w64, b64 = hidden.double(), weight.double(), bias.double()
    moved = targets.clone()
    moved[5] = (moved[5] + 1) % V
    slips = {
        "target off by one": logprobs_reference(h64, w64, moved, b64),
        "bias left out": logprobs_reference(h64, w64, targets, None),
        "a split left out": _logp_without_split(h64, w64, b64, targets, 2),
    }
    for slip, wrong in slips.items():
        assert (wrong - got[0].double()).abs().max().item() > 100 * F32_ATOL, slip


def _logp_without_split(hidden, weight, bias, targets, split):
    """log p with the ids of one split missing from the normaliser (what a skipped program would give)."""
    logits = hidden @ weight.T + bias
    kept = torch.ones(V, dtype=torch.bool, device=logits.device)
    kept[split * CHUNK:(split + 1) * CHUNK] = False
    lse = torch.logsumexp(logits[:, kept], dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse


@kernels_run
def test_only_needed_gradients_are_computed():
    """A frozen head (weight and bias without grad): d(hidden) only; the launcher makes no d(weight) / d(bias)."""
    hidden, weight, bias, targets, dlogp = _inputs()
    h = hidden.clone().requires_grad_()
    logp = tlp.triton_logprobs(h, weight, targets, bias, vocab_chunk=CHUNK)
    (dh,) = torch.autograd.grad((logp * dlogp).sum(), (h,))
    want = _exact(hidden, weight, bias, targets, dlogp)
    assert (dh.double() - want[1][0]).abs().max().item() <= F32_ATOL
    _, lse = tlp.logprobs_forward_triton(hidden, weight, bias, targets, CHUNK)
    grads = tlp.logprobs_backward_triton(hidden, weight, bias, targets, lse, dlogp, CHUNK, (False, True, False))
    assert grads[0] is None and grads[2] is None
    assert (grads[1].double() - want[1][1]).abs().max().item() <= F32_ATOL


@kernels_run
def test_default_tiles_strided_inputs_large_logits(monkeypatch):
    """The CUDA tiles (64, 128, 64: one token tile, one split larger than V) on hidden and weight as strided views;
    then logits of +-1e4 (the running max keeps exp() in range). At that size a float32 logit carries ~1e-3 of
    rounding, and so do p = exp(z - lse) and the gradients, on any float32 path: there the errors must stay within
    2x the plain float32 path's on the same inputs (plus 1 float32 ulp of the values' scale), as STYLE.md 3 asks."""
    monkeypatch.setattr(tlp, "_tiles", lambda kind: tlp._FORWARD_TILES if kind == "forward" else tlp._BACKWARD_TILES)
    hidden, weight, bias, targets, dlogp = _inputs()
    hidden = hidden.T.contiguous().T  # column-major [T, C]
    weight = torch.cat([weight, weight], dim=1)[:, ::2]  # row stride 2C, column stride 2
    got = _values_and_grads(tlp.triton_logprobs, hidden, weight, bias, targets, dlogp)
    errors = _errors(got, _exact(hidden, weight, bias, targets, dlogp))
    assert max(errors.values()) <= F32_ATOL, errors
    bias = bias * 1e4
    got = _values_and_grads(tlp.triton_logprobs, hidden, weight, bias, targets, dlogp)
    exact = _exact(hidden, weight, bias, targets, dlogp)
    plain = _values_and_grads(logprobs_reference, hidden, weight, bias, targets, dlogp)
    assert all(torch.isfinite(x).all() for x in [got[0], *got[1]])
    errors, plain_errors = _errors(got, exact), _errors(plain, exact)
    for name, x in zip(("logp", "hidden", "weight", "bias"), [exact[0], *exact[1]], strict=True):
        floor = torch.finfo(torch.float32).eps * x.abs().max().item()
        assert errors[name] <= 2 * plain_errors[name] + floor, (name, errors[name], plain_errors[name])


@kernels_run
def test_no_tokens_and_targets_outside_the_vocabulary():
    """T = 0 gives empty log-probs and zero weight gradients; a target outside [0, V) gives NaN (no split writes
    its logit), the other tokens their values."""
    hidden, weight, bias, targets, dlogp = _inputs()
    got = _values_and_grads(tlp.triton_logprobs, hidden[:0], weight, bias, targets[:0], dlogp[:0])
    assert got[0].shape == (0,) and (got[1][1] == 0).all() and (got[1][2] == 0).all()
    outside = targets.clone()
    outside[3], outside[4] = V, -1
    logp = tlp.triton_logprobs(hidden, weight, outside, bias, vocab_chunk=CHUNK)
    assert torch.isnan(logp[3:5]).all()
    keep = torch.ones(T, dtype=torch.bool)
    keep[3:5] = False
    want = logprobs_reference(hidden.double(), weight.double(), targets, bias.double())
    assert (logp[keep].double() - want[keep]).abs().max().item() <= F32_ATOL


def test_inputs_checked_at_the_door():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 2, 9])
    assert not tlp.supported(hidden.double(), weight.double())  # no float64 tl.dot: the caller takes torch
    with pytest.raises(ValueError, match="does not take hidden torch.float64"):
        tlp.triton_logprobs(hidden.double(), weight.double(), targets)
    with pytest.raises(ValueError, match="vocab_chunk"):
        tlp.triton_logprobs(hidden, weight, targets, vocab_chunk=0)
    with pytest.raises(ValueError, match="shapes do not match"):
        tlp.triton_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="bias"):
        tlp.triton_logprobs(hidden, weight, targets, torch.randn(9))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_kernels_on_cuda(dtype, monkeypatch):
    """The compiled kernels at their CUDA tiles against float64: the error of log p and of each gradient at most
    2x that of the plain path in the same precision on the same inputs, plus 1 float32 ulp of the values' scale
    (STYLE.md 3). Sizes: T 333, C 320 (five 64-channel steps), V 5,000 in splits of 1,024 (a partial last tile)."""
    monkeypatch.setattr(tlp, "_tiles", lambda kind: tlp._FORWARD_TILES if kind == "forward" else tlp._BACKWARD_TILES)
    gen = torch.Generator().manual_seed(0)
    tokens, channels, vocab = 333, 320, 5000
    hidden = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(vocab, channels, generator=gen) * channels ** -0.5
    bias = torch.randn(vocab, generator=gen) * 0.1
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[0], targets[-1] = 0, vocab - 1
    dlogp = torch.randn(tokens, generator=gen)
    low = [x.to("cuda", dtype) for x in (hidden, weight, bias)]
    targets, dlogp = targets.cuda(), dlogp.cuda()
    assert tlp.supported(*low)
    exact = _values_and_grads(logprobs_reference, *(x.double() for x in low), targets, dlogp.double())
    fast = _values_and_grads(tlp.triton_logprobs, *low, targets, dlogp, vocab_chunk=1024)
    plain = _values_and_grads(logprobs_reference, *low, targets, dlogp)
    fast_err, plain_err = _errors(fast, exact), _errors(plain, exact)
    scale = {"logp": exact[0], "hidden": exact[1][0], "weight": exact[1][1], "bias": exact[1][2]}
    for name, err in fast_err.items():
        floor = torch.finfo(torch.float32).eps * scale[name].abs().max().item()
        assert err <= 2 * plain_err[name] + floor, f"{name}: triton {err:.3g} vs plain {plain_err[name]:.3g}"
