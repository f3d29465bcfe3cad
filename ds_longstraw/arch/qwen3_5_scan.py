"""qwen3_5's Gated DeltaNet across context-parallel ranks: the math of segment summaries, tails and corrections.

The family half of the "affine_scan" combine (arch/specs.py): the context-parallel schedule (ds_longstraw.grpo.cp.
scan, its exchanges, folds in prompt order, checkpoints and lockstep dummies) reads a GDN layer through the adapter's
recurrent_scan(layer), a GdnScan (here, grpo/interfaces.RecurrentScan) or GdnScanGrad (qwen3_5_scan_backward.py,
RecurrentScanGrad). Nothing here exchanges, checkpoints or pads.

Legend: Hv value heads, dk/dv key/value head dims; state S [1, Hv, dk, dv]; a transition summary [1, Hv, dk, dv + dk]
holds [B | P]; conv tail [1, conv_dim, k-1] (the last k-1 tokens of the pre-convolution projection).

Derivation. The delta rule per token (kernels/gated_delta/reference.py) is
    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T
that is  S_t = A_t S_{t-1} + beta_t k_t v_t^T  with  A_t = exp(g_t) (I - beta_t k_t k_t^T)  (dk x dk per head).
Over a segment of T tokens, S_end = P S_0 + B with P = A_T ... A_1 and B = S_end(S_0 = 0): the end state is affine
in the initial state. (In the row-vector convention of the issue, S_end^T = S_0^T M + B^T with M = P^T.)
Every column of S evolves under the same A_t, so one run of the delta rule with the augmented value [v_t | 0_dk]
from the initial state [0 | I] ends in [B | P]. Segment 1 then segment 2 compose as
    (P, B) = (P2 P1, P2 B1 + B2),
so a segment's true initial state is the fold of every earlier segment's summary in order (an exclusive scan); the
fold of all segments' summaries is the prompt's final state, which replay needs. `tests/unit/test_cp_units.py`
checks the affine form and the fold against the plain recurrence.

Output with an unknown initial state, in the same pass. The delta rule is linear in (S_0, v) together, so a
token's output is o_t = o_t(S_0 = 0) + q~_t S_0, where q~_t [dk] (the query as it reads the segment's initial state
through every update since) does not depend on S_0. The same augmented run gives both: its output's first dv
columns are o_t(0) and its last dk columns are q~_t (the state's P columns read by the query). So a segment runs
the delta rule ONCE, from [0 | I], and once S_0 is known its outputs are o(0) + q~ S_0 (one [T, dk] x [dk, dv]
product per head). A segment at the prompt start needs no correction (S_0 = 0): it runs the plain rule.

Conv tails: each segment contributes the last min(T_s, k-1) tokens of its pre-conv projection; a segment's incoming
tail is the last k-1 tokens of zeros(k-1) ++ contributions of every earlier segment (segments shorter than k-1
make the tail span several of them).
"""

from contextlib import contextmanager

import torch

from ds_longstraw.kernels import chunk_gated_delta_rule


@contextmanager
def forward_replaced(module, fn):
    """Call `module(...)` with `fn` as its forward, so that module hooks (ZeRO-3's parameter gathering) still run
    for parameters the module owns directly (GDN's A_log and dt_bias are read outside any submodule)."""
    module.forward = fn
    try:
        yield
    finally:
        del module.forward


def _call_module(module, fn):
    """Run fn() as module's forward, so module hooks (ZeRO-3 parameter gathering) fire for its own parameters."""
    result = {}

    def forward(*_):
        result["value"] = fn()
        return None

    with forward_replaced(module, forward):
        module()
    return result["value"]


def identity_summary(heads, dk, dv, dtype, device):
    """[B | P] of an empty segment: B = 0, P = I."""
    eye = torch.eye(dk, dtype=dtype, device=device).expand(1, heads, dk, dk)
    return torch.cat([torch.zeros(1, heads, dk, dv, dtype=dtype, device=device), eye], dim=-1).contiguous()


def extend_summary(summary, query, key, value, g, beta):
    """Extend a segment's [B | P] summary by the tokens (query, key, value, g, beta) (delta-rule layouts)."""
    return extend_with_outputs(summary, query, key, value, g, beta)[1]


def extend_with_outputs(summary, query, key, value, g, beta):
    """The augmented rule over tokens from `summary` [B | P]: (outputs [1, T, Hv, dv + dk] = [o(0) | q~ P], the
    summary after them)."""
    dk = key.shape[-1]
    augmented = torch.cat([value, value.new_zeros(value.shape[:-1] + (dk,))], dim=-1)
    return chunk_gated_delta_rule(query, key, augmented, g=g, beta=beta, initial_state=summary,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)


def apply_summary(summary, state, dv):
    """The state after a segment with summary [B | P] that starts from `state` (None: zeros)."""
    bias, product = summary[..., :dv], summary[..., dv:]
    return bias if state is None else product @ state.to(product.dtype) + bias


def fold_states(summaries, sizes, dv):
    """Fold segment summaries in order (empty segments skipped); None when every segment is empty."""
    state = None
    for summary, size in zip(summaries, sizes, strict=True):
        if size:
            state = apply_summary(summary, state, dv)
    return state


def fold_tails(parts, counts, width):
    """The conv tail after segments whose last counts[j] pre-conv tokens are right-aligned in parts[j]."""
    tail = torch.zeros_like(parts[0])
    for part, count in zip(parts, counts, strict=True):
        if count:
            tail = torch.cat([tail, part[:, :, width - count:]], dim=-1)[:, :, -width:]
    return tail


def corrected(out_aug, initial, dv):
    """o = o(0) + q~ S_0 from the augmented outputs (S_0 None: zeros)."""
    zero_state = out_aug[..., :dv]
    if initial is None:
        return zero_state
    term = torch.einsum("bthk,bhkv->bthv", out_aug[..., dv:].to(initial.dtype), initial)
    return (zero_state.to(term.dtype) + term).to(out_aug.dtype)


class GdnScan:
    """GDN layer `layer` of a qwen3_5 adapter as the context-parallel scan reads it (grpo/interfaces.RecurrentScan):
    the functions above bound to the layer's dimensions, and its module calls (made as the module's own call where
    the module's direct parameters take part, for ZeRO-3's hooks)."""

    def __init__(self, adapter, module, layer):
        self.adapter, self.module, self.layer = adapter, module, layer
        self.width = module.conv_kernel_size - 1
        self.tail_channels = module.conv_dim
        self.heads, self.key_dim, self.value_dim = module.num_v_heads, module.head_k_dim, module.head_v_dim
        self.dtype, self.state_dtype = adapter.dtype, adapter.state_dtype()

    def identity_summary(self, device):
        return identity_summary(self.heads, self.key_dim, self.value_dim, self.state_dtype, device)

    def tail_projection(self, h_1TC):
        """The pre-convolution projection [1, conv_dim, T] of tokens h_1TC (a segment's tail contribution)."""
        return self.module.in_proj_qkv(h_1TC).transpose(1, 2)

    def fold_tails(self, parts, counts):
        return fold_tails(parts, counts, self.width)

    def inputs(self, h_1TC, tail):
        """((query, key, value, g, beta) of the delta rule, the end tail) of h_1TC after `tail` (None: zeros)."""
        def project():
            return self.adapter.gdn_inputs(self.module, h_1TC, tail, with_gate=False)

        query, key, value, g, beta, _, new_tail = _call_module(self.module, project)
        return (query, key, value, g, beta), new_tail

    def advance(self, inputs, state):
        """The plain rule from `state` (None: zeros): (output [1, T, Hv, dv], end state)."""
        query, key, value, g, beta = inputs
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)

    def extend(self, summary, inputs):
        """The augmented rule from `summary`: ([o(0) | q~] [1, T, Hv, dv + dk], the summary after them)."""
        return extend_with_outputs(summary, *inputs)

    def with_end_state(self, summary, state):
        """The summary of a segment at the prompt start that ended in `state`: its B is that state (its P is
        never read)."""
        return torch.cat([state.to(summary.dtype), summary[..., self.value_dim:]], dim=-1)

    def apply_summary(self, summary, state):
        return apply_summary(summary, state, self.value_dim)

    def fold_states(self, summaries, sizes):
        return fold_states(summaries, sizes, self.value_dim)

    def corrected(self, out_aug, initial):
        return corrected(out_aug, initial, self.value_dim)

    def finish(self, h_1TC, out_1THV):
        """The layer's mixer output [1, T, C]: the output gate of h_1TC, gated norm and out projection of out."""
        z = self.adapter.gdn_gate(self.module, h_1TC)
        return self.adapter.gdn_finish(self.module, out_1THV, z)

    def forward(self, h_1TC, state, tail):
        """The layer's mixer from (state, tail) (None: the prompt start): (output [1, T, C], end state, end tail)."""
        return self.adapter.gdn_forward(self.module, h_1TC, state, tail)
