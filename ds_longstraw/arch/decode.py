"""Attention of a batch of decode steps: G sequences, one new token each, that share the prompt's keys.

The G samples of one prompt (rollout/generate.py) all start from the prompt, so their queries meet the prompt's keys
as one block of G queries that each see every prompt key: one partial per prompt page segment (or the remote partial
under context parallelism), read once for the whole batch. Each sample's own keys (its response so far, its
observations' included, and this step's) are its alone: they lie contiguous in its slot of OwnRows (no copy per
step), and OwnRows.batch_rows gives every running sample's rows as one batch, padded to the longest running sample's
rows: one batched partial over them (own_partial), each sample's rows past its own count masked out (-inf scores),
so samples at different positions (after observations of different lengths) and slots left between stopped samples
need no per-sample call. own_partial_each is the plain reference (one partial per sample over its rows). The
partials merge by log-sum-exp (kernels.merge_partials). This file holds OwnRows and the full-attention (K/V pages)
form; glm_moe_dsa's sparse form (each sample's own top-k over the prompt's and its own indexer keys, then the
absorbed attention's two partials) is in arch/glm_moe_dsa.py beside its segment forward.

Legend: G samples (queries, one per running sample), S the slots of a batch (the running samples' slots from the
first to the last, stopped ones between them included), W rows per slot in a batch (the longest running sample's),
H/K query/kv heads (head h reads kv head h // (H // K)), D head dim, T keys of a segment (a prompt page segment, or
a sample's own rows). q_GHD [G, H, D]; segments token-major [T, K, D]; out_GHD [G, H, D], lse_GH [G, H].
"""

from dataclasses import dataclass

import torch

from ds_longstraw.kernels import merge_partials, partial_attention

# Rows a batch may read for nothing (padding to the longest running slot, stopped slots between running ones) per
# per-sample call it saves, on CPU: there a call's fixed cost is ~0.05 ms and a row's ~0.15 us (the fused kernel at
# 4 x 33K own rows of the small qwen3_5 shape, one thread: 20 ms for all), so ~330 rows; past that batch_rows
# refuses and the samples take the per-sample calls (one sample 8K rows ahead of three: 9.9 ms batched, 6.3 ms
# each). Elsewhere (CUDA) a row costs a fraction of a ns against a call's kernel launches: no limit (not measured).
PADDING_ROWS_PER_CALL = {"cpu": 300}
# Query heads per kv head at or below which own rows on CPU take two batched products (_own_partial_gemm) instead of
# the fused flash kernel, which blocks its queries and wastes most of each block's product on 1-4 of them. Measured
# on one thread, float32, 2 kv heads of 32: 4 samples x 32,800 rows, 2 query heads per kv head: 18.9 ms fused,
# 10.9 ms here; 4 x 8,192: 4.1 and 2.1 ms. With 8 query heads per kv head (the G samples' queries over the
# prompt's keys) the fused kernel is the faster: 0.9 against 1.7 ms at 16,384 keys.
GEMM_QUERY_HEADS = 4


@dataclass(frozen=True)
class OwnBatch:
    """Several slots' rows of one layer as one batch (OwnRows.batch_rows).

    rows: a tuple of [S, W, ...] views per stream: slots first .. last of the running samples (stopped ones between
    them included: computed and dropped, no copy), W rows each (the longest running sample's count); lengths_S:
    None where every running sample counts all W rows, else [S] long, each slot's rows that count (the rest are
    masked out; a stopped slot's are W: its result is dropped); picks_G: None where the S slots are the G running
    samples in order, else [G] long, each running sample's place among the S."""

    rows: tuple
    lengths_S: torch.Tensor | None
    picks_G: torch.Tensor | None

    def spread(self, x_G, fill):
        """[G, ...] -> [S, ...]: each running sample's entry at its place, `fill` at the stopped slots'."""
        if self.picks_G is None:
            return x_G
        x_S = x_G.new_full((self.rows[0].shape[0], *x_G.shape[1:]), fill)
        x_S[self.picks_G] = x_G
        return x_S

    def pick(self, x_S):
        """[S, ...] -> [G, ...]: the running samples' entries."""
        return x_S if self.picks_G is None else x_S[self.picks_G]

    def each(self):
        """The running samples' rows as views, each its own count (own_partial_slots' form): per running sample, in
        batch order, a tuple of [count, ...] per stream."""
        slots, width = self.rows[0].shape[:2]
        counts = [width] * slots if self.lengths_S is None else self.lengths_S.tolist()
        places = range(slots) if self.picks_G is None else self.picks_G.tolist()
        return [tuple(rows[place, : counts[place]] for rows in self.rows) for place in places]

    def counted_SW(self):
        """[S, W] bool, True at the rows that count; None where all do."""
        if self.lengths_S is None:
            return None
        return torch.arange(self.rows[0].shape[1], device=self.lengths_S.device) < self.lengths_S.unsqueeze(1)


class OwnRows:
    """Each sample's own rows of every paged layer: one buffer per stream, sample-major [samples, capacity, ...], the
    first lengths[g] rows of slot g written (its response so far). A decode step writes its token's rows at each
    running slot's length (write) and reads the running slots' rows as one batch (batch_rows) or each slot's as one
    contiguous view (rows); an observation's rows are written at once (extend). A slot that stops keeps its place:
    nothing is copied when the batch shrinks.
    A batch reads every running slot up to the longest one's rows; the rows past a shorter slot's length are
    masked out, but a masked score still multiplies its value row (0 x NaN is NaN), so batch_rows zeroes them
    first, once: filled[layer][slot] counts the slot's rows that hold numbers (written or zeroed), and only rows
    past it are zeroed (an observation of T tokens makes the others' next batches zero up to T rows each, once).
    new_buffer(part, shape): an uninitialised tensor like `part` (rollout/generate.py's, which tests poison)."""

    def __init__(self, samples, capacity, new_buffer=None):
        self.samples, self.capacity = samples, capacity
        self.new_buffer = new_buffer or (lambda part, shape: part.new_empty(shape))
        self.buffers = {}  # layer -> tuple of [samples, capacity, ...] per stream
        self.filled = {}  # layer -> per slot, its first row that is neither written nor zeroed
        self.lengths = [0] * samples

    def _buffers(self, layer, parts):
        buffers = self.buffers.get(layer)
        if buffers is None:
            buffers = tuple(self.new_buffer(part, (self.samples, self.capacity, *part.shape[1:])) for part in parts)
            self.buffers[layer] = buffers
            self.filled[layer] = [0] * self.samples
        return buffers

    def write(self, layer, slots, parts):
        """This step's rows (a tuple of [len(slots), ...] per stream) at each slot's length; advance() counts them."""
        buffers = self._buffers(layer, parts)
        filled = self.filled[layer]
        for slot in slots:
            filled[slot] = max(filled[slot], self.lengths[slot] + 1)
        run = self._run(slots)
        if run is not None:  # one run of slots at one length: a slice, no index tensors
            first, length = run
            for buffer, part in zip(buffers, parts, strict=True):
                buffer[first: first + len(slots), length] = part
            return
        at = torch.tensor([self.lengths[slot] for slot in slots], device=parts[0].device)
        where = torch.tensor(slots, device=parts[0].device)
        for buffer, part in zip(buffers, parts, strict=True):
            buffer[where, at] = part

    def _run(self, slots):
        """(first slot, length) where `slots` are consecutive and all at one length, else None."""
        first, length = slots[0], self.lengths[slots[0]]
        for offset, slot in enumerate(slots):
            if slot != first + offset or self.lengths[slot] != length:
                return None
        return first, length

    def extend(self, layer, slot, parts):
        """Rows of several tokens (a tuple of token-major [T, ...]) at slot's length; advance() counts them."""
        length = self.lengths[slot]
        for buffer, part in zip(self._buffers(layer, parts), parts, strict=True):
            buffer[slot, length: length + part.shape[0]] = part
        self.filled[layer][slot] = max(self.filled[layer][slot], length + parts[0].shape[0])

    def advance(self, slot, tokens=1):
        self.lengths[slot] += tokens

    def rows(self, layer, slot, extra=0):
        """Slot's own rows of `layer` (a tuple of token-major views, `extra` rows past its length: the step's own,
        written but not yet counted); () where the layer has none yet."""
        buffers = self.buffers.get(layer)
        if buffers is None:
            return ()
        return tuple(buffer[slot, : self.lengths[slot] + extra] for buffer in buffers)

    def batch_rows(self, layer, slots, extra=0):
        """The running slots' (`slots`, in batch order) rows of `layer` as one OwnBatch, each slot counting its
        length plus `extra` rows (the step's own, written but not yet counted): views of the slots from the first
        running one to the last, as many rows as the longest counts, the rows past a running slot's count zeroed
        (once: OwnRows.filled). None where the layer has no rows yet, or where the rows read for nothing would
        cost more than the per-sample calls it saves (PADDING_ROWS_PER_CALL): the caller then takes them."""
        buffers = self.buffers.get(layer)
        if buffers is None:
            return None
        counts = [self.lengths[slot] + extra for slot in slots]
        width = max(counts)
        first, last = min(slots), max(slots)
        limit = PADDING_ROWS_PER_CALL.get(buffers[0].device.type)
        if limit is not None and (last + 1 - first) * width - sum(counts) > limit * (len(slots) - 1):
            return None
        filled = self.filled[layer]
        for slot, count in zip(slots, counts, strict=True):
            assert filled[slot] >= count, f"slot {slot}: {count} rows counted, {filled[slot]} written"
            if filled[slot] < width:
                for buffer in buffers:
                    buffer[slot, filled[slot]: width].zero_()
                filled[slot] = width
        device = buffers[0].device
        picks = None
        if slots != list(range(first, last + 1)):
            picks = torch.tensor([slot - first for slot in slots], device=device)
        lengths = None
        if any(count != width for count in counts):
            at = [width] * (last + 1 - first)  # a stopped slot's rows are all read: its result is dropped
            for slot, count in zip(slots, counts, strict=True):
                at[slot - first] = count
            lengths = torch.tensor(at, device=device)
        return OwnBatch(tuple(buffer[first: last + 1, :width] for buffer in buffers), lengths, picks)

    def past(self, past, slot):
        """`past` (a fresh copy of the prompt's) with slot's own rows appended: what a segment forward from the
        slot's state attends to (an observation's capture)."""
        for layer in self.buffers:
            past.append(layer, self.rows(layer, slot))
        return past


def own_partial(q_GHD, own, scale):
    """(out_GHD, lse_GH) of each running sample's query over its own keys: own an OwnBatch of (K, V) [S, W, K, D]
    (OwnRows.batch_rows), one batched partial over all S slots, each slot's rows past its count masked out (-inf
    scores) and the stopped slots' results dropped. Every counted own key precedes or is the query's token: no
    causal mask. On CPU (float32, float64) with few query heads per kv head, each running sample's two matrix
    products over exactly its rows, in place (own_partial_slots: no padding read, no stopped slot computed); else on
    CPU PyTorch's fused flash kernel (one call, the mask as an additive bias; it reads the keys in place, where the
    dense form's einsum copies them: 3x faster at 4 x 33K keys); elsewhere the dense form (_own_partial_dense). The
    lse in float32 (float64 for float64 models)."""
    if _gemm_applies(q_GHD, q_GHD.shape[1] // own.rows[0].shape[2]):
        return _own_partial_rows(q_GHD, own.each(), scale)
    acc = torch.float64 if q_GHD.dtype == torch.float64 else torch.float32
    q_SHD = own.spread(q_GHD, 0.0)
    k_SWKD, v_SWKD = own.rows
    slots, heads, dim = q_SHD.shape
    kv_heads = k_SWKD.shape[2]
    # the query heads of one kv head stacked as that head's query sequence (kernels/attention/partial.py)
    q_SKRD = q_SHD.reshape(slots, kv_heads, heads // kv_heads, dim)
    counted_SW = own.counted_SW()
    fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is None or q_GHD.device.type != "cpu" or q_GHD.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float64):
        out_SHD, lse_SH = _own_partial_dense(q_SHD, own, scale)
        return own.pick(out_SHD), own.pick(lse_SH)
    bias = None
    if counted_SW is not None:
        bias = torch.zeros(counted_SW.shape, dtype=q_GHD.dtype, device=q_GHD.device)
        bias = bias.masked_fill_(~counted_SW, float("-inf"))[:, None, None, :]
    out_SKRD, lse_SKR = fused(q_SKRD, k_SWKD.transpose(1, 2), v_SWKD.transpose(1, 2), 0.0, False, attn_mask=bias,
                              scale=scale)
    out_SHD, lse_SH = out_SKRD.reshape(slots, heads, -1), lse_SKR.reshape(slots, heads).to(acc)
    return own.pick(out_SHD), own.pick(lse_SH)


def _gemm_applies(q, query_heads_per_kv):
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and query_heads_per_kv <= GEMM_QUERY_HEADS)


def _own_partial_gemm(q_GKRD, own, scale):
    """(out_GKRD, lse_GKR) of G samples' queries, each over its own rows (own: per sample (K, V) [T_g, K, D]), in
    two matrix products per sample that read the rows in place as [T_g, K D] (token-major, the kv heads side by
    side): the sample's queries laid block-diagonally as [K R, K D] (query heads r of kv head k in row k R + r,
    their D values in kv head k's columns, zeros elsewhere), scores [T_g, K R] = rows @ queries^T (the rows as the
    products' long side: half the time of queries @ rows^T, whose batched form was this function's before), a
    softmax along T_g (laid out [K R, T_g]), then [K R, T_g] @ [T_g, K D], of which each kv head's diagonal block
    is its heads' output. K times the products' arithmetic for one read of the rows, which is what costs at a few
    queries. Measured on one thread (float32, 2 kv heads of 32, 2 query heads per kv head), 4 samples of 18,000 /
    32,800 rows: 6.1 / 10.9 ms batched over [S, W] with a mask, 4.9 / 9.0 ms here."""
    samples, kv_heads, per_kv, dim = q_GKRD.shape
    acc = torch.float64 if q_GKRD.dtype == torch.float64 else torch.float32
    q_block = q_GKRD.new_zeros(samples, kv_heads, per_kv, kv_heads, dim)
    for head in range(kv_heads):
        torch.mul(q_GKRD[:, head], scale, out=q_block[:, head, :, head])  # the scale rides on the queries
    q_block = q_block.view(samples, kv_heads * per_kv, kv_heads * dim)
    out_GKRD = q_GKRD.new_empty(q_GKRD.shape)
    lse_GKR = torch.empty(samples, kv_heads, per_kv, dtype=acc, device=q_GKRD.device)
    for g, (k_TKD, v_TKD) in enumerate(own):
        scores = torch.mm(k_TKD.flatten(1), q_block[g].t()).t().contiguous()  # [K R, T_g]
        top = scores.amax(1, keepdim=True)  # finite: a sample counts at least this step's row
        probs = scores.sub_(top).exp_()
        total = probs.sum(1, keepdim=True)
        full = torch.mm(probs, v_TKD.flatten(1)).view(kv_heads, per_kv, kv_heads, dim)
        out_GKRD[g] = torch.diagonal(full, dim1=0, dim2=2).permute(2, 0, 1) / total.view(kv_heads, per_kv, 1)
        lse_GKR[g] = (top + total.log()).view(kv_heads, per_kv)
    return out_GKRD, lse_GKR


def _own_partial_dense(q_SHD, own, scale):
    """own_partial's dense form over all S slots (queries q_SHD, OwnBatch.spread): scores [S, K, R, W] by einsum,
    the uncounted rows -inf, softmax in float32 (float64 for float64 models). Returns (out_SHD, lse_SH)."""
    k_SWKD, v_SWKD = own.rows
    slots, heads, dim = q_SHD.shape
    kv_heads = k_SWKD.shape[2]
    acc = torch.float64 if q_SHD.dtype == torch.float64 else torch.float32
    q_SKRD = q_SHD.reshape(slots, kv_heads, heads // kv_heads, dim).to(acc)
    scores_SKRW = torch.einsum("skrd,swkd->skrw", q_SKRD, k_SWKD.to(acc)) * scale
    counted_SW = own.counted_SW()
    if counted_SW is not None:
        scores_SKRW = scores_SKRW.masked_fill(~counted_SW[:, None, None, :], float("-inf"))
    lse_SKR = torch.logsumexp(scores_SKRW, dim=-1)  # finite: a running sample counts at least this step's key
    probs_SKRW = torch.exp(scores_SKRW - lse_SKR.unsqueeze(-1))
    out_SKRD = torch.einsum("skrw,swkd->skrd", probs_SKRW, v_SWKD.to(acc))
    return out_SKRD.reshape(slots, heads, -1).to(q_SHD.dtype), lse_SKR.reshape(slots, heads)


def own_partial_each(q_GHD, own, scale):
    """own_partial one sample at a time (the plain reference): own a list of each running sample's (K, V)
    [T_g, K, D] (OwnRows.rows), one partial_attention per sample over exactly its rows."""
    outs, lses = [], []
    for g, (k_TKD, v_TKD) in enumerate(own):  # every sample has at least this step's key
        part_HTD, part_lse_HT = partial_attention(q_GHD[g].unsqueeze(1), k_TKD.transpose(0, 1),
                                                  v_TKD.transpose(0, 1), scale)
        outs.append(part_HTD[:, 0])
        lses.append(part_lse_HT[:, 0])
    return torch.stack(outs), torch.stack(lses)


def own_partial_slots(q_GHD, own, scale):
    """own_partial_each's fast form: where _own_partial_gemm applies, each sample's rows through its two products;
    else own_partial_each."""
    if not _gemm_applies(q_GHD, q_GHD.shape[1] // own[0][0].shape[1]):
        return own_partial_each(q_GHD, own, scale)
    return _own_partial_rows(q_GHD, own, scale)


def _own_partial_rows(q_GHD, own, scale):
    """_own_partial_gemm in [G, H, D] / [G, H] (own: per sample (K, V) [T_g, K, D])."""
    samples, heads, dim = q_GHD.shape
    kv_heads = own[0][0].shape[1]
    out_GKRD, lse_GKR = _own_partial_gemm(q_GHD.reshape(samples, kv_heads, heads // kv_heads, dim), own, scale)
    return out_GKRD.reshape(samples, heads, dim), lse_GKR.reshape(samples, heads)


def decode_attention(q_GHD, shared, own, scale, remote=None):
    """Attention of G single-token queries over the keys they share (`shared`: token-major (K, V) segments of the
    prompt; `remote`: None, or a callable q_HTD -> (out_HTD, lse_HT) over prompt keys on other ranks) and over each
    one's own keys, this step's key last: `own` is an OwnBatch (OwnRows.batch_rows: one batched partial,
    own_partial), or a list of each sample's (K, V) [T_g, K, D] (OwnRows.rows: one partial per sample,
    own_partial_slots). Returns out_GHD."""
    own_partial_of = own_partial if isinstance(own, OwnBatch) else own_partial_slots
    out_GHD, lse_GH = own_partial_of(q_GHD, own, scale)
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
