"""The LSE merge of (out, lse) partials against a logsumexp reference, -inf partials and empty shards included.

Equivalence chain: merging the partials of disjoint key shards (in any grouping) == attention over all keys at once
== merge_partials_reference (stacked softmax over the partials' lse). Values and gradients must stay finite when a
partial is empty (lse = -inf) or when a query sees no key in any shard.
"""

import pytest
import torch

from ds_longstraw.grpo.cp.kinds.attention.ring import merge_in_order
from ds_longstraw.kernels import (
    merge_partials,
    merge_partials_reference,
    partial_attention,
    partial_attention_reference,
)

NEG_INF = float("-inf")


def _partials(gen, heads=3, queries=5, dim=4, count=4):
    outs = [torch.randn(heads, queries, dim, generator=gen, dtype=torch.float64) for _ in range(count)]
    lses = [torch.randn(heads, queries, generator=gen, dtype=torch.float64) * 3 for _ in range(count)]
    return outs, lses


def test_two_partials_match_logsumexp():
    gen = torch.Generator().manual_seed(0)
    (o1, o2), (l1, l2) = _partials(gen, count=2)
    out, lse = merge_partials(o1, l1, o2, l2)
    ref_out, ref_lse = merge_partials_reference([o1, o2], [l1, l2])
    torch.testing.assert_close(lse, torch.logsumexp(torch.stack([l1, l2]), 0), rtol=0, atol=1e-14)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-14)


@pytest.mark.parametrize("pattern", ["first-empty", "second-empty", "both-empty-some-queries", "all-empty"])
def test_minus_inf_partials(pattern):
    """An empty shard gives out = 0, lse = -inf; merged values and their gradients are finite (no NaN)."""
    gen = torch.Generator().manual_seed(1)
    (o1, o2), (l1, l2) = _partials(gen, count=2)
    if pattern in ("first-empty", "all-empty"):
        o1, l1 = torch.zeros_like(o1), torch.full_like(l1, NEG_INF)
    if pattern in ("second-empty", "all-empty"):
        o2, l2 = torch.zeros_like(o2), torch.full_like(l2, NEG_INF)
    if pattern == "both-empty-some-queries":
        l1[:, :2] = NEG_INF
        l2[:, :2] = NEG_INF
        o1[:, :2] = 0
        o2[:, :2] = 0
    leaves = [t.clone().requires_grad_(True) for t in (o1, l1, o2, l2)]
    out, lse = merge_partials(*leaves)
    ref_out, ref_lse = merge_partials_reference([o1, o2], [l1, l2])
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-14)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=1e-14)
    (out.sum() + torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).sum()).backward()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("shard_sizes", [(7, 0, 5, 3), (0, 0, 11), (4, 4, 4, 0, 1)],
                         ids=lambda s: "-".join(map(str, s)))
def test_merged_shards_equal_attention_over_all_keys(shard_sizes):
    """Attention partials over key shards (some empty), merged in order == attention over the concatenated keys;
    gradients through the merge (to q, k, v) == those of the dense reference."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, tq, dim = 4, 2, 6, 8
    total = sum(shard_sizes)
    q = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_heads, total, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_heads, total, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(heads, tq, dim, generator=gen, dtype=torch.float64)
    partials, start = [], 0
    for size in shard_sizes:
        partials.append(partial_attention(q, k[:, start:start + size], v[:, start:start + size], 0.3))
        start += size
    out, lse = merge_in_order(partials)
    ref_out, ref_lse = partial_attention_reference(q, k, v, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-13)
    grads = torch.autograd.grad((out * weights).sum() + lse.sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * weights).sum() + ref_lse.sum(), (q, k, v))
    for mine, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-12)


def test_merge_order_does_not_matter_beyond_rounding():
    gen = torch.Generator().manual_seed(3)
    outs, lses = _partials(gen, count=5)
    forward = merge_in_order(list(zip(outs, lses, strict=True)))
    backward = merge_in_order(list(zip(outs[::-1], lses[::-1], strict=True)))
    ref = merge_partials_reference(outs, lses)
    for a, b, r in zip(forward, backward, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-13)
        torch.testing.assert_close(b, r, rtol=0, atol=1e-13)
