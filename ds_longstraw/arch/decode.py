"""Attention of a batch of decode steps: G sequences, one new token each, that share the prompt's keys.

The G samples of one prompt (rollout/generate.py) all start from the prompt, so their queries meet the prompt's keys
as one block of G queries that each see every prompt key: one partial per prompt page segment (or the remote partial
under context parallelism), read once for the whole batch. Each sample's own keys (its response so far and this
step's) are its alone: a batched dense partial per sample. Samples whose responses differ in length (an
environment's observations, rollout/environment.py) sit at different positions: their own keys share one
position-major buffer, each sample's first rows valid and the rest masked (own_valid_SG). The two partials merge by
log-sum-exp (kernels.merge_partials). This file holds the full-attention (K/V pages) form; glm_moe_dsa's sparse form
(each sample's own top-k over the prompt's and its own indexer keys, then the absorbed attention's two partials) is
in arch/glm_moe_dsa.py beside its segment forward.

Legend: G samples (queries, one per sample), H/K query/kv heads (head h reads kv head h // (H // K)), D head dim,
S own keys per sample, T prompt keys of a segment. q_GHD [G, H, D]; prompt segments token-major [T, K, D]; own keys
position-major [S, G, K, D]; out_GHD [G, H, D], lse_GH [G, H].
"""

import torch

from ds_longstraw.kernels import merge_partials, partial_attention


def own_valid(own_lengths_G, rows):
    """valid_SG [rows + 1, G]: which of the own keys each sample's query sees, where sample g has own_lengths_G[g]
    earlier rows at the buffer's start and this step's key last (None: every sample has all `rows`)."""
    if own_lengths_G is None:
        return None
    earlier_SG = torch.arange(rows, device=own_lengths_G.device).unsqueeze(1) < own_lengths_G.unsqueeze(0)
    return torch.cat([earlier_SG, earlier_SG.new_ones((1, own_lengths_G.numel()))])


def own_partial(q_GHD, k_SGKD, v_SGKD, scale, valid_SG=None):
    """(out_GHD, lse_GH) of each sample's query over its own keys only (plain dense attention: every own key
    precedes or is the query's token; valid_SG masks the rows a sample does not have). Scores and softmax in float32
    (float64 for float64 models)."""
    groups, heads, dim = q_GHD.shape
    kv_heads = k_SGKD.shape[2]
    acc = torch.float64 if q_GHD.dtype == torch.float64 else torch.float32
    q_GKRD = q_GHD.reshape(groups, kv_heads, heads // kv_heads, dim).to(acc)
    scores_GKRS = torch.einsum("gkrd,sgkd->gkrs", q_GKRD, k_SGKD.to(acc)) * scale
    if valid_SG is not None:  # every sample sees at least its own step's key: no row is all -inf
        scores_GKRS = scores_GKRS.masked_fill(~valid_SG.t()[:, None, None, :], float("-inf"))
        # rows a sample does not have were never written: 0 * NaN would reach its output
        v_SGKD = v_SGKD.masked_fill(~valid_SG[:, :, None, None], 0)
    lse_GKR = torch.logsumexp(scores_GKRS, dim=-1)
    probs_GKRS = torch.exp(scores_GKRS - lse_GKR.unsqueeze(-1))
    out_GKRD = torch.einsum("gkrs,sgkd->gkrd", probs_GKRS, v_SGKD.to(acc))
    return out_GKRD.reshape(groups, heads, -1).to(q_GHD.dtype), lse_GKR.reshape(groups, heads)


def decode_attention(q_GHD, shared, k_SGKD, v_SGKD, scale, remote=None, valid_SG=None):
    """Attention of G single-token queries over the keys they share (`shared`: token-major (K, V) segments of the
    prompt; `remote`: None, or a callable q_HTD -> (out_HTD, lse_HT) over prompt keys on other ranks) and over each
    one's own keys [S, G, K, D] (valid_SG: None, all of them; else the ones each sample has, own_valid).
    Returns out_GHD."""
    out_GHD, lse_GH = own_partial(q_GHD, k_SGKD, v_SGKD, scale, valid_SG)
    q_HGD = q_GHD.transpose(0, 1).contiguous()
    for k_TKD, v_TKD in shared:
        if k_TKD.shape[0] == 0:
            continue
        part_HGD, part_lse_HG = partial_attention(q_HGD, k_TKD.transpose(0, 1), v_TKD.transpose(0, 1), scale)
        out_GHD, lse_GH = merge_partials(out_GHD, lse_GH, part_HGD.transpose(0, 1),
                                         part_lse_HG.transpose(0, 1).to(lse_GH.dtype))
    if remote is not None:
        part_HGD, part_lse_HG = remote(q_HGD)
        out_GHD, lse_GH = merge_partials(out_GHD, lse_GH, part_HGD.transpose(0, 1),
                                         part_lse_HG.transpose(0, 1).to(lse_GH.dtype))
    return out_GHD
