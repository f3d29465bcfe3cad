"""A layer kind: how one way of combining across context-parallel ranks runs (arch/specs.CombineRule names it).

capture (grpo/cp/capture.py), exact mode's layer-major prefix pass (grpo/cp/prefix_layers.py), the turns' page
server (grpo/cp/prefix_turns.py) and replay (grpo/topology.py) loop over the model's layers and ask each layer's kind,
found by its spec's `combine` in KINDS; none of them names a kind. A new layer kind is one folder beside attention/,
scan/ and sparse/ whose LayerKind is registered under its rule's name (register_kind), with its CombineRule
registered in arch/specs.py's COMBINE_RULES (what the planner and the topology decide by before any module runs).

Frames carry what every layer's step reads, so a kind's methods take (frame, spec, ...) and nothing loose:
  ShardFrame        one rank's shard of one prompt: its pieces, its chunks, the prompt's state (pages and carries)
  CaptureFrame      the capture's: what a layer hands the next (the final carries, the last top-k selection)
  LayerMajorFrame   the layer-major prefix pass's: the backward hook, the selections, d(final carry)
  PageRequest       one request of a turn's owner to a rank that holds pages it sees (the turns' schedule)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.arch.specs import combine_rule

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.lockstep import ShardChunks
    from ds_longstraw.grpo.state import ChunkBoundary, PrefixState
    from ds_longstraw.offload import Stager
    from ds_longstraw.offload.kind_costs import KindCost
    from ds_longstraw.parallel.groups import CPContext, PromptShards

Selection = tuple[torch.Tensor, torch.Tensor]  # (positions, valid) of a top-k selection

# The turns' requests (a header of (op, layer, query tokens) travels first)
FORWARD, BACKWARD, DONE, SELECT = 1, 2, 3, 4


@dataclass
class ShardFrame:
    """One rank's shard of one prompt in a layer-major phase: the adapter, the transaction's settings, the CP
    context, every rank's pieces, this rank's chunks (lockstep.ShardChunks: the real spans, then the schedule's
    dummy chunks) and the prompt's state (its pages on their tier). chunk: the prefix pass's autograd segment
    (exact mode), the span the exchanges run in."""

    adapter: CausalLMAdapter
    longstraw: LongstrawConfig
    cp: CPContext
    pieces: PromptShards
    chunks: ShardChunks
    state: PrefixState

    @property
    def chunk(self) -> int:
        return self.longstraw.segment_tokens


@dataclass
class CaptureFrame(ShardFrame):
    """The capture: largest, the largest shard's tokens (every rank decides alike from it); boundaries, exact mode's
    per-chunk checkpoints (None in detached mode). A kind writes what the layers above read: final_carry (layer ->
    the prompt's final carry), selection (the last top-k selection), and any decision of its own made in
    begin_capture (say `hold`: the scan's outputs kept between its two halves)."""

    boundaries: list[ChunkBoundary] | None = None
    largest: int = 0
    final_carry: dict[int, Any] = field(default_factory=dict)
    selection: Selection | None = None
    hold: bool = False


@dataclass
class LayerMajorFrame(ShardFrame):
    """Exact mode's layer-major prefix pass: the backward hook, the selections "topk_lse" layers attend
    (kinds/sparse/layer_major.Selections, None where no layer selects) and d(the prompt's final carry) per layer."""

    backward: Callable[[torch.Tensor], Any] | None = None
    selections: Any = None
    d_final_carry: Mapping[int, Sequence[torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class PageRequest:
    """A turn owner's request (its header already read) to a rank whose pages [0, end) it sees (None: all)."""

    owner: int
    op: int
    layer: int
    tokens: int
    end: int | None


class LayerKind:
    """The cross-rank behaviour of one combine rule. Each method runs one layer of one phase over this rank's
    shard; a phase a kind does not run raises NotImplementedError naming the layer (the topology's checks refuse
    such a model before any work: arch/specs.CombineRule)."""

    name = ""

    @property
    def cost(self) -> KindCost:
        """Its bytes for the planner and its seconds for the CP time model: the cost its rule carries
        (arch/specs.CombineRule.cost, offload/kind_costs.py), read where no module runs yet."""
        return combine_rule(self.name).cost

    def begin_capture(self, frame: CaptureFrame) -> None:
        """Once before the capture's first layer, where the model has layers of this kind."""

    def capture(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> torch.Tensor:
        """The layer's mixer output [1, T, C] over the shard from its normed input, its state onto the pages."""
        raise self._not_run(spec, "the capture")

    def capture_rows(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> None:
        """The layer's state onto the pages without its output: the capture's last layer, whose output over the
        prompt no token reads (grpo/cp/capture.py). Every rank calls it for the same layer, so a kind that leaves
        out its exchanges here leaves them out everywhere. Default: the whole capture, its output dropped (a kind
        whose state needs the exchanges anyway, as the scan's carry does)."""
        self.capture(frame, spec, normed)

    def forward(self, frame: LayerMajorFrame, spec: LayerState, normed: torch.Tensor,
                selection: Selection | None) -> tuple[list[torch.Tensor], Selection | None]:
        """(The mixer output per chunk, the last selection): the capture's forward again, no graph, reading what
        the capture kept (the layer-major pass recomputing a group's inputs)."""
        raise self._not_run(spec, "the layer-major prefix pass")

    def backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 d_hidden: torch.Tensor) -> torch.Tensor:
        """d(layer input) [1, T, C] from d(layer output); parameter gradients accumulate."""
        raise self._not_run(spec, "the layer-major prefix pass")

    def rows_backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                      d_hidden: torch.Tensor) -> torch.Tensor:
        """backward of a layer whose output over the prompt feeds nothing (the pass's top layer: d_hidden is zero),
        so only what its state's gradients reach: every rank calls it for the same layer, so a kind that leaves out
        its exchanges here leaves them out everywhere. Default: the whole backward."""
        return self.backward(frame, spec, read_input, d_hidden)

    def answer(self, cp: CPContext, adapter: CausalLMAdapter, stager: Stager, chunk: int,
               request: PageRequest) -> None:
        """Answer a turn owner's request against this rank's pages (the turns' schedule, grpo/cp/prefix_turns.py)."""
        raise RuntimeError(f"rank {cp.rank}: layer {request.layer} ({self.name!r}) takes no page requests "
                           f"(request {request.op} from rank {request.owner})")

    def replay_pages(self, cp: CPContext, state: PrefixState, adapter: CausalLMAdapter, prefix_grad: str,
                     spread: bool) -> Any:
        """The remote_attention replay and scoring reach every rank's pages of this kind through (interfaces.py's
        RemoteAttention or RemoteSelection); spread: each rank replays its own members (grpo/cp/spread.py)."""
        raise NotImplementedError(f"{self.name!r} layers keep no pages that replay attends")

    def _not_run(self, spec: LayerState, phase: str) -> NotImplementedError:
        return NotImplementedError(f"layer {spec.layer}: combine {spec.combine!r} does not run in {phase}")


# combine rule name -> its kind
KINDS: dict[str, LayerKind] = {}


def register_kind(kind: LayerKind) -> LayerKind:
    """Register `kind` under its name, which must be a registered arch/specs.CombineRule (ValueError otherwise, and
    where another kind has the name)."""
    combine_rule(kind.name)
    if KINDS.get(kind.name, kind) is not kind:
        raise ValueError(f"layer kind {kind.name!r} is already registered ({type(KINDS[kind.name]).__name__})")
    KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove the kind called `name` (a test's own kind, after the test)."""
    KINDS.pop(name, None)


def kind_of(spec: LayerState) -> LayerKind:
    """The kind of the layer; ValueError naming the layer where its combine has none registered."""
    kind = KINDS.get(spec.combine)
    if kind is None:
        raise ValueError(f"layer {spec.layer}: combine {spec.combine!r} has no layer kind under context parallelism "
                         f"(registered: {sorted(KINDS)})")
    return kind


def kinds_in(specs: Sequence[LayerState]) -> list[LayerKind]:
    """The distinct kinds of `specs`, in the order their first layers come."""
    out = []
    for spec in specs:
        kind = kind_of(spec)
        if kind not in out:
            out.append(kind)
    return out


def unrun(specs: Sequence[LayerState]) -> list[str]:
    """The combine rules of `specs` that have no layer kind (context parallelism does not run them)."""
    return sorted({spec.combine for spec in specs} - set(KINDS))
