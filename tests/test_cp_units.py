"""Single-process checks of the pieces context parallelism is built from (no process group needed).

  shard_bounds            contiguous, balanced, covers [0, L), empty shards when L < N
  GDN transition [B | P]  S_end(S_0) == P S_0 + B for the plain token-by-token delta rule (affine in S_0);
                          the exclusive fold of segment summaries == the recurrence's state at each segment start
  conv-tail fold          == the last k-1 columns of the concatenated pre-conv projections (shards shorter than k-1)
  grads given merged lse  summing each key shard's dq share == dq of dense attention over all keys; each shard's
                          dk/dv == its slice of the dense dk/dv (ring-attention backward; lse and out both in the loss)
  capture cargo           with grouped-query attention the pages (K/V) are the cheaper cargo
Tolerances: float64, different association orders of the same sums: ~1e-14; asserted at 1e-12.
"""

import pytest
import torch

from ds_longstraw.arch.qwen3_5_scan import extend_summary, fold_states, fold_tails, identity_summary
from ds_longstraw.kernels import partial_attention_reference, recurrent_gated_delta_rule
from ds_longstraw.kernels.attention import attention_delta, blockwise_grads_from_delta
from ds_longstraw.parallel import shard_bounds
from ds_longstraw.parallel.cp_attention import capture_move_bytes


@pytest.mark.parametrize("length,size", [(22, 3), (5, 4), (2, 4), (8, 2), (1, 1)])
def test_shard_bounds(length, size):
    bounds = shard_bounds(length, size)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _delta_inputs(gen, tokens, hk=2, hv=4, dk=8, dv=6):
    q = torch.randn(1, tokens, hk, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(1, tokens, hk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(1, tokens, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, tokens, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, tokens, hv, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def test_delta_rule_is_affine_in_initial_state():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _delta_inputs(gen, 37)
    s0 = torch.randn(1, 4, 8, 6, generator=gen, dtype=torch.float64)
    summary = extend_summary(identity_summary(4, 8, 6, torch.float64, "cpu"), q, k, v, g, beta)
    bias, product = summary[..., :6], summary[..., 6:]
    _, end_from_zero = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    _, end_from_s0 = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(bias, end_from_zero, rtol=0, atol=1e-12)
    torch.testing.assert_close(product @ s0 + bias, end_from_s0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cuts", [(0, 9, 9, 40, 70), (0, 1, 2, 3, 70), (0, 70, 70)],
                         ids=["with-empty", "tiny", "last-empty"])
def test_exclusive_fold_gives_each_segment_its_initial_state(cuts):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _delta_inputs(gen, cuts[-1])
    summaries, sizes = [], []
    for a, b in zip(cuts, cuts[1:]):
        summary = identity_summary(4, 8, 6, torch.float64, "cpu")
        if b > a:  # summaries are extended chunk by chunk in capture; two pieces here
            mid = (a + b) // 2
            for x, y in ((a, mid), (mid, b)):
                if y > x:
                    summary = extend_summary(summary, *(t[:, x:y] for t in (q, k, v, g, beta)))
        summaries.append(summary)
        sizes.append(b - a)
    for index, cut in enumerate(cuts[1:], start=1):
        _, expected = recurrent_gated_delta_rule(*(t[:, :cut] for t in (q, k, v, g, beta)), output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        state = fold_states(summaries[:index], sizes[:index], 6)
        torch.testing.assert_close(state, expected, rtol=0, atol=1e-12)


def test_conv_tail_fold_spans_short_shards():
    gen = torch.Generator().manual_seed(2)
    width, channels = 3, 5
    sizes = [2, 0, 1, 4, 1]
    full = torch.randn(1, channels, sum(sizes), generator=gen, dtype=torch.float64)
    parts, counts, start = [], [], 0
    for size in sizes:
        count = min(size, width)
        part = torch.zeros(1, channels, width, dtype=torch.float64)
        if count:
            part[:, :, width - count:] = full[:, :, start + size - count:start + size]
        parts.append(part)
        counts.append(count)
        start += size
    padded = torch.cat([torch.zeros(1, channels, width, dtype=torch.float64), full], -1)
    start = 0
    for index, size in enumerate(sizes):
        start += size
        assert torch.equal(fold_tails(parts[:index + 1], counts[:index + 1], width), padded[:, :, start:start + width])


def test_grads_given_merged_lse_sum_to_dense_grads():
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, tq, dim, scale = 4, 2, 5, 8, 0.4
    sizes = [6, 0, 9, 1]
    q = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_heads, sum(sizes), dim, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_heads, sum(sizes), dim, generator=gen, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(heads, tq, generator=gen, dtype=torch.float64)
    out, lse = partial_attention_reference(q, k, v, scale)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    dq, start = torch.zeros_like(q), 0
    for size in sizes:
        part = slice(start, start + size)
        delta = attention_delta(out.detach(), w_out, w_lse)  # from the MERGED (out, lse), as every shard has it
        dq_part, dk, dv = blockwise_grads_from_delta(q.detach(), k.detach()[:, part], v.detach()[:, part],
                                                     lse.detach(), w_out, delta, scale, key_block=4)
        dq += dq_part
        torch.testing.assert_close(dk, dk_ref[:, part], rtol=0, atol=1e-12)
        torch.testing.assert_close(dv, dv_ref[:, part], rtol=0, atol=1e-12)
        start += size
    torch.testing.assert_close(dq, dq_ref, rtol=0, atol=1e-12)


def test_capture_cargo_prefers_pages_with_grouped_query_attention():
    bounds = shard_bounds(1000, 4)
    gqa = capture_move_bytes(bounds, heads=24, kv_heads=4, head_dim=256, elem_bytes=2, lse_bytes=4)
    assert gqa["kv"] < gqa["q"]
    # 2 ranks, equal shards: pages 2 K D per token once; queries (2 H D + H) per token once
    two = capture_move_bytes(shard_bounds(10, 2), heads=2, kv_heads=2, head_dim=4, elem_bytes=8, lse_bytes=8)
    assert two == {"kv": 5 * 2 * 2 * 4 * 8, "q": 5 * (2 * 2 * 4 * 8 + 2 * 8)}
    # shards 1, 1, 1, 0: rank 0's token goes to ranks 1 and 2, rank 1's to rank 2; the empty rank gets nothing
    assert capture_move_bytes(shard_bounds(3, 4), 4, 2, 8, 2, 4)["kv"] == (2 + 1) * 2 * 2 * 8 * 2


def test_cp_size_and_group_are_checked_at_the_door():
    from ds_longstraw.parallel import CPContext, as_cp_context

    with pytest.raises(ValueError, match="cp_size' = 2 needs cp_group"):
        as_cp_context(None, 2)
    assert as_cp_context(None, 1) is None
    context = CPContext.__new__(CPContext)  # a 2-rank context, without a process group
    context.size = 2
    with pytest.raises(ValueError, match="cp_size' = 3 but cp_group has 2 ranks"):
        as_cp_context(context, 3)
    assert as_cp_context(context, 2) is context
    with pytest.raises(ValueError, match="capture_move"):
        CPContext(object(), capture_move="both")
