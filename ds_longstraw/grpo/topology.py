"""Where the prompt lives and what crosses ranks: the two topologies the transaction (transaction.py) runs over.

The transaction is written once; it asks its topology for each phase's placement and exchanges:

                 OneRank (no exchange)                    ContextParallel (the prompt sharded over a CP group)
  capture        token-major: chunk by chunk through      layer-major: per layer, the shard with the exchange its
                 every layer (state.capture_prefix)       spec's combine needs (grpo/cp/capture.py)
  replay view    the carry as leaves, the pages staged    the carry as leaves; the pages of every rank reached by
                 a layer at a time (replay.prefix_leaves)  all-gathered (out, lse) partials (grpo/cp/kinds/attention/;
                                                          a global top-k's candidates first: grpo/cp/kinds/sparse/)
  prefix         one reverse pass (prefix_pass.py)        a turn per CP segment, last first (grpo/cp/prefix_turns.py)
  reduce         nothing                                  one all-reduce of .grad over the CP group, unless the
                                                          caller reduces (caller_reduces: the DeepSpeed engine)

`build_topology` makes a topology whole, at the door: it validates the settings against the model and the group
(`check_topology`, pure: a ValueError naming the key before any work), resolves what the transaction runs (the CP
layout, the prefix pass's schedule and prefix_inputs_every for the prompt's length, who reduces) and returns a
ready object. The transaction calls it through `Topology` (below); what replay's attention reaches on other ranks
is interfaces.py's.

The schedule (lockstep.Schedule; under ZeRO-3 a lockstep.Lockstep) says how many dummy calls pad each phase; each
topology puts them where its own loops are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from ds_longstraw.grpo.cp.capture import cp_capture_prefix
from ds_longstraw.grpo.cp.gathered import GatheredPages
from ds_longstraw.grpo.cp.kinds import KINDS, LayerKind, kinds_in, unrun
from ds_longstraw.grpo.cp.kinds.attention.ulysses import check_heads
from ds_longstraw.grpo.cp.kinds.sparse.selection import check_sparse, uses_selection
from ds_longstraw.grpo.cp.prefix_layers import layer_major_prefix_backward
from ds_longstraw.grpo.cp.prefix_turns import cp_prefix_backward
from ds_longstraw.grpo.cp.spread import gather_members
from ds_longstraw.grpo.interfaces import RemoteAttention, RemoteSelection
from ds_longstraw.grpo.lockstep import ReplayLockstep, Schedule, padded_to_common, replayed_members
from ds_longstraw.grpo.memory import free_device_bytes
from ds_longstraw.grpo.prefix_pass import ReversePass, prefix_backward
from ds_longstraw.grpo.replay import PrefixLeaves, ResponsePast, carry_leaves, prefix_leaves
from ds_longstraw.grpo.state import PrefixState, capture_prefix, keeps_kept_streams
from ds_longstraw.models.model_shape import shape_from_config
from ds_longstraw.offload.auto import (
    gathered_bytes,
    graph_budget,
    inputs_every_for,
    layer_major_fits,
    layout_for,
    prefix_schedule,
    replay_schedule,
)
from ds_longstraw.offload.plan import captured_tokens_per_rank
from ds_longstraw.parallel.experts import is_expert_param
from ds_longstraw.parallel.groups import CPContext, as_cp_context

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed import ProcessGroup

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.arch.specs import LayerState
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.group import GRPOGroup
    from ds_longstraw.grpo.lockstep import Lockstep
    from ds_longstraw.offload.state_shape import ModelShape


@dataclass
class ReplayView:
    leaves: PrefixLeaves
    # None (the prompt's pages are local), or the attention over the pages of every rank (interfaces.py)
    remote_attention: RemoteAttention | RemoteSelection | None = None
    # "cp_replay": "gathered": the whole prompt's pages gathered on this rank (grpo/cp/gathered.py); else None
    gathered: GatheredPages | None = None

    def release(self) -> None:
        """Drop the staged pages; a gathered view also returns its pages' gradients to their ranks (exact mode:
        collective over the CP group, so every rank releases at the same point) and frees what it gathered."""
        self.leaves.release()
        if self.gathered is not None:
            self.gathered.release()


class Topology(Protocol):
    """What the transaction (transaction.py; generate's capture and decoding too) calls on a topology, phase by
    phase. Made whole by build_topology: nothing is left to initialise."""

    size: int  # ranks the prompt is spread over (1: OneRank)
    rank: int
    cp: CPContext | None  # the context-parallel group (None on one rank)
    reduces: bool  # whether reduce() sums .grad over the ranks (False: one rank, or the caller reduces)

    def phase(self, name: str) -> AbstractContextManager: ...

    # -- capture and the replay's view of it ------------------------------------------------------------------
    def capture(self, adapter: CausalLMAdapter, prompt_ids: torch.Tensor, longstraw: LongstrawConfig,
                prefix_grad: str, schedule: Schedule, progress: Callable | None = None) -> PrefixState: ...

    def replay_view(self, adapter: CausalLMAdapter, state: PrefixState, prefix_grad: str) -> ReplayView: ...

    # -- reference scoring and replay ------------------------------------------------------------------------
    def replay_members(self, group: GRPOGroup) -> list[int]: ...

    def replay_lockstep(self, group: GRPOGroup, longstraw: LongstrawConfig) -> Schedule | None: ...

    def member_weight(self) -> float: ...

    def collect_members(self, values: list, members: list[int], count: int) -> list: ...

    def collect_loss(self, loss: float) -> float: ...

    def collect_final_carry_grads(self, d_final: dict) -> dict: ...

    # -- exact mode's prefix pass -----------------------------------------------------------------------------
    def prefix(self, reverse: ReversePass, d_final: dict, longstraw: LongstrawConfig, schedule: Schedule) -> None:
        """Exact mode's reverse pass over the captured prompt (reverse.ids: prompt[:-1]) from d_final (layer ->
        d(its carry) after the prompt), the schedule's padding included."""

    # -- the gradients ----------------------------------------------------------------------------------------
    def begin_gradients(self, model: torch.nn.Module) -> dict | None: ...

    def after_replay(self, model: torch.nn.Module) -> None: ...

    def reduce(self, model: torch.nn.Module, before: dict | None) -> None: ...

    def report(self, state: PrefixState, group: GRPOGroup) -> dict: ...


class OneRank:
    """The whole prompt on this rank; nothing is exchanged."""

    size, rank = 1, 0
    cp = None
    reduces = False  # nothing to sum over

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def capture(self, adapter: CausalLMAdapter, prompt_ids: torch.Tensor, longstraw: LongstrawConfig,
                prefix_grad: str, schedule: Schedule, progress: Callable[[int], object] | None = None) -> PrefixState:
        # A lockstep pads this rank's module calls to the other ranks': a kept graph would change which segments
        # the prefix pass runs, so it keeps none there.
        budget = 0 if schedule.pads_calls else capture_graph_budget(longstraw, prefix_grad, adapter.device)
        state = capture_prefix(adapter, prompt_ids, longstraw, prefix_grad, progress=progress, graph_budget=budget)
        schedule.pad_capture(adapter, state.last_layer_whole)
        return state

    def replay_view(self, adapter: CausalLMAdapter, state: PrefixState, prefix_grad: str) -> ReplayView:
        return ReplayView(prefix_leaves(adapter, state, prefix_grad))

    def prefix(self, reverse: ReversePass, d_final: dict[int, tuple[torch.Tensor, ...]],
               longstraw: LongstrawConfig, schedule: Schedule) -> None:
        prefix_backward(replace(reverse, prefix_recompute=longstraw.prefix_recompute_runs), d_final)
        schedule.pad_prefix(reverse.adapter, reverse.backward, reverse.state.last_layer_whole)

    def begin_gradients(self, model: torch.nn.Module) -> None:
        """What .grad holds before the group, kept out of this topology's reduction: none here."""
        return None

    def after_replay(self, model: torch.nn.Module) -> None:
        """Replay's gradients are complete: nothing to rescale."""

    def reduce(self, model: torch.nn.Module, before: dict[str, torch.Tensor | None] | None) -> None:
        """Nothing to sum over (reduces is False)."""

    def replay_members(self, group: GRPOGroup) -> list:
        """The members this rank replays and scores: all of them."""
        return list(range(group.size))

    def replay_lockstep(self, group: GRPOGroup, longstraw: LongstrawConfig) -> None:
        """A schedule the replay needs although the caller gave none: none here."""
        return None

    def member_weight(self) -> float:
        return 1.0

    def collect_members(self, values: Sequence[torch.Tensor], members: list[int], count: int) -> list:
        """Per-member values of every member from those this rank replayed: all of them, here."""
        return list(values)

    def collect_loss(self, loss: float) -> float:
        return loss

    def collect_final_carry_grads(self, d_final: dict[int, tuple[torch.Tensor, ...]]) -> dict:
        return d_final

    def report(self, state: PrefixState, group: GRPOGroup) -> dict:
        return {}


class ContextParallel:
    """The prompt's tokens sharded over a context-parallel group (every rank calls the transaction with the same
    group, config and CP group).

    replay   "cp_replay": "replicated": every rank replays every member, identically: its attention layers reach
             the prompt pages of all ranks through all-gathered (out, lse) partials, so logits, losses and replay's
             gradients are the same on every rank. Exact mode: d(rows) of each rank's pages go to its own gradient
             pages, d(final carry) is on all ranks.
             "spread": rank r replays its own members (m mod N = r; grpo/cp/spread.py): queries travel to the
             pages' owners and partials back; the members' losses, log-probs and d(final carry) are then summed or
             gathered over the CP group, and replay's gradients are each rank's own members' (no 1/N below).
             "gathered": the same members, replayed over the whole prompt's pages gathered once on every rank
             (grpo/cp/gathered.py), as one process does; exact mode's page gradients go back to their ranks once,
             when the view is released. ("auto" is resolved per prompt by build_topology: resolve_replay.)
    prefix   (exact) a turn per segment of the layout (cp_layout: zigzag, two per rank; contiguous, one), last first;
             the parameter gradients it produces differ per rank (each covers its own tokens)
    reduce   ONE all-reduce over the CP group of (replay's gradients / N + this rank's prefix gradients): the sum
             is the group's gradient, and the same bits land on every rank even where replicated kernels are not
             bit-reproducible (atomics in GPU embedding backward), so CP replicas never drift apart. What .grad held
             before the call is kept apart from the reduction and added back.

    When the caller reduces (caller_reduces: the DeepSpeed engine) there is no CP all-reduce here: the caller's own
    gradient reduction (DeepSpeed's, over every rank of the job) does the summing. Each rank back-propagates the whole
    replay (member loss shares as given) and N x its own prefix-pass share (exact mode: the injected gradients
    d(final carry) and the gradient pages are scaled by N before the prefix pass; the pass is linear in them).
    Summed over the N CP ranks that is N x the group's gradient; averaged over all D x N ranks of D data-parallel
    replicas (what DeepSpeed does with no mpu) it is (1/D) sum over replicas of each replica's group gradient: the
    data-parallel average.
    """

    def __init__(self, cp: CPContext, longstraw: LongstrawConfig, *, prefix_schedule: str | None, inputs_every: int,
                 caller_reduces: bool = False, prompt_tokens: int | None = None, replay: str = "spread") -> None:
        """Made by build_topology, which resolves every argument (this constructor decides nothing).
        prefix_schedule: exact mode's prefix pass ("layer_major", "turns"; None in detached mode) and inputs_every
        its prefix_inputs_every, both for a prompt of prompt_tokens tokens (None: no prompt known: the capture
        then refuses one); caller_reduces: the caller sums the gradients over the group (no reduce here); replay:
        cp_replay resolved ("gathered", "spread" or "replicated")."""
        self.cp = cp
        self.size, self.rank = cp.size, cp.rank
        self.longstraw = longstraw
        self.replay = replay
        self.spread = replay != "replicated"  # each rank its own members: spread or gathered
        self.gathered = replay == "gathered"
        self.prefix_schedule, self.inputs_every = prefix_schedule, inputs_every
        self.caller_reduces = caller_reduces
        self.reduces = not caller_reduces
        self.prompt_tokens = prompt_tokens

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.cp.phase(name)

    def _resolved(self, longstraw: LongstrawConfig) -> LongstrawConfig:
        """settings with prefix_inputs_every as this transaction runs it (build_topology's resolve_inputs_every)."""
        return longstraw.model_copy(update={"prefix_inputs_every": self.inputs_every})

    def capture(self, adapter: CausalLMAdapter, prompt_ids: torch.Tensor, longstraw: LongstrawConfig,
                prefix_grad: str, schedule: Schedule, progress: Callable[[int], object] | None = None) -> PrefixState:
        if prompt_ids.numel() != self.prompt_tokens:  # the prefix schedule (what capture keeps) is this prompt's
            raise ValueError(f"this context-parallel topology was built for a prompt of {self.prompt_tokens} tokens, "
                             f"not {prompt_ids.numel()}: build_topology(..., prompt_tokens=) for each prompt")
        return cp_capture_prefix(adapter, prompt_ids, self._resolved(longstraw), self.cp,
                                 prefix_grad, schedule=schedule,
                                 keep_inputs=prefix_grad == "exact" and self.prefix_schedule == "layer_major")

    def replay_view(self, adapter: CausalLMAdapter, state: PrefixState, prefix_grad: str) -> ReplayView:
        if self.gathered:  # the whole prompt's pages here: one process's view of them
            gathered = GatheredPages(self.cp, adapter, state, prefix_grad)
            return ReplayView(gathered.leaves(adapter, prefix_grad), gathered=gathered)
        # No local prompt pages in the past: every rank's pages, this one's included, are reached through
        # PagesAttention (SparsePagesAttention for layers that attend a global top-k selection).
        # Spread: each rank its own members, queries travel to the pages (grpo/cp/spread.py).
        kind = paged_kind(adapter.specs)
        pages = None if kind is None else kind.replay_pages(self.cp, state, adapter, prefix_grad, self.spread)
        leaves = PrefixLeaves(carry=carry_leaves(state.carry, prefix_grad),
                              past=ResponsePast({layer: [] for layer in adapter.paged_layers}),
                              stager=None if pages is None else pages.stager)
        return ReplayView(leaves, pages)

    # -- who replays which member ("cp_replay") --------------------------------------------------------------
    def replay_members(self, group: GRPOGroup) -> list:
        return replayed_members(group, self.longstraw, self.cp)

    def replay_lockstep(self, group: GRPOGroup, longstraw: LongstrawConfig) -> Lockstep | None:
        """Spread members make the ranks' replays exchange with each other, so ranks with fewer members or blocks
        pad them (capture and the prefix pass pair up already); gathered pages exchange nothing while replaying."""
        if not self.spread or self.gathered:
            return None
        return padded_to_common(group, longstraw, self.cp, self.cp.process_group, ReplayLockstep)

    def member_weight(self) -> float:
        """Under a caller's reduction every CP rank's replay counts N times (the replicated replay's N identical
        copies; the prefix pass's shares are scaled alike, _scale_injected_): spread members weigh N."""
        return float(self.size) if self.spread and self.caller_reduces else 1.0

    def collect_members(self, values: Sequence[torch.Tensor], members: list[int], count: int) -> list:
        return gather_members(self.cp, values, members, count) if self.spread else list(values)

    def collect_loss(self, loss: float) -> float:
        if not self.spread:
            return loss
        total = torch.tensor([loss], dtype=torch.float64)
        torch.distributed.all_reduce(total, group=self.cp.process_group)
        return float(total)

    def collect_final_carry_grads(self, d_final: dict[int, tuple[torch.Tensor, ...]]) -> dict:
        """d(final carry) summed over the members of every rank (spread: each rank has its own members')."""
        if self.spread:
            for parts in d_final.values():
                for part in parts:
                    self.cp.all_reduce_(part, -1, "replay_d_carry")
        return d_final

    def prefix(self, reverse: ReversePass, d_final: dict[int, tuple[torch.Tensor, ...]],
               longstraw: LongstrawConfig, schedule: Schedule) -> None:
        state = reverse.state
        if self.caller_reduces and self.cp.size != 1 and not self.spread:
            # (spread members already weigh N, member_weight: what they injected is N x already)
            _scale_injected_(state, d_final, self.cp.size)
        shard = replace(reverse, ids=self.cp.pieces(state.length).local_tokens(reverse.ids),
                        prefix_recompute=longstraw.prefix_recompute_runs)
        if self.prefix_schedule == "layer_major":
            layer_major_prefix_backward(shard, d_final, self.cp, self._resolved(longstraw), schedule)
        else:
            cp_prefix_backward(shard, d_final, self.cp, longstraw.segment_tokens, schedule)

    def begin_gradients(self, model: torch.nn.Module) -> dict[str, torch.Tensor | None] | None:
        """Detach what .grad holds before the group (added back by reduce); None when the caller reduces."""
        return _take_grads(model) if self.reduces else None

    def after_replay(self, model: torch.nn.Module) -> None:
        if self.reduces and not self.spread:
            _scale_grads_(model, 1.0 / self.cp.size)  # the same on every rank: count them once in the sum

    def reduce(self, model: torch.nn.Module, before: dict[str, torch.Tensor | None] | None) -> None:
        """.grad <- before + the CP sum of what accumulated since begin_gradients."""
        _reduce_and_restore(model, before, self.cp)

    def report(self, state: PrefixState, group: GRPOGroup) -> dict:
        pieces = self.cp.pieces(state.length).mine
        replayed = sum(group.response_ids[m].numel() for m in self.replay_members(group))
        return {"cp": dict(self.cp.report(), shard=pieces[0] if len(pieces) == 1 else pieces, layout=self.cp.layout,
                           prefix=self.prefix_schedule, inputs_every=self.inputs_every, replay=self.replay,
                           replayed_tokens=replayed,
                           replayed_members=self.replay_members(group))}


def paged_kind(specs: Sequence[LayerState]) -> LayerKind | None:
    """The one kind whose pages replay attends (every paged layer's; None: no layer keeps pages); ValueError where
    the paged layers are of several kinds (replay reaches every rank's pages through one view)."""
    kinds = kinds_in([spec for spec in specs if spec.streams])
    if len(kinds) > 1:
        raise ValueError(f"context parallelism replays through one kind of paged layer; these layers' are "
                         f"{[kind.name for kind in kinds]}")
    return kinds[0] if kinds else None


def check_combines(specs: Sequence[LayerState], cp_size: int) -> None:
    """ValueError (before any work) when a layer combines across ranks in a way no layer kind runs (grpo/cp/kinds/)."""
    missing = unrun(specs)
    if missing:
        layers = [spec.layer for spec in specs if spec.combine in missing]
        raise ValueError(f"'longstraw.cp_size' = {cp_size}: layers {layers} combine across ranks by {missing}, "
                         f"which context parallelism does not run yet (it runs {sorted(KINDS)}); use cp_size 1")


def resolve_layout(adapter: CausalLMAdapter, longstraw: LongstrawConfig) -> str:
    """The CP layout this transaction runs ("zigzag" or "contiguous") from longstraw.cp_layout; ValueError (before
    any work) when zigzag is asked for where it does not run; "auto": offload/auto.layout_for. The layout is chosen
    before any prompt is seen (the engine pads its ranks' shards by it), so it asks the prefix rule on the pages'
    tier alone: a prompt whose layer-major pass would not fit the device takes the turns on zigzag shards."""
    blockers = []
    if longstraw.cp_attention != "lse":
        blockers.append(f"cp_attention {longstraw.cp_attention!r}")
    # zigzag: the capture's ring exchange serves attention, the scan folds any pieces in prompt order, the global
    # top-k's candidates merge in canonical order wherever their positions lie, and exact mode's prefix pass takes a
    # turn per piece; Ulysses' all-to-all assumes contiguous shards (each rule says: arch/specs.CombineRule)
    combines = sorted({spec.combine for spec in adapter.specs if not spec.rule.zigzag})
    if combines:
        blockers.append(f"layers that combine by {combines}")
    if longstraw.cp_layout == "zigzag" and blockers:
        raise ValueError(f"'longstraw.cp_layout' = 'zigzag' does not run with {'; '.join(blockers)}: use 'auto' or "
                         "'contiguous'")
    if longstraw.cp_layout == "auto":
        return layout_for(blockers, uses_selection(adapter.specs), lambda: resolve_prefix(adapter, longstraw))
    return longstraw.cp_layout


def resolve_prefix(adapter: CausalLMAdapter, longstraw: LongstrawConfig, tokens_per_rank: int | None = None,
                   device_memory: int | None = None) -> str | None:
    """How exact mode's CP prefix pass runs ("layer_major" or "turns"; None in detached mode, which runs none) from
    longstraw.cp_prefix ("auto": offload/auto.prefix_schedule, with a rank's captured tokens and the device's memory
    where given); ValueError (before any work) when layer_major is asked for where it does not run."""
    combines = sorted({spec.combine for spec in adapter.specs if not spec.rule.layer_major})
    scan = any(spec.rule.recurrent for spec in adapter.specs)
    # a family with recurrent layers declares whether it runs them layer-major (its layer_major_scan)
    blockers = ([f"layers that combine by {combines}"] if combines else []) + (
        [f"{adapter.family} (no recurrent_scan)"] if scan and not adapter.layer_major_scan else [])
    if longstraw.cp_prefix == "layer_major" and blockers:
        raise ValueError(f"'longstraw.cp_prefix' = 'layer_major' does not run with {'; '.join(blockers)}: use 'auto' "
                         "or 'turns'")
    return prefix_schedule(longstraw.prefix_grad, longstraw.cp_prefix, bool(blockers), lambda: layer_major_fits(
        _state_shape(adapter), longstraw.segment_tokens, keeps_kept_streams(adapter, longstraw, longstraw.prefix_grad),
        longstraw.prefix_inputs_every, tokens_per_rank, device_memory))


def capture_graph_budget(longstraw: LongstrawConfig, prefix_grad: str, device: torch.device) -> int | None:
    """The bytes of graph one rank's capture may keep (longstraw.prefix_keep_graph: offload/auto.graph_budget, with
    the memory this rank may still take: grpo/memory.free_device_bytes)."""
    free = free_device_bytes(device) if longstraw.prefix_keep_graph == "fits" and prefix_grad == "exact" else None
    return graph_budget(longstraw.prefix_keep_graph, longstraw.prefix_graph_budget_gb, prefix_grad, free)


def group_device_memory(device: torch.device, cp: CPContext) -> int | None:
    """The smallest total memory of the CP group's CUDA devices (every rank then decides "auto" alike); None off
    CUDA, where the device's memory is the host's and nothing bounds the pass's held tensors."""
    if device.type != "cuda":
        return None
    total = torch.tensor([torch.cuda.get_device_properties(device).total_memory], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MIN, group=cp.process_group)
    return int(total)


def _state_shape(adapter: CausalLMAdapter) -> ModelShape:
    """The planner's view of the adapter's model (per-token state only: no parameter count)."""
    return shape_from_config(adapter.family, adapter.config, adapter.dtype.itemsize, parameters=False)


def resolve_inputs_every(adapter: CausalLMAdapter, longstraw: LongstrawConfig) -> int:
    """longstraw.prefix_inputs_every as the layer-major pass runs it: "auto" resolved by offload/auto.inputs_every_for
    (the same on every rank: a function of the model and settings)."""
    keep = keeps_kept_streams(adapter, longstraw, longstraw.prefix_grad)
    return inputs_every_for(_state_shape(adapter), longstraw.segment_tokens, keep, longstraw.prefix_inputs_every)



def resolve_replay(adapter: CausalLMAdapter, longstraw: LongstrawConfig, prompt_tokens: int | None,
                   device_memory: int | None) -> str:
    """longstraw.cp_replay as this prompt's replay runs it ("auto": offload/auto.replay_schedule, with the bytes the
    whole prompt's gathered pages would take; no prompt known: "spread")."""
    if longstraw.cp_replay == "auto" and prompt_tokens is None:
        return "spread"
    held = 0 if prompt_tokens is None else gathered_bytes(_state_shape(adapter), prompt_tokens, longstraw.prefix_grad)
    return replay_schedule(longstraw.cp_replay, held, device_memory)


def check_topology(adapter: CausalLMAdapter, longstraw: LongstrawConfig, cp_size: int) -> None:
    """ValueError, naming the key, for what the CP schedule does not run over `cp_size` ranks with this model and
    these settings (pure: nothing runs, nothing is set). One rank runs every setting."""
    if cp_size == 1:
        return
    check_combines(adapter.specs, cp_size)
    paged_kind(adapter.specs)
    resolve_layout(adapter, longstraw)
    resolve_prefix(adapter, longstraw)  # its refusals do not depend on the prompt or the device
    check_sparse(adapter.specs, longstraw, cp_size)
    if longstraw.cp_attention == "ulysses":
        heads, kv_heads, _ = adapter.attention_geometry()
        check_heads(heads, kv_heads, cp_size)


def build_topology(adapter: CausalLMAdapter, longstraw: LongstrawConfig,
                   cp_group: ProcessGroup | CPContext | None = None, *, prompt_tokens: int | None = None,
                   caller_reduces: bool = False, decoding: bool = False) -> Topology:
    """The topology a transaction (or a generate call) runs over, whole: OneRank, or ContextParallel over
    `cp_group` (a process group or a parallel.CPContext; validated against longstraw.cp_size). decoding: a
    generate call's, where every rank decodes every sample: its view is the gathered pages' where cp_replay
    resolves to "gathered" for the prompt, else the replicated schedule's (whatever cp_replay says).

    Everything is checked first (as_cp_context, check_topology: a ValueError naming the key before any work), then
    resolved once, the same on every rank: the group's layout (set on its CPContext), the prefix pass's schedule
    and prefix_inputs_every for a prompt of `prompt_tokens` tokens (with the group's smallest device's memory:
    "cp_prefix": "auto"; None: no prompt known, a capture is then refused), and who reduces the gradients
    (caller_reduces: the caller sums them over the group itself, the DeepSpeed engine; else this topology's
    reduce). The group's traffic counters, wait timers and capture decisions start from zero (its report covers
    this call only). Collective over the CP group (the devices' memory)."""
    cp = as_cp_context(cp_group, longstraw.cp_size)  # None for one rank; ValueError on a size mismatch
    if cp is None:
        return OneRank()
    check_topology(adapter, longstraw, cp.size)
    cp.layout = resolve_layout(adapter, longstraw)
    device_memory = group_device_memory(adapter.device, cp)
    tokens = None if prompt_tokens is None else captured_tokens_per_rank(prompt_tokens, cp.size)
    prefix_schedule = resolve_prefix(adapter, longstraw, tokens, device_memory)
    inputs_every = resolve_inputs_every(adapter, longstraw) if prefix_schedule == "layer_major" else 1
    replay = resolve_replay(adapter, longstraw, prompt_tokens, device_memory)
    if decoding and replay != "gathered":
        replay = "replicated"
    cp.reset()
    return ContextParallel(cp, longstraw, prefix_schedule=prefix_schedule, inputs_every=inputs_every,
                           caller_reduces=caller_reduces, prompt_tokens=prompt_tokens, replay=replay)


def _take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Detach the current .grad of every trainable parameter (to be added back after the reduction)."""
    taken = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            taken[name] = param.grad
            param.grad = None
    return taken


def _scale_grads_(model: torch.nn.Module, factor: float) -> None:
    for param in model.parameters():
        if param.requires_grad and param.grad is not None:
            param.grad.mul_(factor)


def _reduce_and_restore(model: torch.nn.Module, taken: dict[str, torch.Tensor | None], cp: CPContext) -> None:
    """.grad <- taken + (sum over the CP ranks of what accumulated since _take_grads), in one all-reduce. A
    parameter that no rank gave a gradient (a part no loss path reaches, say a gradient-free indexer) keeps none,
    as on one rank, so an optimizer leaves it alone: each parameter's has-a-gradient flag (0 or 1, exact in any
    float dtype) rides at the end of the same all-reduce, and its sum says whether any rank had one."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad and not is_expert_param(p)]
    for name, param in model.named_parameters():  # complete already: every CP rank's pairs were sent to them
        if param.requires_grad and is_expert_param(param) and taken.get(name) is not None:
            param.grad = taken[name] if param.grad is None else taken[name] + param.grad
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params]
    flags = [torch.ones(1) if p.grad is not None else torch.zeros(1) for _, p in params]
    parts = [g.reshape(-1).to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    flat = torch.cat(parts + [f.to(parts[0].device) for f in flags])
    cp.all_reduce_(flat, -1, "param_grads")
    offset, counts = 0, flat[flat.numel() - len(params):].tolist()
    for (name, param), grad, count in zip(params, grads, counts, strict=True):
        size = grad.numel()
        before = taken.get(name)
        if count == 0:  # no rank had a gradient: none, as on one rank
            param.grad = before
        else:
            reduced = flat[offset:offset + size].view_as(grad).to(param.dtype)
            param.grad = reduced if before is None else before + reduced
        offset += size


def _scale_injected_(state: PrefixState, d_final: dict[int, tuple[torch.Tensor, ...]], factor: float) -> None:
    """Exact mode under a caller's reduction: scale what the prefix pass injects (d final carry, gradient pages).
    Only the streams whose spec says they carry a gradient are touched: a kept-attention stream sharing the pool
    gets no gradient pages (nor, on the NVMe tier, files of zeros)."""
    for layer, parts in list(d_final.items()):
        d_final[layer] = tuple(part * factor for part in parts)
    pool = state.pool
    for spec in state.specs:
        for stream in spec.streams:
            if stream.grad:
                grad = pool.read_grad(spec.layer, stream.name)
                pool.add_grad(spec.layer, stream.name, 0, grad * (factor - 1))
