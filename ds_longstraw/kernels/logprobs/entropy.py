"""Log-probs of target tokens and the softmax's entropy at each token, without a [tokens, vocab] tensor.

Legend as in chunked.py: T tokens, C channels, V vocabulary, z_Tc one vocabulary chunk's logits.

    lse = log sum_v exp(z[v]),   p(v) = exp(z[v] - lse),   E = sum_v p(v) z[v]
    log p(t) = z[t] - lse,       H = - sum_v p(v) log p(v) = lse - E

The forward keeps, per token and online over the chunks, the running max m, s = sum exp(z - m) and
u = sum exp(z - m) z (both rescaled by exp(m_old - m_new) when the max moves): lse = m + log s, E = u / s. The
backward recomputes each chunk's logits and uses
    d log p(t) / dz[v] = 1[v = t] - p(v),      dH / dz[v] = -p(v) (z[v] - E)
so d(hidden), d(weight) and d(bias) accumulate chunk by chunk, as in chunked.py. The plain reference
(logprobs_entropy_reference) holds [T, V] logits, their log-softmax and in backward their gradients: at a
248,320-token vocabulary about 1 GB each per 1,024 tokens in float32. What an entropy bonus adds to the log-probs'
cost is one running sum per token in forward and one product per logit in backward; the logits are computed the
same number of times (a chunk's logits serve both outputs).

At a temperature tau every z above is the logits divided by tau (chunked.py's _chunk_logits), H is the entropy of
that tempered softmax, and each chunk's dz is divided by tau once more on its way to the matmuls (chunked.py's
backward_over_chunks).

Precision as chunked.py: each chunk's matmul in the inputs' dtype, the softmax arithmetic in float32 (float64 for
float64 inputs).
"""

import torch

from ..dispatch import record
from .chunked import VOCAB_CHUNK, _acc, _chunk_logits, _in_chunk, backward_over_chunks, check_logprob_inputs


def _forward(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk, temperature=1.0):
    """(log p(targets), entropy, lse, E) [T] each, in the accumulation dtype."""
    acc = _acc(hidden_TC.dtype)
    tokens, vocab = hidden_TC.shape[0], weight_VC.shape[0]
    max_T = torch.full((tokens,), float("-inf"), dtype=acc, device=hidden_TC.device)
    sum_T = torch.zeros(tokens, dtype=acc, device=hidden_TC.device)
    zsum_T = torch.zeros(tokens, dtype=acc, device=hidden_TC.device)  # sum exp(z - max) z
    target_T = torch.zeros(tokens, dtype=acc, device=hidden_TC.device)
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(vocab, v0 + vocab_chunk)
        z_Tc = _chunk_logits(hidden_TC, weight_VC, bias_V, v0, v1, temperature).to(acc)
        inside_T, column_T = _in_chunk(targets_T, v0, v1)
        target_T = torch.where(inside_T, z_Tc.gather(-1, column_T.unsqueeze(-1)).squeeze(-1), target_T)
        new_max_T = torch.maximum(max_T, z_Tc.amax(dim=-1))
        rescale_T = torch.exp(max_T - new_max_T)  # 0 at the first chunk (exp(-inf)); logits are finite
        e_Tc = torch.sub(z_Tc, new_max_T.unsqueeze(-1)).exp_()  # two [T, c] tensors at most: z and e
        sum_T = sum_T * rescale_T + e_Tc.sum(dim=-1)
        zsum_T = zsum_T * rescale_T + (e_Tc.unsqueeze(1) @ z_Tc.unsqueeze(-1)).view(-1)  # no [T, c] product
        max_T = new_max_T
        del z_Tc, e_Tc
    lse_T = max_T + torch.log(sum_T)
    expected_T = zsum_T / sum_T
    return target_T - lse_T, lse_T - expected_T, lse_T, expected_T


def _backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T, expected_T, dlogp_T, dentropy_T, vocab_chunk, need,
              temperature=1.0):
    """Gradients of sum(dlogp log p + dentropy H) w.r.t. (hidden, weight, bias), chunk by chunk."""
    acc = lse_T.dtype
    dlogp_T, dentropy_T = dlogp_T.to(acc).unsqueeze(-1), dentropy_T.to(acc).unsqueeze(-1)
    shift_T = dlogp_T - dentropy_T * expected_T.unsqueeze(-1)

    def chunk_dz(z_Tc, v0):
        # dz = -p (dlogp + dentropy (z - E)) + dlogp onehot, in two [T, c] buffers: the factor, then p in z's
        z_Tc = z_Tc.to(acc)
        factor_Tc = torch.addcmul(shift_T, dentropy_T, z_Tc)
        dz_Tc = z_Tc.sub_(lse_T.unsqueeze(-1)).exp_().mul_(factor_Tc).neg_()
        del factor_Tc
        inside_T, column_T = _in_chunk(targets_T, v0, v0 + dz_Tc.shape[1])
        return dz_Tc.scatter_add_(-1, column_T.unsqueeze(-1), torch.where(inside_T.unsqueeze(-1), dlogp_T, 0.0))

    return backward_over_chunks(hidden_TC, weight_VC, bias_V, vocab_chunk, need, chunk_dz, temperature)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk, temperature):
        logp_T, entropy_T, lse_T, expected_T = _forward(hidden_TC, weight_VC, bias_V, targets_T, vocab_chunk,
                                                        temperature)
        ctx.save_for_backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T, expected_T)
        ctx.vocab_chunk, ctx.temperature = vocab_chunk, temperature
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx, dlogp_T, dentropy_T):
        hidden_TC, weight_VC, bias_V, targets_T, lse_T, expected_T = ctx.saved_tensors
        dlogp_T = torch.zeros_like(lse_T) if dlogp_T is None else dlogp_T
        dentropy_T = torch.zeros_like(lse_T) if dentropy_T is None else dentropy_T
        grads = _backward(hidden_TC, weight_VC, bias_V, targets_T, lse_T, expected_T, dlogp_T, dentropy_T,
                          ctx.vocab_chunk, ctx.needs_input_grad[:3], ctx.temperature)
        return (*grads, None, None, None)


def chunked_logprobs_entropy(hidden_TC, weight_VC, targets_T, bias_V=None, vocab_chunk=VOCAB_CHUNK, temperature=1.0):
    """(log softmax(z)[t, targets[t]], entropy of softmax(z)[t]) for each token t, z = (hidden @ weight.T + bias) /
    temperature (chunked_logprobs' temperature), as two [T] tensors in float32 (float64 for float64 inputs), both
    differentiable w.r.t. hidden, weight and bias; the same numbers as `logprobs_entropy_reference`, computed
    `vocab_chunk` ids at a time (module docstring). Run it inside the head's module call under ZeRO-3, as
    chunked_logprobs (ds_longstraw.arch.base.head_logprobs)."""
    check_logprob_inputs(hidden_TC, weight_VC, targets_T, bias_V, vocab_chunk, temperature)
    record("log-probs", "chunked_entropy")
    targets_T = targets_T.to(device=hidden_TC.device, dtype=torch.long)
    return _ChunkedLogprobsEntropy.apply(hidden_TC, weight_VC, bias_V, targets_T, int(vocab_chunk), float(temperature))


def logprobs_entropy_reference(hidden_TC, weight_VC, targets_T, bias_V=None, vocab_chunk=None, temperature=1.0):
    """Plain reference with chunked_logprobs_entropy's signature: full [T, V] logits divided by the temperature,
    log_softmax in float32 (float64 for float64 inputs), gather, and -sum p log p. vocab_chunk is ignored."""
    logits_TV = torch.nn.functional.linear(hidden_TC, weight_VC, bias_V)
    logp_TV = torch.log_softmax(logits_TV.to(_acc(logits_TV.dtype)) / temperature, dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    return logp_TV.gather(-1, targets_T.to(logits_TV.device).long().unsqueeze(-1)).squeeze(-1), entropy_T
