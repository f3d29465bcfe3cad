"""The chunked gated delta rule with a hand-derived backward (the fast path of ds_longstraw's GDN layers).

Same math and signature as `gated_delta.chunk_gated_delta_rule_autograd`, the plain-autograd form it is tested
against (and both against the token loop `recurrent_gated_delta_rule`). Why a hand-written backward: under plain
autograd the chunk loop records ~10 small ops per 64-token chunk whose intermediates are ~10x the inputs, so
the layers had to recompute them under torch.utils.checkpoint (a second forward inside every backward). This
Function saves only its raw inputs, recomputes the chunk intermediates once in backward without a graph, and
walks the chunks in reverse only for the state gradient; every other gradient is one batched op over all chunks.

Legend (per batch and value head; the leading [B, H, n] are batch, heads, chunks): c tokens per chunk, dk/dv
head dims. Within a chunk, with cum = cumsum(g), D_ij = exp(cum_i - cum_j) (j <= i), beta-scaled Kb, Vb:
    M = I + strict_lower((Kb K^T) * D)          the delta-rule updates as one unit-triangular system
    W = M^-1 Vb,  R = M^-1 (Kb * exp(cum))      new values, and how they read the chunk-start state S
    U = W - R S                                 the chunk's effective updates
    O = (Q * exp(cum)) S + ((Q K^T) * D) U      outputs
    S' = exp(cum_c) S + (K * exp(cum_c - cum))^T U
"""

import torch
import torch.nn.functional as F

from ..dispatch import record
from .fla_bridge import chunk_gated_delta_rule_fla, fla_applies
from .reference import _acc_dtype


def _heads_first(x, heads, acc):
    """[B, T, h, ...] -> [B, heads, T, ...] in accumulation precision; query/key heads repeat for value heads
    (head j reads key head j // (heads // h))."""
    x = x.transpose(1, 2).to(acc)
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _heads_first_backward(d, like):
    """The gradient of `_heads_first` for an input shaped and typed like `like`."""
    if d.shape[1] != like.shape[2]:
        d = d.reshape(d.shape[0], like.shape[2], -1, *d.shape[2:]).sum(2)
    return d.transpose(1, 2).to(like.dtype)


def _unit_rows(x, eps=1e-6):
    """(x / |x|, 1 / |x|) over the last dim, as the model's l2 norm (eps inside the root)."""
    inv = torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    return x * inv, inv


def _unit_rows_backward(d, x, inv):
    return inv * d - x * inv ** 3 * (x * d).sum(dim=-1, keepdim=True)


def _chunked(x, chunk_size):
    """[B, H, T, ...] -> [B, H, n, c, ...], padded with zeros to whole chunks."""
    t = x.shape[2]
    pad = (chunk_size - t % chunk_size) % chunk_size
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk_size, *x.shape[3:])


def _unchunked(x, t):
    return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])[:, :, :t]


class _Prepared:
    """The rule's inputs head-expanded, normalised and scaled (as `gated_delta._prepare`), padded to whole chunks:
    q, k, v [B, H, n, c, d]; b, g [B, H, n, c]. Padded tokens have beta = 0 and g = 0: they write nothing and
    decay nothing. `backward` maps gradients of these back to the raw inputs (no autograd)."""

    def __init__(self, query, key, value, g, beta, use_qk_l2norm, chunk_size):
        acc = _acc_dtype(query)
        heads = value.shape[2]
        self.raw_q, self.raw_k = _heads_first(query, heads, acc), _heads_first(key, heads, acc)
        self.scale = query.shape[-1] ** -0.5
        self.norm = use_qk_l2norm
        q, k = self.raw_q, self.raw_k
        if use_qk_l2norm:
            (q, self.inv_q), (k, self.inv_k) = _unit_rows(q), _unit_rows(k)
        self.chunks = [_chunked(x, chunk_size) for x in (q * self.scale, k, _heads_first(value, heads, acc),
                                                           _heads_first(beta, heads, acc), _heads_first(g, heads, acc))]

    def backward(self, d_q, d_k, d_v, d_b, d_g, raw):
        query, key, value, g, beta = raw
        t = query.shape[1]
        d_q, d_k = _unchunked(d_q, t) * self.scale, _unchunked(d_k, t)
        if self.norm:
            d_q = _unit_rows_backward(d_q, self.raw_q, self.inv_q)
            d_k = _unit_rows_backward(d_k, self.raw_k, self.inv_k)
        return (_heads_first_backward(d_q, query), _heads_first_backward(d_k, key),
                _heads_first_backward(_unchunked(d_v, t), value), _heads_first_backward(_unchunked(d_g, t), g),
                _heads_first_backward(_unchunked(d_b, t), beta))


class _Chunk:
    """Every per-chunk quantity of the forward, computed batched over all chunks (no graph)."""

    def __init__(self, q, k, v, b, gg):
        c = q.shape[-2]
        self.q, self.k, self.v, self.b = q, k, v, b
        self.cum = gg.cumsum(-1)
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        self.strict_lower = lower.clone().fill_diagonal_(False)
        # Masked before exp so that it never overflows above the diagonal.
        self.decay = (self.cum.unsqueeze(-1) - self.cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
        self.growth = self.cum.exp().unsqueeze(-1)
        self.k_beta, self.v_beta = k * b.unsqueeze(-1), v * b.unsqueeze(-1)
        self.kk = self.k_beta @ k.transpose(-1, -2)
        self.system = self.kk * self.decay  # solve_triangular(unitriangular) reads only its strict lower part
        # M^-1 once (a unit lower-triangular inverse, as stable as the solves): then W, R and, in backward, the
        # transposed solves are batched matmuls instead of four triangular solves.
        eye = torch.eye(c, dtype=q.dtype, device=q.device).expand_as(self.system)
        self.inverse = torch.linalg.solve_triangular(self.system, eye, upper=False, unitriangular=True)
        self.new_values = self.inverse @ self.v_beta
        self.read_in = self.k_beta * self.growth
        self.reads = self.inverse @ self.read_in
        self.qk = q @ k.transpose(-1, -2)
        self.intra = self.qk * self.decay
        self.q_decayed = q * self.growth
        self.k_to_end = k * (self.cum[..., -1:] - self.cum).exp().unsqueeze(-1)
        self.chunk_decay = self.cum[..., -1].exp()[..., None, None]

    def initial(self, state):
        """The chunk-start state of the first chunk in accumulation precision (None: zeros)."""
        if state is None:
            return self.q.new_zeros(*self.k.shape[:2], self.k.shape[-1], self.v.shape[-1])
        return state.to(self.q.dtype)

    def output(self, state, tokens, dtype):
        """(the rule's output [B, T, H, dv] in `dtype` from chunk-start state `state`, its final state)."""
        batch, heads = self.q.shape[:2]
        dv = self.v.shape[-1]
        starts, final = self.starts(state)
        out = self.q_decayed @ starts + self.intra @ (self.new_values - self.reads @ starts)
        return out.reshape(batch, heads, -1, dv)[:, :, :tokens].transpose(1, 2).to(dtype), final

    def starts(self, state):
        """The state at every chunk start [B, H, n, dk, dv] and the final state: the only serial part."""
        starts = []
        for i in range(self.q.shape[2]):
            starts.append(state)
            updates = self.new_values[:, :, i] - self.reads[:, :, i] @ state
            state = state * self.chunk_decay[:, :, i] + self.k_to_end[:, :, i].transpose(-1, -2) @ updates
        return torch.stack(starts, dim=2), state


class _ChunkedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, use_qk_l2norm, chunk_size):
        ctx.use_qk_l2norm, ctx.chunk_size = use_qk_l2norm, chunk_size
        ctx.save_for_backward(query, key, value, g, beta, initial_state)
        chunk = _Chunk(*_Prepared(query, key, value, g, beta, use_qk_l2norm, chunk_size).chunks)
        return chunk.output(chunk.initial(initial_state), query.shape[1], query.dtype)

    @staticmethod
    def backward(ctx, d_out, d_final):
        query, key, value, g, beta, initial_state = ctx.saved_tensors
        raw = (query, key, value, g, beta)
        prepared = _Prepared(*raw, ctx.use_qk_l2norm, ctx.chunk_size)
        chunk = _Chunk(*prepared.chunks)
        batch, heads, n, c, dk = chunk.k.shape
        dv = chunk.v.shape[-1]
        acc = chunk.q.dtype
        state = chunk.initial(initial_state)
        starts, _ = chunk.starts(state)
        updates = chunk.new_values - chunk.reads @ starts

        t = query.shape[1]
        d_out = torch.zeros(batch, t, heads, dv, dtype=acc, device=chunk.q.device) if d_out is None else d_out
        d_out = F.pad(d_out.to(acc).transpose(1, 2), (0, 0, 0, n * c - t)).reshape(batch, heads, n, c, dv)
        d_state = torch.zeros_like(state) if d_final is None else d_final.to(acc)

        # The state gradient at every chunk end, last chunk first:
        #   dU_i = intra_i^T dO_i + K_end_i dS_i;  dS_(i-1) = decay_i dS_i + Qd_i^T dO_i - R_i^T dU_i
        intra_t_dout = chunk.intra.transpose(-1, -2) @ d_out
        qd_t_dout = chunk.q_decayed.transpose(-1, -2) @ d_out
        d_ends = [None] * n
        for i in reversed(range(n)):
            d_ends[i] = d_state
            d_updates_i = intra_t_dout[:, :, i] + chunk.k_to_end[:, :, i] @ d_state
            d_state = (d_state * chunk.chunk_decay[:, :, i] + qd_t_dout[:, :, i]
                       - chunk.reads[:, :, i].transpose(-1, -2) @ d_updates_i)
        d_initial = d_state
        d_ends = torch.stack(d_ends, dim=2)

        # Everything else, batched over chunks.
        d_updates = intra_t_dout + chunk.k_to_end @ d_ends
        d_intra = d_out @ updates.transpose(-1, -2)
        d_k_to_end = updates @ d_ends.transpose(-1, -2)
        d_q_decayed = d_out @ starts.transpose(-1, -2)
        d_reads = -(d_updates @ starts.transpose(-1, -2))
        d_chunk_decay = (starts * d_ends).sum((-1, -2))
        inverse_t = chunk.inverse.transpose(-1, -2)
        d_v_beta = inverse_t @ d_updates
        d_read_in = inverse_t @ d_reads
        d_system = -(d_v_beta @ chunk.new_values.transpose(-1, -2) + d_read_in @ chunk.reads.transpose(-1, -2))
        d_system = d_system * chunk.strict_lower  # only the strict lower part entered the inverse

        d_qk = d_intra * chunk.decay
        d_kk = d_system * chunk.decay
        d_decay = (d_intra * chunk.qk + d_system * chunk.kk) * chunk.decay  # d/d(cum_i - cum_j) of exp(.)
        d_q = d_qk @ chunk.k + d_q_decayed * chunk.growth
        d_k_beta = d_kk @ chunk.k + d_read_in * chunk.growth
        d_k = (d_qk.transpose(-1, -2) @ chunk.q + d_kk.transpose(-1, -2) @ chunk.k_beta
               + d_k_to_end * (chunk.cum[..., -1:] - chunk.cum).exp().unsqueeze(-1) + d_k_beta * chunk.b.unsqueeze(-1))
        d_v = d_v_beta * chunk.b.unsqueeze(-1)
        d_b = (d_k_beta * chunk.k).sum(-1) + (d_v_beta * chunk.v).sum(-1)
        to_end = (d_k_to_end * chunk.k_to_end).sum(-1)
        d_cum = (d_decay.sum(-1) - d_decay.sum(-2) + (d_q_decayed * chunk.q_decayed).sum(-1)
                 + (d_read_in * chunk.read_in).sum(-1) - to_end)
        d_cum[..., -1] += to_end.sum(-1) + d_chunk_decay * chunk.chunk_decay[..., 0, 0]
        d_g = d_cum.flip(-1).cumsum(-1).flip(-1)

        grads = prepared.backward(d_q, d_k, d_v, d_b, d_g, raw)
        grads = [d if ctx.needs_input_grad[i] else None for i, d in enumerate(grads)]
        d_initial = None if initial_state is None or not ctx.needs_input_grad[5] else d_initial.to(initial_state.dtype)
        return (*grads, d_initial, None, None)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    """Chunked gated delta rule (WY form within a chunk, state carried across chunks), with a backward that
    keeps only the inputs alive. Layouts and results as `recurrent_gated_delta_rule` (module docstring of
    reference.py) up to rounding; returns (out [B, T, Hv, dv] in the query's dtype, final state or None)."""
    if query.shape[1] == 0:
        raise ValueError("the gated delta rule needs at least one token")
    if fla_applies(query, value, initial_state):  # CUDA: flash-linear-attention's kernel (fla_bridge.py)
        record("gated delta rule", "fla")
        return chunk_gated_delta_rule_fla(query, key, value, g, beta, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel)
    record("gated delta rule", "torch_chunked")
    out, final = _ChunkedDeltaRule.apply(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel,
                                         chunk_size)
    return out, (final if output_final_state else None)


class PreparedDeltaRule:
    """One segment's chunk quantities (no graph), kept to give both its output from an initial state and, once the
    output's gradient is known, its state adjoint: the layer-major prefix pass needs the first before the second,
    and building the quantities costs about a forward.

    state_adjoint(d_out): how the gradient of the segment's initial state depends on the gradient D of its final
    state, given the gradient d_out [B, T, Hv, dv] of its outputs: d(initial state) = A @ D + L, returned as
    (L [B, Hv, dk, dv], A [B, Hv, dk, dk]) in accumulation precision. Neither depends on the initial state (the
    backward's state recurrence is affine in dS and its coefficients are chunk-local), so every context-parallel
    rank can summarise its segments at once and a reverse scan of (L, A) across segments gives each its true D
    (ds_longstraw.grpo.cp.prefix_layers). The recurrence is `_ChunkedDeltaRule.backward`'s, run on [dS | X] with X
    from the identity (the transposed transition):
        dS_(i-1) = (decay_i I - R_i^T K_end_i) dS_i + Qd_i^T dO_i - R_i^T intra_i^T dO_i,
    about (dv + dk) / dv of that loop. Checked against autograd of the token loop in tests/unit/test_kernels.py."""

    def __init__(self, query, key, value, g, beta, use_qk_l2norm_in_kernel=False, chunk_size=64):
        if query.shape[1] == 0:
            raise ValueError("the gated delta rule needs at least one token")
        self.chunk = _Chunk(*_Prepared(query, key, value, g, beta, use_qk_l2norm_in_kernel, chunk_size).chunks)
        self.tokens, self.dtype = query.shape[1], query.dtype

    def output(self, initial_state=None):
        """The rule's output [B, T, Hv, dv] (in the query's dtype) from `initial_state` (None: zeros)."""
        return self.chunk.output(self.chunk.initial(initial_state), self.tokens, self.dtype)[0]

    def state_adjoint(self, d_out):
        chunk = self.chunk
        batch, heads, n, c, dk = chunk.k.shape
        dv = chunk.v.shape[-1]
        acc = chunk.q.dtype
        d_out = F.pad(d_out.to(acc).transpose(1, 2), (0, 0, 0, n * c - self.tokens)).reshape(batch, heads, n, c, dv)
        constant = (chunk.q_decayed.transpose(-1, -2) @ d_out
                    - chunk.reads.transpose(-1, -2) @ (chunk.intra.transpose(-1, -2) @ d_out))  # [B, H, n, dk, dv]
        eye = torch.eye(dk, dtype=acc, device=chunk.q.device).expand(batch, heads, dk, dk)
        joint = torch.cat([torch.zeros(batch, heads, dk, dv, dtype=acc, device=chunk.q.device), eye], -1)
        for i in reversed(range(n)):
            joint = (joint * chunk.chunk_decay[:, :, i]
                     - chunk.reads[:, :, i].transpose(-1, -2) @ (chunk.k_to_end[:, :, i] @ joint))
            joint[..., :dv] += constant[:, :, i]
        return joint[..., :dv], joint[..., dv:]
