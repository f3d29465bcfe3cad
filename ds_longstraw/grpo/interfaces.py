"""What replay's attention reaches on other ranks: the remote-attention interfaces of the transaction.

Under context parallelism the prompt's pages stay on the ranks that captured them, so replay (and scoring, and
decoding) has no local prompt pages: each layer's attention over the prompt goes through the replay view's
`remote_attention` (topology.ReplayView), which forward_segment hands to the adapter's layers. What it offers
depends on how the model's layers combine across ranks (arch/specs.py), and which one a view holds is chosen where
the view is made (topology.ContextParallel.replay_view):

  RemoteAttention  "lse" layers: (layer, q_HTD, known=None) -> (out, lse) of the queries over the other ranks'
                   keys (with `known`, the merged result passed through and the remote share of the gradients
                   added in backward); `keys`: None, or (the prefix pass's turns) the request in two halves
                   that the adapter overlaps with its local attention (grpo/cp/prefix_turns.RemoteKeys)
  RemoteSelection  "topk_lse" layers: candidates(layer, selector) of a global top-k selection, then
                   attend(layer, query, positions, valid) -> (out, lse) of the selected rows; `end`: where the
                   remote keys end (the adapter's own past starts there)
Both hold the `stager` through which this rank reads its own pages (closed with the replay's leaves) and close().

The "affine_scan" layers' math reaches the context-parallel schedule (grpo/cp/kinds/scan/) the same
way, through an interface: the adapter's recurrent_scan(layer) is a RecurrentScanGrad (a RecurrentScan with the
pieces of its backward).

A spread replay (grpo/cp/spread.py) wraps the replicated schedule's pages and asks them for this rank's share
only: OwnPages ("lse") and OwnSparsePages ("topk_lse").
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

Partial = tuple[torch.Tensor, torch.Tensor]  # (out, lse)


class Selected(NamedTuple):
    """A block of queries of a "topk_lse" layer and the rows each selected: query, the adapter's query tensors
    ([T, ...] each; None on a rank with no queries of its own in an exchange); positions and valid [T, K] (prompt
    positions, or a rank's local ones where a function says so)."""

    query: tuple[torch.Tensor, ...] | None
    positions: torch.Tensor
    valid: torch.Tensor


class MergedGrad(NamedTuple):
    """What each party's share of a selected attention's d(query) needs, of the MERGED result: its lse, d(out)
    and delta = rowsum(d_out * out) - d_lse (kernels.attention.attention_delta)."""

    lse: torch.Tensor
    d_out: torch.Tensor
    delta: torch.Tensor


class RemoteAttention(Protocol):
    """remote_attention of "lse" layers (grpo/cp/cp_attention.PagesAttention, spread.SpreadPagesAttention,
    prefix_turns.RemotePages, prefix_turns.PageServer)."""

    keys: Callable[[int], Any] | None  # None, or layer -> a request in two halves (prefix_turns.RemoteKeys)

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial: ...


class RemoteSelection(Protocol):
    """remote_attention of "topk_lse" layers (cp_sparse.SparsePagesAttention, spread.SpreadSparsePagesAttention,
    prefix_turns.RemotePages, prefix_turns.PageServer)."""

    end: int  # the remote keys are positions [0, end); the adapter's own past starts there

    def candidates(self, layer: int, selector: tuple) -> Partial | None: ...

    def attend(self, layer: int, query: tuple, positions: torch.Tensor, valid: torch.Tensor) -> Partial: ...


class SelectedRowsPages(Protocol):
    """What the selected rows' autograd node (cp/kinds/sparse/selection.selected_rows_attention) asks of the
    pages it reaches: the merged partial of a selected block, and d(query) given the partial and its gradients
    (sending d(rows) wherever those rows' gradients belong)."""

    def partials(self, layer: int, selected: Selected) -> Partial: ...

    def partial_grads(self, layer: int, selected: Selected, partial: Partial,
                      d_partial: tuple[torch.Tensor, torch.Tensor | None]) -> list: ...


class ReplayPages(Protocol):
    """What a replay view's remote attention is besides RemoteAttention or RemoteSelection: its own pages' stager,
    closed by the replay's leaves (replay.PrefixLeaves.release), and close()."""

    stager: Any

    def close(self) -> None: ...


class OwnPages(ReplayPages, Protocol):
    """This rank's pages' share of an "lse" layer's attention (cp_attention.PagesAttention), for a spread replay."""

    cp: Any  # parallel.groups.CPContext

    def own_partial(self, layer: int, q_HTD: torch.Tensor) -> Partial: ...

    def own_grads(self, layer: int, q_HTD: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                  delta: torch.Tensor) -> torch.Tensor: ...


class OwnSparsePages(ReplayPages, Protocol):
    """This rank's pages' share of a "topk_lse" layer's attention (cp_sparse.SparsePagesAttention), for a spread
    replay."""

    cp: Any
    adapter: Any
    end: int

    def own_candidates(self, layer: int, selector: tuple) -> Partial: ...

    def own_partial(self, layer: int, selected: Selected) -> Partial: ...

    def own_grads(self, layer: int, selected: Selected, merged: MergedGrad) -> list: ...


class RecurrentScan(Protocol):
    """One recurrent layer's math as the context-parallel "affine_scan" schedule reads it (grpo/cp/kinds/scan/; qwen3_5:
    arch/qwen3_5_scan.GdnScan, whose module docstring derives it). A segment of the prompt run from zero initial
    state gives a *summary*, an affine map of its initial state; summaries compose in prompt order, outputs computed
    before the initial state is known are corrected once it is, and the causal convolution's tail (the last `width`
    tokens of the pre-convolution projection) crosses segments too. Nothing here exchanges, checkpoints or pads:
    the schedule does.

    Legend: state [1, heads, key_dim, value_dim] (state_dtype); summary [B | P] [1, heads, key_dim, value_dim +
    key_dim] (state_dtype); tail [1, tail_channels, width]; h_1TC a chunk of the layer's mixer input."""

    width: int  # tokens of the conv tail (the convolution's kernel - 1)
    tail_channels: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype  # the model's
    state_dtype: torch.dtype  # states and summaries

    def identity_summary(self, device: torch.device) -> torch.Tensor:
        """The summary of an empty segment ([0 | I])."""
        ...

    def tail_projection(self, h_1TC: torch.Tensor) -> torch.Tensor:
        """The pre-convolution projection [1, tail_channels, T] of the tokens h_1TC (a module call)."""
        ...

    def fold_tails(self, parts: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
        """The tail after segments, in order, whose last counts[j] projected tokens are right-aligned in parts[j]."""
        ...

    def inputs(self, h_1TC: torch.Tensor,
               tail: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(the recurrence's inputs of a chunk, its end tail) after `tail` (None: the prompt start); module calls."""
        ...

    def advance(self, inputs: tuple[torch.Tensor, ...],
                state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain recurrence from `state` (None: zeros): (outputs [1, T, heads, value_dim], end state)."""
        ...

    def extend(self, summary: torch.Tensor,
               inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence from `summary`: (outputs [o(0) | q~] [1, T, heads, value_dim + key_dim], the summary
        extended by the chunk)."""
        ...

    def with_end_state(self, summary: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The summary of a segment at the prompt start that ended in `state` (its P is never read)."""
        ...

    def apply_summary(self, summary: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """The state after a segment of `summary` from `state` (None: zeros); likewise a backward adjoint summary
        [L | A] applied to the gradient of a segment's end state gives that of its start state."""
        ...

    def fold_states(self, summaries: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor | None:
        """The state after segments of `summaries` (and `sizes` tokens; empty ones skipped) from zeros, in order;
        None when every segment is empty."""
        ...

    def corrected(self, out_aug: torch.Tensor, initial: torch.Tensor | None) -> torch.Tensor:
        """The outputs [1, T, heads, value_dim] of a chunk from its outputs of extend and its segment's initial
        state (None: zeros): o = o(0) + q~ S_0."""
        ...

    def finish(self, h_1TC: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's mixer output [1, T, C] of a chunk from the recurrence's outputs (module calls)."""
        ...

    def forward(self, h_1TC: torch.Tensor, state: torch.Tensor | None,
                tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's mixer from (state, tail) (None: the prompt start): (output [1, T, C], end state, end tail)."""
        ...


class RecurrentScanGrad(RecurrentScan, Protocol):
    """What the layer-major exact prefix pass adds (grpo/cp/kinds/scan/backward.py; qwen3_5: arch/qwen3_5_scan_backward.
    GdnScanGrad). x_1TC: a chunk of the layer's input (before the mixer's norm); backward: as inject_gradients'."""

    def prepare(self, x_1TC: torch.Tensor, start_state: torch.Tensor | None,
                start_tail: torch.Tensor | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the chunk's prepared recurrence, opaque to the schedule; its outputs; its output gate) without a
        graph, from its start carry (None: the prompt start)."""
        ...

    def output_side(self, x_1TC: torch.Tensor, out: torch.Tensor, z: torch.Tensor, dy_1TC: torch.Tensor,
                    backward: Callable[[torch.Tensor], Any] | None) -> tuple[torch.Tensor | None, ...]:
        """(d out, d z, d x) of the layer's output (mixer, residual and MLP) given its gradient dy_1TC."""
        ...

    def extend_adjoint(self, summary: torch.Tensor, rule: Any, d_out: torch.Tensor) -> torch.Tensor:
        """A segment's state adjoint summary [L | A] so far (from identity_summary) extended by a later chunk's
        (its prepared recurrence and d(out))."""
        ...

    def input_side(self, x_1TC: torch.Tensor, carry: tuple[torch.Tensor | None, torch.Tensor | None],
                   injected: Sequence[torch.Tensor | None] | None,
                   backward: Callable[[torch.Tensor], Any] | None) -> tuple[torch.Tensor | None, ...]:
        """(d x, d start state, d start tail) of a chunk from its start carry, given the gradients of its (outputs,
        output gate, end state, end tail) (None: zeros, a lockstep dummy)."""
        ...

    def tail_projection_grad(self, x_1TC: torch.Tensor, d_tail: torch.Tensor,
                             backward: Callable[[torch.Tensor], Any] | None) -> torch.Tensor | None:
        """d(x) of tail_projection of the tokens x_1TC given its gradient."""
        ...

    def tail_grad_before(self, d_tail: torch.Tensor, tokens: int) -> torch.Tensor:
        """The share of a segment's d(end tail) that lands on its start tail (a segment of `tokens` tokens)."""
        ...
