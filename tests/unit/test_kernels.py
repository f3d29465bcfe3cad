"""Fast paths against their plain references: values and gradients, awkward sizes, -inf partials.

Tolerance 1e-10 absolute in float64: both sides compute the same sums in different orders (blockwise online
softmax vs dense; chunked WY solve vs token loop), which leaves ~1e-14 relative on these sizes.
"""

from itertools import pairwise

import pytest
import torch

from ds_longstraw.kernels import (
    attention_with_past,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_autograd,
    merge_partials,
    merge_partials_reference,
    partial_attention,
    partial_attention_reference,
    recurrent_gated_delta_rule,
)
from ds_longstraw.kernels.gated_delta import PreparedDeltaRule

F64 = dict(dtype=torch.float64)


def _nan_poisoned_grad_check(outputs, inputs):
    grads = torch.autograd.grad(outputs, inputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs, strict=True)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("tq,tk", [(1, 1), (13, 63), (63, 111), (17, 17)])
@pytest.mark.parametrize("causal_offset", [None, 0, 5, -3])
def test_partial_attention_matches_dense(heads, kv_heads, tq, tk, causal_offset):
    gen = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(heads, tq, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(kv_heads, tk, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(kv_heads, tk, 8, generator=gen, **F64).requires_grad_()
    out, lse = partial_attention(q, k, v, 0.35, causal_offset, key_block=16)
    ref_out, ref_lse = partial_attention_reference(q, k, v, 0.35, causal_offset)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-10)  # -inf rows must match as -inf
    dout = torch.randn(out.shape, generator=gen, **F64)
    dlse = torch.randn(lse.shape, generator=gen, **F64)
    seen = torch.isfinite(ref_lse)
    objective = (out * dout).sum() + (lse.masked_fill(~seen, 0) * dlse).sum()
    ref_objective = (ref_out * dout).sum() + (ref_lse.masked_fill(~seen, 0) * dlse).sum()
    got, want = _nan_poisoned_grad_check(objective, [q, k, v]), _nan_poisoned_grad_check(ref_objective, [q, k, v])
    for g, r in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("causal_offset", [None, 0])
def test_fused_and_blockwise_paths_agree(monkeypatch, dtype, atol, causal_offset):
    """The fused CPU forward and the blockwise loop are two paths of one op: both against the dense reference."""
    from ds_longstraw.kernels.attention import partial as attention

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(6, 37, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, 37, 16, generator=gen, dtype=dtype)
    v = torch.randn(2, 37, 16, generator=gen, dtype=dtype)
    ref = partial_attention_reference(q, k, v, 0.25, causal_offset)
    for fused in (True, False):
        monkeypatch.setattr(attention, "USE_FUSED", fused)
        out, lse = partial_attention(q, k, v, 0.25, causal_offset, key_block=8)
        torch.testing.assert_close(out, ref[0], rtol=0, atol=atol)
        torch.testing.assert_close(lse, ref[1].to(lse.dtype), rtol=0, atol=atol)


def test_partial_attention_empty_keys():
    q = torch.randn(2, 5, 4, **F64)
    out, lse = partial_attention(q, torch.zeros(1, 0, 4, **F64), torch.zeros(1, 0, 4, **F64), 0.5)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_partial_attention_rejects_bad_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        partial_attention(torch.randn(3, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4), 1.0)


def test_merge_is_exact_split_of_attention():
    """Attention over keys [0, n) == LSE merge of attention over a split of the keys, including empty shards."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 7, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(2, 40, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(2, 40, 8, generator=gen, **F64).requires_grad_()
    full_out, full_lse = partial_attention_reference(q, k, v, 0.3)
    cuts = [0, 0, 13, 13, 40, 40]  # empty shards at both ends and in the middle
    out, lse = None, None
    for a, b in pairwise(cuts):
        o, lse_part = partial_attention(q, k[:, a:b], v[:, a:b], 0.3)
        out, lse = (o, lse_part) if out is None else merge_partials(out, lse, o, lse_part)
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)
    g = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v])
    r = torch.autograd.grad(full_out.sum() + full_lse.sum(), [q, k, v])
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_merge_handles_all_neg_inf_without_nan():
    out1 = torch.zeros(1, 3, 2, **F64, requires_grad=True)
    lse1 = torch.tensor([[float("-inf"), 0.5, float("-inf")]], **F64, requires_grad=True)
    out2 = torch.randn(1, 3, 2, **F64, requires_grad=True)
    lse2 = torch.tensor([[float("-inf"), float("-inf"), 1.0]], **F64, requires_grad=True)
    out, lse = merge_partials(out1, lse1, out2, lse2)
    ref_out, ref_lse = merge_partials_reference([out1, out2], [lse1, lse2])
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out)
    assert (out[0, 0] == 0).all()
    grads = torch.autograd.grad(out.sum() + lse.masked_fill(torch.isinf(lse), 0).sum(), [out1, lse1, out2, lse2])
    assert all(torch.isfinite(g).all() for g in grads)


def _delta_rule_inputs(t, hk, hv, seed, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, hk, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(1, t, hk, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(1, t, hv, 6, generator=gen, **F64).requires_grad_()
    g = (-torch.rand(1, t, hv, generator=gen, **F64) * 4).requires_grad_()
    beta = torch.rand(1, t, hv, generator=gen, **F64).requires_grad_()
    s0 = torch.randn(1, hv, 8, 6, generator=gen, **F64).requires_grad_() if with_state else None
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, chunk_gated_delta_rule_autograd],
                         ids=["analytic-backward", "plain-autograd"])
@pytest.mark.parametrize("t,chunk", [(1, 64), (63, 16), (111, 32), (64, 64)])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_delta_rule_matches_token_loop(rule, t, chunk, hk, hv, with_state):
    q, k, v, g, beta, s0 = _delta_rule_inputs(t, hk, hv, seed=t + hv, with_state=with_state)
    gen = torch.Generator().manual_seed(t)
    kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = rule(q, k, v, g, beta, chunk_size=chunk, **kwargs)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-10)
    inputs = [q, k, v, g, beta] + ([s0] if with_state else [])
    w_out, w_state = torch.randn(out.shape, generator=gen, **F64), torch.randn(state.shape, generator=gen, **F64)
    mine = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), inputs)
    ref = torch.autograd.grad((ref_out * w_out).sum() + (ref_state * w_state).sum(), inputs)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("t,chunk", [(1, 4), (9, 4), (16, 8)])
def test_state_adjoint_summary_matches_autograd(t, chunk):
    """d(initial state) = A D + L for any final-state gradient D: (L, A) against autograd of the token loop (the
    plain reference) with two different D, grouped heads, the l2 norm, one chunk and a partial last chunk; the
    prepared rule's output from the initial state (and from zeros) equals the token loop's."""
    q, k, v, g, beta, s0 = _delta_rule_inputs(t, 1, 2, seed=t)
    gen = torch.Generator().manual_seed(t + 1)
    kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    d_out = torch.randn(out.shape, generator=gen, **F64)
    prepared = PreparedDeltaRule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    L, A = prepared.state_adjoint(d_out)
    with torch.no_grad():
        torch.testing.assert_close(prepared.output(s0), out, rtol=0, atol=1e-10)
        zero_start, _ = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(prepared.output(None), zero_start, rtol=0, atol=1e-10)
    for _ in range(2):
        D = torch.randn(state.shape, generator=gen, **F64)
        (expected,) = torch.autograd.grad((out * d_out).sum() + (state * D).sum(), [s0], retain_graph=True)
        torch.testing.assert_close(A @ D + L, expected, rtol=0, atol=1e-10)


def test_analytic_delta_rule_backward_passes_gradcheck():
    """Finite differences of the analytic backward itself (no autograd form involved), two chunks plus a partial
    one, grouped heads, an initial state and the l2 norm."""
    q, k, v, g, beta, s0 = _delta_rule_inputs(9, 1, 2, seed=4)

    def rule(*inputs):
        return chunk_gated_delta_rule(*inputs[:5], chunk_size=4, initial_state=inputs[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(rule, (q, k, v, g, beta, s0), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("wanted", [("q",), ("g", "beta"), ("s0",), ("v", "s0")])
@pytest.mark.parametrize("final_state", [True, False])
def test_analytic_delta_rule_backward_with_some_inputs_frozen(wanted, final_state):
    """Only some inputs need a gradient, and the final state may be unused (no incoming gradient): the analytic
    backward returns the same gradients as plain autograd for those inputs and None for the rest."""
    names = ("q", "k", "v", "g", "beta", "s0")
    inputs = [x.detach().requires_grad_(name in wanted)
              for name, x in zip(names, _delta_rule_inputs(37, 2, 4, 6), strict=True)]
    results = []
    for rule in (chunk_gated_delta_rule, chunk_gated_delta_rule_autograd):
        out, state = rule(*inputs[:5], chunk_size=16, initial_state=inputs[5], output_final_state=final_state,
                          use_qk_l2norm_in_kernel=True)
        loss = (out * torch.linspace(-1, 1, out.numel(), **F64).reshape(out.shape)).sum()
        loss = loss + (state.square().sum() if final_state else 0)
        results.append(torch.autograd.grad(loss, [x for x in inputs if x.requires_grad]))
    for mine, ref in zip(*results, strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("segments", [[0], [23, 9]])
def test_attention_with_a_known_result_skips_the_forward(monkeypatch, segments):
    """attention_with_past(known=(out, lse)) returns the given result without computing attention, and its
    backward equals that of the call that computed it."""
    from ds_longstraw.kernels.attention import partial as attention_module

    gen = torch.Generator().manual_seed(len(segments))
    q = torch.randn(4, 7, 16, generator=gen, **F64).requires_grad_()
    past = [(torch.randn(2, n, 16, generator=gen, **F64).requires_grad_(),
             torch.randn(2, n, 16, generator=gen, **F64).requires_grad_()) for n in segments]
    k_new, v_new = (torch.randn(2, 7, 16, generator=gen, **F64).requires_grad_() for _ in range(2))
    inputs = [q, k_new, v_new] + [x for pair in past for x in pair]
    w_out, w_lse = torch.randn(4, 7, 16, generator=gen, **F64), torch.randn(4, 7, generator=gen, **F64)

    def grads(out, lse):
        return torch.autograd.grad((out * w_out).sum() + (lse.masked_fill(torch.isinf(lse), 0) * w_lse).sum(), inputs)

    out, lse = attention_with_past(q, past, k_new, v_new, 0.25)
    expected = grads(out, lse)
    calls = []
    monkeypatch.setattr(attention_module, "_forward", lambda *a: calls.append(a) or attention_module._forward(*a))
    known_out, known_lse = attention_with_past(q, past, k_new, v_new, 0.25, known=(out.detach(), lse.detach()))
    assert calls == []
    assert torch.equal(known_out, out) and torch.equal(known_lse, lse)
    for mine, ref in zip(grads(known_out, known_lse), expected, strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, chunk_gated_delta_rule_autograd],
                         ids=["analytic-backward", "plain-autograd"])
def test_delta_rule_keeps_bf16_state_in_float32(rule):
    q = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    out, state = rule(q, q, torch.randn(1, 5, 2, 4, dtype=torch.bfloat16),
                      -torch.rand(1, 5, 2), torch.rand(1, 5, 2), output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    (grad,) = torch.autograd.grad(out.float().sum() + state.sum(), [q])
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("segments", [[0], [23], [23, 0, 9], [1, 40]])
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_attention_with_past_matches_composed_reference(monkeypatch, fused, segments, with_lse_grad):
    """Merged forward + per-key-set backward with the merged (out, lse) == dense partials merged by autograd,
    for queries and for every key set's K/V (the pages' gradients in exact mode)."""
    from ds_longstraw.kernels import attention_with_past, attention_with_past_reference
    from ds_longstraw.kernels.attention import partial as attention

    monkeypatch.setattr(attention, "USE_FUSED", fused)
    gen = torch.Generator().manual_seed(len(segments) * 7 + sum(segments))
    q = torch.randn(6, 11, 8, generator=gen, **F64).requires_grad_()
    past = [(torch.randn(2, n, 8, generator=gen, **F64).requires_grad_(),
             torch.randn(2, n, 8, generator=gen, **F64).requires_grad_()) for n in segments]
    k_new = torch.randn(2, 11, 8, generator=gen, **F64).requires_grad_()
    v_new = torch.randn(2, 11, 8, generator=gen, **F64).requires_grad_()
    inputs = [q, k_new, v_new] + [t for pair in past for t in pair]
    out, lse = attention_with_past(q, past, k_new, v_new, 0.3, key_block=8)
    ref_out, ref_lse = attention_with_past_reference(q, past, k_new, v_new, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-10)
    w = torch.randn(out.shape, generator=gen, **F64)
    wl = torch.randn(lse.shape, generator=gen, **F64) if with_lse_grad else torch.zeros(lse.shape, **F64)
    mine = torch.autograd.grad((out * w).sum() + (lse * wl).sum(), inputs)
    ref = torch.autograd.grad((ref_out * w).sum() + (ref_lse * wl).sum(), inputs)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_attention_with_past_sinks_take_page_gradients_block_by_block(monkeypatch, fused, with_lse_grad):
    """A past segment with a sink: its dK/dV arrive at the sink in key blocks (offsets 0, 8, 16, ... for key_block
    8 over 27 keys), summing to the autograd gradient of the composed reference; autograd gives the segment
    nothing, and the query and the other segments' gradients are unchanged."""
    from ds_longstraw.kernels import attention_with_past, attention_with_past_reference
    from ds_longstraw.kernels.attention import partial as attention

    monkeypatch.setattr(attention, "USE_FUSED", fused)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 11, 8, generator=gen, **F64).requires_grad_()
    past = [(torch.randn(2, n, 8, generator=gen, **F64).requires_grad_(),
             torch.randn(2, n, 8, generator=gen, **F64).requires_grad_()) for n in (27, 5)]
    k_new = torch.randn(2, 11, 8, generator=gen, **F64).requires_grad_()
    v_new = torch.randn(2, 11, 8, generator=gen, **F64).requires_grad_()
    received = {"k": torch.zeros(2, 27, 8, **F64), "v": torch.zeros(2, 27, 8, **F64)}
    offsets = []

    def sink(offset, dk, dv):
        offsets.append((offset, dk.shape[1]))
        received["k"][:, offset:offset + dk.shape[1]] += dk
        received["v"][:, offset:offset + dv.shape[1]] += dv

    out, lse = attention_with_past(q, past, k_new, v_new, 0.3, key_block=8, sinks=[sink, None])
    ref_out, ref_lse = attention_with_past_reference(q, past, k_new, v_new, 0.3)
    w = torch.randn(out.shape, generator=gen, **F64)
    wl = torch.randn(lse.shape, generator=gen, **F64) if with_lse_grad else torch.zeros(lse.shape, **F64)
    others = [q, k_new, v_new, *past[1]]
    mine = torch.autograd.grad((out * w).sum() + (lse * wl).sum(), others + list(past[0]), allow_unused=True)
    ref = torch.autograd.grad((ref_out * w).sum() + (ref_lse * wl).sum(), others + list(past[0]))
    assert offsets == [(0, 8), (8, 8), (16, 8), (24, 3)]
    assert mine[-2] is None and mine[-1] is None  # the sinked segment's gradient went to the sink only
    for a, b in zip(mine[:-2], ref[:-2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    torch.testing.assert_close(received["k"], ref[-2], rtol=0, atol=1e-10)
    torch.testing.assert_close(received["v"], ref[-1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_constant_keys_take_dq_only_library_calls_of_bounded_length(monkeypatch, fused, with_lse_grad):
    """Constant keys (detached mode's prompt pages) longer than LIBRARY_KEY_BLOCK: the backward makes one kernel
    call per LIBRARY_KEY_BLOCK keys (none of them sees the whole set, so no prompt-sized dK/dV exists), and the
    summed dq equals the dense float64 reference's."""
    from ds_longstraw.kernels.attention import partial as attention

    monkeypatch.setattr(attention, "USE_FUSED", fused)
    monkeypatch.setattr(attention, "LIBRARY_KEY_BLOCK", 16)
    calls = []
    backward_call = attention._backward_call
    monkeypatch.setattr(attention, "_backward_call",
                        lambda q, k, *rest: calls.append(k.shape[1]) or backward_call(q, k, *rest))
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(6, 11, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(2, 41, 8, generator=gen, **F64)
    v = torch.randn(2, 41, 8, generator=gen, **F64)
    w = torch.randn(6, 11, 8, generator=gen, **F64)
    wl = torch.randn(6, 11, generator=gen, **F64) if with_lse_grad else torch.zeros(6, 11, **F64)
    out, lse = partial_attention(q, k, v, 0.3)
    (dq,) = torch.autograd.grad((out * w).sum() + (lse * wl).sum(), q)
    ref_q = q.detach().requires_grad_()
    ref_out, ref_lse = partial_attention_reference(ref_q, k, v, 0.3)
    (ref_dq,) = torch.autograd.grad((ref_out * w).sum() + (ref_lse * wl).sum(), ref_q)
    assert calls == [16, 16, 9]
    torch.testing.assert_close(dq, ref_dq, rtol=0, atol=1e-10)


def test_sinks_keep_key_block_off_the_flash_path():
    """The sink's call length: key_block wherever flash does not serve the calls (every CPU tensor)."""
    from ds_longstraw.kernels.attention import sink_block

    q, k = torch.zeros(4, 3, 8), torch.zeros(2, 100, 8)
    assert sink_block(q, k, 32) == 32
