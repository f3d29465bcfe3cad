"""The project's gated delta rule against transformers' own torch fallbacks for qwen3_5.

Legend: B batch, T tokens, Hk/Hv key/value heads, dk/dv head dims (layouts as in kernels/gated_delta/reference.py).

Under test: ds_longstraw.kernels.chunk_gated_delta_rule (the chunked rule with a hand-derived backward, which the
layers run), chunk_gated_delta_rule_autograd and recurrent_gated_delta_rule. Reference: transformers 5.23's
modeling_qwen3_5.torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule, called as Qwen3_5GatedDeltaNet
calls them: q/k with the Hk key heads (the function repeats them to the Hv value heads itself), g the natural-log
decay -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), use_qk_l2norm_in_kernel=True; chunk size 64.

Equivalence chains, outputs AND final state AND gradients for q, k, v, g, beta and the initial state:
  float64: every project rule == both transformers rules evaluated in float64 (tests/models.py
           transformers_in_float64: the same code with its float32 cast made a float64 cast), to 1e-10 of the
           tensor's scale. Both sides compute one function in different orders (measured <= 1.3e-15); a wrong term
           (a missing decay, a head mapped to the wrong value head, a dropped state gradient) shows far above it.
  float32: each project rule errs against that float64 evaluation by at most 4x what transformers' float32 function
           of the same algorithm errs by (chunked rules against torch_chunk_gated_delta_rule, the token loop against
           torch_recurrent_gated_delta_rule), plus 1e-6 of the tensor's scale. Measured: the largest float32 errors
           are 2.0e-6 (chunked, both sides) and 3.5e-7 (token loop, both sides); the ratio is <= 1.10 wherever
           transformers' error exceeds 3e-7. The floor (~8 float32 ulps) covers tensors where both errors are at
           rounding level and their ratio is noise (up to 2.5x at T=1). The chunked WY solve is less accurate in
           float32 than the token loop (6x on these inputs, up to 140x on others): holding a
           chunked rule to the token loop's error would measure the algorithm, not the code. Injected faults fail
           both tests: q/k heads repeated blockwise instead of interleaved (every GQA 2x4 case), beta x (1 + 1e-5)
           and final state x (1 + 1e-4) (every case), g shifted by one token, the initial state's gradient dropped.
Errors are max |x - x64| over a tensor divided by max(max |x64|, 1): relative to the tensor's largest entry, and
absolute for a tensor that is (near) zero in float64 (the gradient of g at T=1 without an initial state is 0).

Lengths 1, 63, 65 and 130 are not multiples of the 64-token chunk (130 = two chunks and a partial one).
"""

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from models import TRANSFORMERS_CHUNK_RULE, TRANSFORMERS_RECURRENT_RULE, transformers_in_float64

from ds_longstraw.kernels import chunk_gated_delta_rule, chunk_gated_delta_rule_autograd, recurrent_gated_delta_rule

BATCH, DK, DV = 2, 16, 12
LENGTHS = [1, 63, 65, 130]
HEADS = {"heads2": (2, 2), "gqa2x4": (2, 4), "gqa1x3": (1, 3)}  # (Hk, Hv)
FLOAT64_TOL = 1e-10
FLOAT32_FACTOR, FLOAT32_FLOOR = 4.0, 1e-6

# transformers' torch code itself (the hub wrapper would route to fla where it is installed), in float32 and float64
TRANSFORMERS = {"torch_chunk": inspect.unwrap(TRANSFORMERS_CHUNK_RULE),
                "torch_recurrent": inspect.unwrap(TRANSFORMERS_RECURRENT_RULE)}
TRANSFORMERS_F64 = {name: transformers_in_float64(rule) for name, rule in TRANSFORMERS.items()}
# project rule -> the transformers function of the same algorithm (its float32 error is the yardstick)
RULES = {"chunk": (chunk_gated_delta_rule, "torch_chunk"),
         "chunk_autograd": (chunk_gated_delta_rule_autograd, "torch_chunk"),
         "recurrent": (recurrent_gated_delta_rule, "torch_recurrent")}
NAMES = ("out", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def _names(case):
    """What _run returns for `case`: no initial state, no gradient for it."""
    return NAMES if case[2] else NAMES[:-1]


def _case_id(t, heads, with_state):
    return f"T{t}-{heads}-{'state' if with_state else 'no_state'}"


CASES = [(t, heads, with_state) for t in LENGTHS for heads in HEADS for with_state in (False, True)]
CASE_IDS = [_case_id(*case) for case in CASES]


@functools.cache
def _inputs(t, heads, with_state):
    """Inputs as the model makes them, rounded to float32 (the float64 runs see the same values), and the weights
    of the scalar whose gradients are compared: sum(out * w_out) + sum(final_state * w_state)."""
    hk, hv = HEADS[heads]
    gen = torch.Generator().manual_seed(1000 * t + 10 * hv + hk + with_state)
    randn = functools.partial(torch.randn, generator=gen, dtype=torch.float64)
    a_log = torch.empty(hv, dtype=torch.float64).uniform_(0, 16, generator=gen).log()  # as Qwen3_5GatedDeltaNet inits
    x = {"q": randn(BATCH, t, hk, DK), "k": randn(BATCH, t, hk, DK), "v": randn(BATCH, t, hv, DV),
         "g": -a_log.exp() * F.softplus(randn(BATCH, t, hv) + 1.0), "beta": randn(BATCH, t, hv).sigmoid(),
         "initial_state": randn(BATCH, hv, DK, DV) if with_state else None}
    x = {n: None if v is None else v.float() for n, v in x.items()}
    weights = (randn(BATCH, t, hv, DV), randn(BATCH, hv, DK, DV))
    return x, weights


def _run(rule, t, heads, with_state, dtype):
    """rule's output, final state and input gradients (float64 copies), inputs in `dtype`."""
    x, (w_out, w_state) = _inputs(t, heads, with_state)
    leaves = {n: v.to(dtype).requires_grad_() for n, v in x.items() if v is not None}
    out, state = rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                      initial_state=leaves.get("initial_state"), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    assert out.dtype == dtype and out.shape == (BATCH, t, HEADS[heads][1], DV)
    loss = (out.double() * w_out).sum() + (state.double() * w_state).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    # an input left without a gradient reads as NaN: it fails every comparison below
    grads = [torch.full_like(x, float("nan")) if g is None else g for g, x in zip(grads, leaves.values(), strict=True)]
    return [out.detach().double(), state.detach().double()] + [g.double() for g in grads]


@functools.cache
def _transformers(name, case, dtype):
    return _run(TRANSFORMERS_F64[name] if dtype == torch.float64 else TRANSFORMERS[name], *case, dtype)


def _errors(mine, ref):
    return [float((a - b).abs().max() / max(float(b.abs().max()), 1.0)) for a, b in zip(mine, ref, strict=True)]


def test_transformers_float64_copy_computes_in_float64():
    """The yardstick is float64: the copy returns float64 and differs from the float32 function by float32 rounding
    (~1e-7), not by 0 (a cast left in float32) and not by O(1) (a different function)."""
    case = (65, "gqa2x4", True)
    for name in TRANSFORMERS:
        f64, f32 = _transformers(name, case, torch.float64), _transformers(name, case, torch.float32)
        difference = max(_errors(f32, f64))
        assert 1e-8 < difference < 1e-3, (name, difference)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_float64_equals_transformers(rule, case):
    mine = _run(RULES[rule][0], *case, torch.float64)
    for name in TRANSFORMERS:
        ref = _transformers(name, case, torch.float64)
        for label, error in zip(_names(case), _errors(mine, ref), strict=True):
            assert error <= FLOAT64_TOL, f"{rule} vs {name}: {label} differs by {error:.2e}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_float32_within_transformers_float32_error(rule, case):
    fn, name = RULES[rule]
    ref = _transformers(name, case, torch.float64)
    plain = _errors(_transformers(name, case, torch.float32), ref)
    mine = _run(fn, *case, torch.float32)
    assert all(torch.isfinite(x).all() for x in mine)
    for label, error, plain_error in zip(_names(case), _errors(mine, ref), plain, strict=True):
        assert error <= FLOAT32_FACTOR * plain_error + FLOAT32_FLOOR, \
            f"{rule}: {label} errs {error:.2e} against float64; transformers' {name} in float32 errs {plain_error:.2e}"
