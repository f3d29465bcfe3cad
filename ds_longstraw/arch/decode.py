"""Attention of a batch of decode steps: G sequences, one new token each, that share the prompt's keys.

The G samples of one prompt (rollout/generate.py) all start from the prompt, so their queries meet the prompt's keys
as one block of G queries that each see every prompt key: one partial per prompt page segment (or the remote partial
under context parallelism), read once for the whole batch. Each sample's own keys (its response so far, its
observations' included, and this step's) are its alone: one partial per sample over its rows in OwnRows, where they
lie contiguous (no copy per step, and samples at different positions, after observations of different lengths,
need no mask). The partials merge by log-sum-exp (kernels.merge_partials). This file holds OwnRows and the
full-attention (K/V pages) form; glm_moe_dsa's sparse form (each sample's own top-k over the prompt's and its own
indexer keys, then the absorbed attention's two partials) is in arch/glm_moe_dsa.py beside its segment forward.

Legend: G samples (queries, one per sample), H/K query/kv heads (head h reads kv head h // (H // K)), D head dim,
T keys of a segment (a prompt page segment, or a sample's own rows). q_GHD [G, H, D]; segments token-major
[T, K, D]; out_GHD [G, H, D], lse_GH [G, H].
"""

import torch

from ds_longstraw.kernels import merge_partials, partial_attention


class OwnRows:
    """Each sample's own rows of every paged layer: one buffer per stream, sample-major [samples, capacity, ...], the
    first lengths[g] rows of slot g written (its response so far). A decode step writes its token's rows at each
    running slot's length (write) and reads each slot's rows as one contiguous view (rows); an observation's rows
    are written at once (extend). A slot that stops keeps its place: nothing is copied when the batch shrinks.
    new_buffer(part, shape): an uninitialised tensor like `part` (rollout/generate.py's, which tests poison)."""

    def __init__(self, samples, capacity, new_buffer=None):
        self.samples, self.capacity = samples, capacity
        self.new_buffer = new_buffer or (lambda part, shape: part.new_empty(shape))
        self.buffers = {}  # layer -> tuple of [samples, capacity, ...] per stream
        self.lengths = [0] * samples

    def _buffers(self, layer, parts):
        buffers = self.buffers.get(layer)
        if buffers is None:
            buffers = tuple(self.new_buffer(part, (self.samples, self.capacity, *part.shape[1:])) for part in parts)
            self.buffers[layer] = buffers
        return buffers

    def write(self, layer, slots, parts):
        """This step's rows (a tuple of [len(slots), ...] per stream) at each slot's length; advance() counts them."""
        buffers = self._buffers(layer, parts)
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
        """The slots' rows of `layer` as one batch (a tuple of [len(slots), T, ...] views) where they form one run of
        slots with one length (every sample of a one-turn rollout until the first stops), else None."""
        buffers = self.buffers.get(layer)
        run = None if buffers is None else self._run(slots)
        if run is None:
            return None
        first, length = run
        return tuple(buffer[first: first + len(slots), : length + extra] for buffer in buffers)

    def past(self, past, slot):
        """`past` (a fresh copy of the prompt's) with slot's own rows appended: what a segment forward from the
        slot's state attends to (an observation's capture)."""
        for layer in self.buffers:
            past.append(layer, self.rows(layer, slot))
        return past


def own_partial(q_GHD, k_GTKD, v_GTKD, scale):
    """(out_GHD, lse_GH) of each sample's query over its own keys [G, T, K, D], every sample T of them (plain dense
    attention, no mask: every own key precedes or is the query's token). Scores and softmax in float32 (float64 for
    float64 models)."""
    groups, heads, dim = q_GHD.shape
    kv_heads = k_GTKD.shape[2]
    acc = torch.float64 if q_GHD.dtype == torch.float64 else torch.float32
    q_GKRD = q_GHD.reshape(groups, kv_heads, heads // kv_heads, dim).to(acc)
    scores_GKRT = torch.einsum("gkrd,gtkd->gkrt", q_GKRD, k_GTKD.to(acc)) * scale
    lse_GKR = torch.logsumexp(scores_GKRT, dim=-1)
    probs_GKRT = torch.exp(scores_GKRT - lse_GKR.unsqueeze(-1))
    out_GKRD = torch.einsum("gkrt,gtkd->gkrd", probs_GKRT, v_GTKD.to(acc))
    return out_GKRD.reshape(groups, heads, -1).to(q_GHD.dtype), lse_GKR.reshape(groups, heads)


def decode_attention(q_GHD, shared, own, scale, remote=None):
    """Attention of G single-token queries over the keys they share (`shared`: token-major (K, V) segments of the
    prompt; `remote`: None, or a callable q_HTD -> (out_HTD, lse_HT) over prompt keys on other ranks) and over each
    one's own keys, this step's key last: `own` is (K, V) [G, T, K, D] where the samples have T each
    (OwnRows.batch_rows: one dense batched partial), else a list of each sample's (K, V) [T_g, K, D] (one partial
    per sample, OwnRows.rows). Returns out_GHD."""
    if isinstance(own, tuple):
        out_GHD, lse_GH = own_partial(q_GHD, *own, scale)
    else:
        outs, lses = [], []
        for g, (k_TKD, v_TKD) in enumerate(own):  # every sample has at least this step's key
            part_HTD, part_lse_HT = partial_attention(q_GHD[g].unsqueeze(1), k_TKD.transpose(0, 1),
                                                      v_TKD.transpose(0, 1), scale)
            outs.append(part_HTD[:, 0])
            lses.append(part_lse_HT[:, 0])
        out_GHD, lse_GH = torch.stack(outs), torch.stack(lses)
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
