"""Log-sum-exp merge of partial attention results.

Legend: out_HTD is an attention output [heads, queries, head_dim]; lse_HT its log-sum-exp of scores
[heads, queries]. A partial over an empty key set has out = 0 and lse = -inf.

Two partials over disjoint key sets combine exactly into the attention over their union:
    lse = log(exp(lse1) + exp(lse2)),   out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)
The merge below is written so that -inf partials (empty shards, or a query that sees no key of a shard) give
neither NaN values nor NaN gradients.
"""

import torch


def merge_partials(out1_HTD, lse1_HT, out2_HTD, lse2_HT):
    """Merge two (out, lse) partials; differentiable, -inf safe."""
    top_HT = torch.maximum(lse1_HT, lse2_HT)
    # A query that no key of either partial reaches keeps lse = -inf; shift by 0 there so nothing is nan.
    shift_HT = torch.where(torch.isinf(top_HT), torch.zeros_like(top_HT), top_HT).detach()
    total_HT = torch.exp(lse1_HT - shift_HT) + torch.exp(lse2_HT - shift_HT)
    # log(0) would give -inf with an infinite derivative (nan gradient): take log(1) there and mask the value.
    seen_HT = total_HT > 0
    lse_HT = torch.where(seen_HT, shift_HT + torch.log(torch.where(seen_HT, total_HT, torch.ones_like(total_HT))),
                         torch.full_like(total_HT, float("-inf")))
    safe_lse_HT = torch.where(torch.isinf(lse_HT), torch.zeros_like(lse_HT), lse_HT)
    w1 = torch.exp(lse1_HT - safe_lse_HT).unsqueeze(-1)
    w2 = torch.exp(lse2_HT - safe_lse_HT).unsqueeze(-1)
    out_HTD = out1_HTD * w1.to(out1_HTD.dtype) + out2_HTD * w2.to(out2_HTD.dtype)
    return out_HTD, lse_HT


def merge_partials_reference(outs, lses):
    """Plain reference: stack the partials and weight them with softmax over their lse (logsumexp)."""
    lse_PHT = torch.stack(lses)
    lse_HT = torch.logsumexp(lse_PHT, dim=0)
    weights = torch.exp(lse_PHT - lse_HT.unsqueeze(0)).nan_to_num(0.0)
    out_HTD = (torch.stack(outs) * weights.unsqueeze(-1)).sum(0)
    return out_HTD, lse_HT
