"""Log-probs of target tokens under softmax(hidden @ weight.T + bias), without a [tokens, vocab] logits tensor.

Legend: T tokens, C channels (hidden size), V vocabulary, c one vocabulary chunk (at most `vocab_chunk` ids).
hidden_TC, weight_VC (the LM head's rows), bias_V, targets_T; z_Tc one chunk's logits.

    log p(t) = z[t] - lse,   lse = log sum_v exp(z[v])

The forward walks the vocabulary in chunks and keeps an online log-sum-exp (running max and sum per token) and the
target's logit. The backward recomputes each chunk's logits from hidden and weight and uses
    d log p(t) / d z[v] = 1[v = t] - exp(z[v] - lse)
to accumulate d(hidden) and write that chunk's rows of d(weight) (and d(bias)). So neither pass holds more than a
few [T, c] tensors at once; the plain reference (log_softmax, then gather) holds [T, V] logits, their log-softmax
and, in backward, its gradient: at a 248,320-token vocabulary and a 1,024-token block about 1 GB each in float32.

A frozen head (LoRA, or any run that trains the body only) needs d(hidden) alone, and that one is known up to a
per-token factor before backward:
    d log p(t) / d hidden = weight[t] - sum_v p(v) weight[v]   (the target's row minus the softmax-expected row)
so the forward also accumulates the expected row online (rescaled with the running max, like the sum) and saves
the [T, C] direction; the backward is then one multiplication by dlogp, with no logits recomputed and the head's
weight not read again (under ZeRO-3 not needed again). Matmuls per block: 2 instead of 3 (the plain path's 2).
Where d(weight) or d(bias) is needed the backward must recompute the logits anyway and computes d(hidden) there.

At a sampling temperature tau the softmax is over z / tau (TRL divides the logits by its `temperature` before the
log-softmax): each chunk's logits are divided by tau in the accumulation dtype, and since d(z / tau) / dz = 1 / tau
the backward divides each chunk's dz (and a frozen head's direction) by tau. tau = 1 is the untouched path.

Precision matches the plain path of the model: each chunk's matmul runs in the inputs' dtype (so a logit is the
same number the full matmul gives), the softmax arithmetic in float32 (float64 for float64 inputs), and d(hidden)
is summed over chunks in that accumulation dtype.
"""

import math

import torch

from ..dispatch import fast_path, record

# Vocabulary ids per chunk. Measured on CPU (2 shared cores, float32, T = 1,024, C = 256, V = 65,536, forward +
# backward of the log-probs alone, best of 3): 1,024 ids 7.9 s, 4,096 3.6 s, 8,192 3.0 s, 16,384 2.6 s, 32,768
# 2.4 s; the full-logits reference 2.0 s (the backward recomputes the logits: one matmul more of four). In the whole
# GRPO step (bench/bench_logprobs.py, one thread) 8,192 is already no slower than the reference, and each doubling
# doubles the float32 [T, c] temporaries (32 MiB per 1,024 tokens at 8,192): 8,192 keeps them small for the memory
# this path exists to save.
VOCAB_CHUNK = 8192


# d(weight) and d(bias) are written chunk by chunk into uninitialised buffers; tests poison them (NaN) here.
_uninitialised = torch.empty_like


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# The Triton steps (triton_steps.py: each chunk's elementwise work in one pass) stand beside the torch steps
# below with the same signatures, taken where the dispatch allows (CUDA, mode "auto", triton importable): on the
# H200 a 1,024-token block over Qwen3.6's 248,320 ids took 0.82x the torch steps' time with a trained head and
# 0.86x with a frozen one, at the same peak (BENCHMARKS.md, "On one H200"). The fused kernels (triton_fused.py)
# took 3.3x and 2.5x: not dispatched. Set False to force the torch steps.
USE_TRITON_STEPS = True


def _chunk_logits(hidden_TC, weight_VC, bias_V, v0, v1, temperature=1.0):
    """Logits of ids v0..v1-1, computed like the full matmul, in the inputs' dtype; at a temperature other than 1
    divided by it in the accumulation dtype (the division after the matmul, as the plain path: dividing the hidden
    states first would round them again in a low-precision dtype)."""
    z_Tc = hidden_TC @ weight_VC[v0:v1].T
    if bias_V is not None:
        z_Tc = z_Tc + bias_V[v0:v1]
    if temperature != 1.0:
        z_Tc = z_Tc.to(_acc(hidden_TC.dtype)) / temperature
    return z_Tc


def _in_chunk(targets_T, v0, v1):
    """(tokens whose target is in [v0, v1), their target's column in the chunk, clamped for the others)."""
    inside_T = (targets_T >= v0) & (targets_T < v1)
    return inside_T, (targets_T - v0).clamp(0, v1 - v0 - 1)


def forward_step_reference(z_Tc, targets_T, v0, max_T, sum_T, target_T, want_p):
    """Fold one chunk's logits z_Tc (ids v0 ..) into the running max, sum of exp(z - max) and target logit per
    token (in place, in their dtype); returns (p_Tc or None, rescale_T): p = exp(z - new max) where want_p, rescale =
    exp(old max - new max). The first chunk rescales a zero sum by exp(-inf) = 0; logits are finite, so the new max
    is too."""
    z_Tc = z_Tc.to(max_T.dtype)  # in place below: one [T, c] tensor per chunk
    inside_T, column_T = _in_chunk(targets_T, v0, v0 + z_Tc.shape[1])
    target_T.copy_(torch.where(inside_T, z_Tc.gather(-1, column_T.unsqueeze(-1)).squeeze(-1), target_T))
    new_max_T = torch.maximum(max_T, z_Tc.amax(dim=-1))
    p_Tc = z_Tc.sub_(new_max_T.unsqueeze(-1)).exp_()
    rescale_T = torch.exp(max_T - new_max_T)
    sum_T.mul_(rescale_T).add_(p_Tc.sum(dim=-1))
    max_T.copy_(new_max_T)
    return (p_Tc if want_p else None), rescale_T


def backward_step_reference(z_Tc, targets_T, v0, lse_T, dlogp_T):
    """dz = dlogp * (onehot(target) - exp(z - lse)) of one chunk, in lse's dtype (built in place on z's copy)."""
    dz_Tc = z_Tc.to(lse_T.dtype).sub_(lse_T.unsqueeze(-1)).exp_().mul_(-dlogp_T.unsqueeze(-1))
    inside_T, column_T = _in_chunk(targets_T, v0, v0 + z_Tc.shape[1])
    return dz_Tc.scatter_add_(-1, column_T.unsqueeze(-1), torch.where(inside_T, dlogp_T, 0.0).unsqueeze(-1))


def _steps(hidden_TC, need_bias=False):
    """(forward_step, backward_step): the Triton ones where USE_TRITON_STEPS and the dispatch allow and no bias
    gradient is asked for (d(bias) sums the float32 dz, which those round to the inputs' dtype), else the torch
    ones."""
    if USE_TRITON_STEPS and not need_bias and fast_path(hidden_TC, "triton"):
        from . import triton_steps as steps  # imports triton: on first use only

        return steps.forward_step, steps.backward_step
    return forward_step_reference, backward_step_reference


def _forward(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk, with_direction=False, temperature=1.0):
    """(log p(targets) [T], lse [T], direction [T, C] or None) in the accumulation dtype, by an online log-sum-exp
    over vocabulary chunks of the logits / temperature; with_direction: also d log p / d hidden (module docstring),
    for a frozen head."""
    acc = _acc(hidden_TC.dtype)
    tokens, vocab = hidden_TC.shape[0], weight_VC.shape[0]
    max_T = torch.full((tokens,), float("-inf"), dtype=acc, device=hidden_TC.device)
    sum_T = torch.zeros(tokens, dtype=acc, device=hidden_TC.device)
    target_T = torch.zeros(tokens, dtype=acc, device=hidden_TC.device)
    # sum_v exp(z[v] - max) weight[v], rescaled with the running max as sum_T is
    expected_TC = torch.zeros(hidden_TC.shape, dtype=acc, device=hidden_TC.device) if with_direction else None
    forward_step, _ = _steps(hidden_TC)
    record("log-probs", "chunked" if forward_step is forward_step_reference else "chunked_triton_steps")
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(vocab, v0 + vocab_chunk)
        z_Tc = _chunk_logits(hidden_TC, weight_VC, bias_V, v0, v1, temperature)
        p_Tc, rescale_T = forward_step(z_Tc, targets_T, v0, max_T, sum_T, target_T, with_direction)
        if with_direction:
            # Like the plain backward: the softmax weights are cast to the inputs' dtype before the matmul.
            expected_TC = expected_TC * rescale_T.unsqueeze(-1) + (p_Tc.to(hidden_TC.dtype) @ weight_VC[v0:v1]).to(acc)
        del z_Tc, p_Tc
    lse_T = max_T + torch.log(sum_T)
    direction_TC = None
    if with_direction:
        direction_TC = weight_VC[targets_T].to(acc) - expected_TC / sum_T.unsqueeze(-1)
        if temperature != 1.0:
            direction_TC = direction_TC / temperature
    return target_T - lse_T, lse_T, direction_TC


def _backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T, dlogp_T, vocab_chunk, need, temperature=1.0):
    """Gradients of sum(dlogp * log p) w.r.t. (hidden, weight, bias), chunk by chunk; None where not `need`ed."""
    dlogp_T = dlogp_T.to(_acc(hidden_TC.dtype))
    _, backward_step = _steps(hidden_TC, need[2])

    def chunk_dz(z_Tc, v0):  # dz = dlogp * (onehot(target) - softmax), on the recomputed logits
        return backward_step(z_Tc, targets_T, v0, lse_T, dlogp_T)

    return backward_over_chunks(hidden_TC, weight_VC, bias_V, vocab_chunk, need, chunk_dz, temperature)


def backward_over_chunks(hidden_TC, weight_VC, bias_V, vocab_chunk, need, chunk_dz, temperature=1.0):
    """(d hidden, d weight, d bias) from the logits' gradient chunk by chunk: chunk_dz(z_Tc, v0) turns one chunk's
    recomputed logits (ids v0 .., divided by the temperature) into their gradient, in the accumulation dtype, which
    is then divided by the temperature (the chain rule through z / temperature); None where not `need`ed."""
    need_hidden, need_weight, need_bias = need
    acc = _acc(hidden_TC.dtype)
    vocab = weight_VC.shape[0]
    dhidden_TC = torch.zeros(hidden_TC.shape, dtype=acc, device=hidden_TC.device) if need_hidden else None
    dweight_VC = _uninitialised(weight_VC) if need_weight else None
    dbias_V = _uninitialised(bias_V) if need_bias else None
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(vocab, v0 + vocab_chunk)
        dz_Tc = chunk_dz(_chunk_logits(hidden_TC, weight_VC, bias_V, v0, v1, temperature), v0)
        if temperature != 1.0:
            dz_Tc = dz_Tc / temperature
        if need_bias:
            dbias_V[v0:v1] = dz_Tc.sum(dim=0)
        # Like the plain path's backward: the logits' gradient is cast to the inputs' dtype before the matmuls.
        dz_Tc = dz_Tc.to(hidden_TC.dtype)
        if need_hidden:
            dhidden_TC += (dz_Tc @ weight_VC[v0:v1]).to(acc)
        if need_weight:
            dweight_VC[v0:v1] = dz_Tc.T @ hidden_TC
        del dz_Tc
    return (None if dhidden_TC is None else dhidden_TC.to(hidden_TC.dtype)), dweight_VC, dbias_V


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk, frozen_head, temperature):
        logp_T, lse_T, direction_TC = _forward(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk,
                                               with_direction=frozen_head, temperature=temperature)
        if frozen_head:  # backward needs the direction only: neither the head nor the hidden states stay alive
            ctx.save_for_backward(direction_TC)
        else:
            ctx.save_for_backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T)
        ctx.vocab_chunk, ctx.frozen_head, ctx.hidden_dtype = vocab_chunk, frozen_head, hidden_TC.dtype
        ctx.temperature = temperature
        return logp_T

    @staticmethod
    def backward(ctx, dlogp_T):
        if ctx.frozen_head:
            (direction_TC,) = ctx.saved_tensors
            dhidden = (dlogp_T.to(direction_TC.dtype).unsqueeze(-1) * direction_TC).to(ctx.hidden_dtype)
            return dhidden, None, None, None, None, None, None
        hidden_TC, weight_VC, bias_V, targets_T, lse_T = ctx.saved_tensors
        dhidden, dweight, dbias = _backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T, dlogp_T, ctx.vocab_chunk,
                                            ctx.needs_input_grad[:3], ctx.temperature)
        return dhidden, dweight, dbias, None, None, None, None


def _frozen_head(hidden_TC, weight_VC, bias_V):
    """Whether autograd will ask for d(hidden) only (module docstring): then the forward computes it up to dlogp."""
    head_trains = weight_VC.requires_grad or (bias_V is not None and bias_V.requires_grad)
    return torch.is_grad_enabled() and hidden_TC.requires_grad and not head_trains


def check_logprob_inputs(hidden_TC, weight_VC, targets_T, bias_V, vocab_chunk, temperature=1.0):
    """ValueError naming what is wrong with a log-prob kernel's inputs (this one's and triton_fused.py's)."""
    if vocab_chunk is None or vocab_chunk <= 0:
        raise ValueError(f"vocab_chunk must be a positive number of ids, got {vocab_chunk!r}")
    check_temperature(temperature)
    if hidden_TC.dim() != 2 or weight_VC.dim() != 2 or targets_T.dim() != 1:
        raise ValueError(f"expected hidden [T, C], weight [V, C], targets [T]; got {tuple(hidden_TC.shape)}, "
                         f"{tuple(weight_VC.shape)}, {tuple(targets_T.shape)}")
    if hidden_TC.shape[0] != targets_T.shape[0] or hidden_TC.shape[1] != weight_VC.shape[1]:
        raise ValueError(f"shapes do not match: hidden {tuple(hidden_TC.shape)}, weight {tuple(weight_VC.shape)}, "
                         f"targets {tuple(targets_T.shape)}")
    if bias_V is not None and bias_V.shape != (weight_VC.shape[0],):
        raise ValueError(f"bias: expected [{weight_VC.shape[0]}], got {tuple(bias_V.shape)}")


def check_temperature(temperature):
    """ValueError unless `temperature` (what the logits are divided by) is a finite number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0 (the logits are divided by it), got "
                         f"{temperature!r}")


def chunked_logprobs(hidden_TC, weight_VC, targets_T, bias_V=None, vocab_chunk=VOCAB_CHUNK, temperature=1.0):
    """log softmax((hidden @ weight.T + bias) / temperature)[t, targets[t]] for each token t, as [T] in float32
    (float64 for float64 inputs): the same numbers as `logprobs_reference`, computed over `vocab_chunk` ids at a
    time with an online log-sum-exp in forward and per-chunk recomputation in backward, so no [T, V] tensor is ever
    made. temperature: the sampling temperature the log-probs are scored at (TRL's `temperature`; 1: the model's
    own distribution); not a top-p or top-k truncation, which no log-prob here applies.

    Differentiable w.r.t. hidden, weight and bias. A trainable head's weight is saved for backward as given: a
    ZeRO-3 partitioned weight must be gathered in forward and again in backward, which DeepSpeed's hooks do when
    this runs inside the head module's call (ds_longstraw.arch.base.head_logprobs). A frozen head's backward does
    not read it.
    """
    check_logprob_inputs(hidden_TC, weight_VC, targets_T, bias_V, vocab_chunk, temperature)
    targets_T = targets_T.to(device=hidden_TC.device, dtype=torch.long)
    return _ChunkedLogprobs.apply(hidden_TC, weight_VC, bias_V, targets_T, int(vocab_chunk),
                                  _frozen_head(hidden_TC, weight_VC, bias_V), float(temperature))


def logprobs_reference(hidden_TC, weight_VC, targets_T, bias_V=None, vocab_chunk=None, temperature=1.0):
    """Plain reference with chunked_logprobs' signature: full [T, V] logits divided by the temperature, log_softmax
    in float32 (float64 for float64 inputs), then gather. vocab_chunk is ignored."""
    logits_TV = torch.nn.functional.linear(hidden_TC, weight_VC, bias_V)
    logp_TV = torch.log_softmax(logits_TV.to(_acc(logits_TV.dtype)) / temperature, dim=-1)
    return logp_TV.gather(-1, targets_T.to(logits_TV.device).long().unsqueeze(-1)).squeeze(-1)
