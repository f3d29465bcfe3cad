"""Ulysses-style capture attention: a head/sequence all-to-all instead of the LSE-merged page exchange.

Legend: H query heads, K kv heads, D head dim, N ranks, T_r tokens on rank r, L = sum T_r; q [H, T_r, D] on rank r
before the first all-to-all, [H/N, L, D] after it.

Per attention layer of the capture (cp_attention="ulysses"): each rank computes q, K, V of its own tokens (K/V go
onto its own pages as in the LSE path), then ONE all-to-all turns sequence shards into head shards: rank d
receives its H/N query heads, and the kv heads those query heads read, for every prompt token. Each rank attends
causally over the whole prompt for its heads (key blocks, `capture_chunk` queries at a time), and a second
all-to-all returns each rank's tokens for all heads. KV heads fewer than ranks are replicated (each rank gets the
one kv head its query heads share).

Bytes each rank receives per layer: about (N-1)/N x L/N x (2 H D [q in, out back] + 2 K' D) elements, K' the kv
heads a rank needs; the LSE path's page exchange instead sends rank j's 2 K D T_j to every later rank, O(N^2) over
the group. Ulysses needs H % N == 0 and query-head groups that do not straddle kv heads; it holds L tokens of
H/N heads of one layer at a time (the LSE path holds one shard's pages of one layer). Replay and the exact
prefix pass keep the LSE paths: their queries are few, and a head shard of them would not cut any traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ds_longstraw.grpo.cp.kinds.attention.ring import _pages_KTD, accumulation_dtype, finish_dummies, project_chunks
from ds_longstraw.grpo.state import keep_segment_attention
from ds_longstraw.kernels import partial_attention
from ds_longstraw.parallel.groups import contiguous_bounds

if TYPE_CHECKING:
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.grpo.cp.kinds.base import ShardFrame
    from ds_longstraw.parallel.groups import CPContext


def check_heads(heads: int, kv_heads: int, size: int) -> None:
    """ValueError unless the Ulysses head split works for (H, K, N)."""
    if heads % size:
        raise ValueError(f"'longstraw.cp_attention' = 'ulysses' needs num_attention_heads ({heads}) divisible by "
                         f"cp_size ({size}); use 'lse'")
    per_rank, ratio = heads // size, heads // kv_heads
    if per_rank % ratio and ratio % per_rank:
        raise ValueError(f"'longstraw.cp_attention' = 'ulysses': {per_rank} query heads per rank straddle kv heads "
                         f"(group size {ratio}); use 'lse'")


def _kv_heads_of(rank: int, heads: int, kv_heads: int, size: int) -> tuple[int, int]:
    per_rank, ratio = heads // size, heads // kv_heads
    first = rank * per_rank // ratio
    last = ((rank + 1) * per_rank - 1) // ratio
    return first, last + 1


def _all_to_all(cp: CPContext, send_parts: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]],
                dtype: torch.dtype, layer: int, op: str) -> list[torch.Tensor]:
    """Exchange send_parts[d] -> rank d; returns the parts received from every rank (own part included)."""
    send = torch.cat([p.reshape(-1) for p in send_parts])
    out_sizes = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = torch.empty(sum(out_sizes), dtype=dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=out_sizes,
                           input_split_sizes=[p.numel() for p in send_parts], group=cp.process_group)
    cp.traffic.add(cp.phase_name, layer, op,
                   (sum(out_sizes) - out_sizes[cp.rank]) * recv.element_size())
    parts, offset = [], 0
    for shape, count in zip(recv_shapes, out_sizes, strict=True):
        parts.append(recv[offset:offset + count].view(shape))
        offset += count
    return parts


def ulysses_attention_layer(frame: ShardFrame, spec: LayerState, normed_1TC: torch.Tensor) -> torch.Tensor:
    """One full-attention layer of the capture with Ulysses all-to-alls (no autograd) on contiguous shards; returns
    [1, T_r, C]. frame.chunks: the real chunks, then the schedule's dummies (see grpo/cp/capture.py); the state's
    kept_pool, where there is one, keeps the attention's (out, lse) of this rank's tokens (exact mode's
    prefix_keep_attention): the LSE then makes the trip back too (one more all-to-all, H/N values per token)."""
    adapter, cp, chunks, chunk = frame.adapter, frame.cp, frame.chunks, frame.chunk
    pool, kept_pool, bounds = frame.state.pool, frame.state.kept_pool, contiguous_bounds(frame.pieces)
    layer = spec.layer
    heads, kv_heads, dim = adapter.attention_geometry()
    check_heads(heads, kv_heads, cp.size)
    cp.decisions[(cp.phase_name, layer)] = "ulysses"
    size, scale = cp.size, adapter.attention_scale(layer)
    per_rank = heads // size
    sizes = [hi - lo for lo, hi in bounds]
    spans = chunks.spans
    queries, gates, dummies = project_chunks(adapter, spec, normed_1TC, chunks, pool)
    dtype = normed_1TC.dtype
    q_HTD = torch.cat(queries, 1) if queries else normed_1TC.new_zeros(heads, 0, dim)
    k_KTD, v_KTD = _pages_KTD(pool, spec)
    kv_ranges = [_kv_heads_of(d, heads, kv_heads, size) for d in range(size)]
    kv0, kv1 = kv_ranges[cp.rank]
    # sequence shards -> head shards: q heads of rank d, and the kv heads they read, stacked [q | k | v] per source
    send = [torch.cat([q_HTD[d * per_rank:(d + 1) * per_rank].reshape(-1),
                       k_KTD[kv_ranges[d][0]:kv_ranges[d][1]].reshape(-1),
                       v_KTD[kv_ranges[d][0]:kv_ranges[d][1]].reshape(-1)]) for d in range(size)]
    shapes = [((per_rank + 2 * (kv1 - kv0)) * n * dim,) for n in sizes]
    parts = _all_to_all(cp, send, shapes, dtype, layer, "ulysses_qkv")
    q_parts, k_parts, v_parts = [], [], []
    for part, n in zip(parts, sizes, strict=True):
        q_len, kv_len = per_rank * n * dim, (kv1 - kv0) * n * dim
        q_parts.append(part[:q_len].view(per_rank, n, dim))
        k_parts.append(part[q_len:q_len + kv_len].view(kv1 - kv0, n, dim))
        v_parts.append(part[q_len + kv_len:].view(kv1 - kv0, n, dim))
    q_all, k_all, v_all = torch.cat(q_parts, 1), torch.cat(k_parts, 1), torch.cat(v_parts, 1)
    del parts, q_parts, k_parts, v_parts, send
    length = q_all.shape[1]
    outs, lses = [], []
    for a in range(0, length, chunk):
        b = min(length, a + chunk)
        out, lse = partial_attention(q_all[:, a:b], k_all[:, :b], v_all[:, :b], scale, causal_offset=a)
        outs.append(out)
        lses.append(lse)
    out_all = torch.cat(outs, 1) if outs else q_all
    del q_all, k_all, v_all, outs
    # head shards -> sequence shards
    send = [out_all[:, lo:hi] for lo, hi in bounds]
    parts = _all_to_all(cp, send, [(per_rank, sizes[cp.rank], dim)] * size, dtype, layer, "ulysses_out")
    out_HTD = torch.cat(parts, 0)
    if kept_pool is not None:
        lse_all = torch.cat(lses, 1) if lses else out_all.new_zeros(per_rank, 0, dtype=accumulation_dtype(dtype))
        lse_parts = _all_to_all(cp, [lse_all[:, lo:hi] for lo, hi in bounds], [(per_rank, sizes[cp.rank])] * size,
                                lse_all.dtype, layer, "ulysses_lse")
        lse_HT = torch.cat(lse_parts, 0)
        for a, b, _ in spans:
            keep_segment_attention(kept_pool, spec, (out_HTD[:, a:b], lse_HT[:, a:b]))
    del lses
    results = [adapter.attention_finish(layer, out_HTD[:, a:b], gate)
               for (a, b, _), gate in zip(spans, gates, strict=True)]
    finish_dummies(adapter, layer, dummies)
    return torch.cat(results, 1) if results else normed_1TC.new_zeros(normed_1TC.shape)
