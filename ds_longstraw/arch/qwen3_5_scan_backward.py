"""qwen3_5's Gated DeltaNet in the layer-major exact prefix pass: the math of its backward across segments.

The family half of the "affine_scan" combine's backward (the schedule: ds_longstraw.grpo.cp.kinds.scan.backward, which
reads a GDN layer through GdnScanGrad, grpo/interfaces.RecurrentScanGrad; the capture's half is qwen3_5_scan.py).

What crosses segments backward, and why it is cheap:
  state  the backward of the delta rule's state recurrence is affine in the gradient D of a segment's end state:
         d(start state) = A D + L, where L (from the segment's output gradients) and A (the transposed transition)
         do not depend on the forward state (kernels/gated_delta/chunked.PreparedDeltaRule.state_adjoint). A
         segment's [L | A] composes chunk by chunk (extend_adjoint: d start = A_1 (A_2 D + L_2) + L_1), and applied
         to D like a forward summary to a state (apply_summary), so the segments' summaries fold from the prompt's
         end (D of the last segment: replay's gradient of the prompt's final state) into every segment's true D.
  tail   a segment's end conv tail is the last k-1 tokens of its pre-convolution projection (fewer when the segment
         is shorter, the rest coming from its start tail: tail_grad_before). Its gradient touches only those
         projections, not the recurrence, so a segment's backward runs with zero d(end tail), and the d(start
         tail) of the segments fold from the prompt's end into each segment's share, which goes back through its
         last tokens' projection (tail_projection_grad).
Per chunk the layer splits into its output side (y = mlp_residual(x + finish(o, z)) with o and z as leaves:
output_side) and its input side (the delta rule's roots o, z, end state, end tail from the chunk's start carry:
input_side), so that d(o) and d(z) are known before any state gradient is.
"""

import torch

from ds_longstraw.kernels.gated_delta import PreparedDeltaRule

from .base import grad_leaf, grad_of, inject_gradients
from .qwen3_5_scan import GdnScan, _call_module, forward_replaced


def _compose(summary, bias, product, dv):
    """[L | A] of a piece so far, extended by a later chunk's (bias L_c, product A_c): A A_c and A L_c + L."""
    earlier_bias, earlier_product = summary[..., :dv], summary[..., dv:]
    return torch.cat([earlier_product @ bias + earlier_bias, earlier_product @ product], -1)


class GdnScanGrad(GdnScan):
    """GdnScan with the backward's pieces (grpo/interfaces.RecurrentScanGrad)."""

    def _core(self, h_1TC, state, tail):
        """(o, z, end state, end tail) of the layer's delta rule on input h (the adapter's gdn_core), as the
        module's call (ZeRO-3's hooks gather A_log and dt_bias around it, forward and backward)."""

        def forward(h):
            return self.adapter.gdn_core(self.module, h, state, tail)

        with forward_replaced(self.module, forward):
            return tuple(self.module(h_1TC))

    def prepare(self, x_1TC, start_state, start_tail):
        """(the chunk's PreparedDeltaRule, o, z) of the layer's delta rule on a chunk of layer input x, without a
        graph: the prepared rule gives o now and the state adjoint once d(o) is known, its chunk quantities built
        once."""
        adapter, module = self.adapter, self.module
        with torch.no_grad():
            h = adapter.mixer_input(self.layer, x_1TC)

            def project():
                return adapter.gdn_inputs(module, h, start_tail)

            query, key, value, g, beta, z, _ = _call_module(module, project)
            rule = PreparedDeltaRule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True)
            return rule, rule.output(start_state), z

    def output_side(self, x_1TC, out, z, dy_1TC, backward):
        """(d o, d z, d x) of y = mlp_residual(x + finish(o, z)) given d y."""
        adapter = self.adapter
        x, out, z = grad_leaf(x_1TC), grad_leaf(out), grad_leaf(z)
        with torch.enable_grad():
            y = adapter.mlp_residual(self.layer, x + adapter.gdn_finish(self.module, out, z))
            inject_gradients([y], [dy_1TC], backward)
        return grad_of(out), grad_of(z), grad_of(x)

    def extend_adjoint(self, summary, rule, d_out):
        """A segment's state adjoint summary [L | A] so far (in the state's dtype) extended by a later chunk's (the
        chunk's prepared rule and d(o))."""
        bias, product = rule.state_adjoint(d_out)
        acc = self.state_dtype
        return _compose(summary, bias.to(acc), product.to(acc), self.value_dim)

    def input_side(self, x_1TC, carry, injected, backward):
        """(d x, d start state, d start tail) of a chunk from its start carry (state, tail). injected: the
        gradients of (o, z, end state, end tail), None for zeros (a lockstep dummy)."""
        x = grad_leaf(x_1TC)
        start_state, start_tail = (grad_leaf(t) for t in carry)
        with torch.enable_grad():
            roots = self._core(self.adapter.mixer_input(self.layer, x), start_state, start_tail)
            inject_gradients(roots, injected or [None] * len(roots), backward)
        return grad_of(x), grad_of(start_state), grad_of(start_tail)

    def tail_projection_grad(self, x_1TC, d_tail, backward):
        """d(x) of the pre-convolution projection of the tokens x_1TC given its gradient d_tail."""
        x = grad_leaf(x_1TC)
        with torch.enable_grad():
            projected = self.tail_projection(self.adapter.mixer_input(self.layer, x))
            inject_gradients([projected], [d_tail], backward)
        return grad_of(x)

    def tail_grad_before(self, d_tail, tokens):
        """The share of d(end tail) of a segment of `tokens` tokens that lands on its start tail (a segment
        shorter than the tail's k-1 tokens ends in the last k-1-tokens of its start tail)."""
        passed = torch.zeros_like(d_tail)
        if tokens < self.width:
            passed[..., tokens:] = d_tail[..., : self.width - tokens]
        return passed
