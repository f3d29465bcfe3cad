"""What the transaction asks of a model family's adapter: the contract, declared as Protocols.

`Adapter` is what every adapter gives (capture, replay, the prefix pass, decoding and the head); the layers a
family's specs declare add the members their combine rule's cross-rank code calls (KIND_CONTRACTS, keyed like
LayerState.combine):
    "lse"          DenseAttentionLayers    paged attention, partials merged by log-sum-exp (grpo/cp/kinds/attention/)
    "affine_scan"  RecurrentScanLayers     a recurrence whose segments compose as affine maps (grpo/cp/kinds/scan/)
    "topk_lse"     SparseSelectionLayers   a global top-k selection, then attention over the selected rows
                                           (grpo/cp/kinds/sparse/selection.py)
CausalLMAdapter (base.py) implements Adapter's shared part; a family's adapter the rest (qwen3_5.py,
glm_moe_dsa.py). tests/unit/test_adapter_contract.py holds every registered family's adapter to the contracts its
specs need, member by member and parameter by parameter, so a member the transaction calls cannot go missing or
change its parameters unseen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .base import SegmentOutput
    from .specs import LayerState, SparseGeometry


@runtime_checkable
class Adapter(Protocol):
    """Every family's adapter. `body` is the transformers base model (embed_tokens, layers, norm), `lm_head` its
    head; `specs` the layer-state specs (one per layer, specs.py); `paged_layers` the layers that keep pages."""

    family: str
    config: Any
    body: Any
    lm_head: Any
    specs: list[LayerState]
    paged_layers: list[int]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def state_dtype(self) -> torch.dtype:
        """The dtype recurrent carries are kept in (float32 for bfloat16 models)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[1, T, C] input embeddings of token ids [T]."""

    def logprobs(self, hidden_1TC: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False) -> Any:
        """Log-probs of `targets` under the head (and the entropy per position with_entropy)."""

    def forward_segment(self, ids: torch.Tensor, start: int, carry: dict, past: dict, remote_attention: Any = None,
                        prefix_recompute: bool = False, known_attention: Any = None,
                        need_hidden: bool = True) -> SegmentOutput:
        """Tokens `ids` at positions start.. through every layer, from `carry` and `past` (grad mode as the caller
        set it): hidden states, the new rows of each paged layer, the carry after the segment. need_hidden False
        (a capture): no hidden states; the last layer computes only what later tokens read of it."""

    def decode_step(self, ids_G: torch.Tensor, position: int | torch.Tensor, carry: dict, past: dict, own: Any,
                    remote_attention: Any = None, slots: list[int] | None = None) -> SegmentOutput:
        """One token for each of G samples at `position` (one for all, or [G]), over the shared prompt's `past` and
        each sample's own rows (`own`: arch/decode.OwnRows, the samples in `slots`; the step's rows are written
        there and attended with them)."""

    def mixer_input(self, index: int, hidden_1TC: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s normalised input to its token mixer (attention or recurrence)."""

    def mlp_residual(self, index: int, hidden_1TC: torch.Tensor) -> torch.Tensor:
        """hidden + the layer's MLP (dense or routed experts) of its post-mixer norm."""


@runtime_checkable
class DenseAttentionLayers(Protocol):
    """Layers whose combine is "lse": the cross-rank code projects queries and rows, attends to pages wherever they
    live, merges partials by LSE and finishes the layer's output."""

    def attention_geometry(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim)."""

    def attention_scale(self, index: int) -> float: ...

    def attention_project(self, index: int, h_1TC: torch.Tensor, start: int) -> Any:
        """(q_HTD, row tensors to page, the output gate) of layer `index` for tokens at positions start.."""

    def attention_finish(self, index: int, out_HTD: torch.Tensor, gate: Any) -> torch.Tensor:
        """The layer's mixer output [1, T, C] from the merged attention."""


@runtime_checkable
class RecurrentScanLayers(Protocol):
    """Layers whose combine is "affine_scan": segments summarised as affine maps of their initial carry and folded
    in prompt order across ranks."""

    layer_major_scan: bool  # whether exact mode's layer-major CP prefix pass runs these layers

    def recurrent_scan(self, index: int) -> Any:
        """The layer's scan (grpo/cp/kinds/scan/'s contract: summaries, the fold, the outputs from a carry)."""

    def scan_output_bytes(self, tokens: int) -> int:
        """Bytes one such layer's held outputs take over `tokens` tokens (the one-pass capture's hold)."""


@runtime_checkable
class SparseSelectionLayers(Protocol):
    """Layers whose combine is "topk_lse": each rank proposes its best candidate rows, the global top-k wins, the
    selected rows are attended where they live and merged by LSE; a layer that selects nothing reuses the last
    selection."""

    def sparse_geometry(self, index: int) -> SparseGeometry: ...

    def sparse_project(self, index: int, h_1TC: torch.Tensor, start: int) -> Any:
        """The layer's queries (attention and selector) and row tensors for tokens at positions start.."""

    def sparse_candidates(self, index: int, selector: Any, pages: Any, page_start: int, query_start: Any = None,
                          best: Any = None) -> Any:
        """This rank's best candidate rows for the queries among its pages, merged into `best`."""

    def merge_candidates(self, best: Any, part: Any, interleaved: bool = False) -> Any: ...

    def sparse_selection(self, index: int, best: Any, start: int, tokens: int) -> Any:
        """The selected positions and their validity from the merged candidates."""

    def sparse_partial(self, index: int, query: Any, pages: Any, page_start: int, positions: Any,
                       valid: Any) -> Any:
        """(out, lse) of the queries over the selected rows that lie on `pages`."""

    def sparse_grads(self, index: int, query: Any, pages: Any, page_start: int, positions: Any, valid: Any,
                     lse: Any, d_out: Any, delta: Any) -> Any:
        """The query's and the rows' gradients of that partial, from the merged lse and delta."""

    def attention_finish(self, index: int, o_lat: torch.Tensor, w_uv: Any) -> torch.Tensor:
        """The layer's mixer output [1, T, C] from the merged attention."""


KIND_CONTRACTS = {"lse": DenseAttentionLayers, "affine_scan": RecurrentScanLayers,
                  "topk_lse": SparseSelectionLayers}


def contracts_for(specs) -> list:
    """Adapter, then the contract of every combine rule the specs use (a rule with none adds nothing)."""
    kinds = sorted({spec.combine for spec in specs} & set(KIND_CONTRACTS))
    return [Adapter] + [KIND_CONTRACTS[kind] for kind in kinds]


def _members(protocol) -> dict:
    """name -> the Protocol's own declaration (methods, properties, annotated attributes)."""
    out = {name: value for name, value in vars(protocol).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    out.update({name: None for name in vars(protocol).get("__annotations__", {})})
    return out


def _parameters(function) -> list | None:
    """The parameters' names after self, in order; None for a forwarding wrapper (*args or **kwargs), which takes
    whatever the declaration names."""
    import inspect

    parameters = inspect.signature(function).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return [p.name for p in parameters if p.name != "self"]


def contract_violations(adapter) -> list:
    """'Contract.member: what is wrong' for every member of the contracts the adapter's specs need that its class
    lacks, or whose parameters differ from the declaration's (names, in order; a wrapper that forwards *args or
    **kwargs passes)."""
    problems = []
    for protocol in contracts_for(adapter.specs):
        for name, declared in _members(protocol).items():
            if not hasattr(adapter, name):
                problems.append(f"{protocol.__name__}.{name}: missing")
                continue
            if callable(declared) and not isinstance(declared, property):
                implemented = getattr(type(adapter), name, None)
                if not callable(implemented):
                    problems.append(f"{protocol.__name__}.{name}: not a method")
                elif _parameters(implemented) not in (None, _parameters(declared)):
                    problems.append(f"{protocol.__name__}.{name}: parameters {_parameters(implemented)}, declared "
                                    f"{_parameters(declared)}")
    return problems


def check_contract(adapter) -> None:
    """TypeError naming every member the adapter lacks or declares otherwise (contract_violations)."""
    problems = contract_violations(adapter)
    if problems:
        raise TypeError(f"{type(adapter).__name__} does not meet the adapter contract (arch/contract.py): "
                        + "; ".join(problems))
