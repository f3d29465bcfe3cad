"""grpo_backward: one GRPO group as a transaction, written once for every architecture and topology.

    capture-ref  (kl_coef > 0) capture the reference policy's prompt state without autograd
    score-ref    reference log-probs of every member without a graph; then free that state
    capture      the policy's prompt state without autograd (exact mode: plus chunk-boundary checkpoints; on one
                 rank the first segments with autograd, their graph kept where it fits: kept_graph.py)
    replay       for each member: replay [prompt[-1], response[:-1]] with autograd, backward its loss share,
                 drop the graph (exact mode: d(state) accumulates on gradient pages)
    prefix       (exact mode) reverse pass over the capture chunks, then one backward of the kept graph
    reduce       (context parallelism unless the caller reduces) one all-reduce of .grad over the CP group
What each layer keeps comes from the adapter's layer-state specs (arch/specs.py); where the prompt lives and what
crosses ranks from the topology (topology.py); how this rank pads its calls under ZeRO-3 from the schedule
(lockstep.py). Gradients ACCUMULATE into the parameters' .grad; no optimizer step is taken here.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ds_longstraw.arch import adapter_for, expert_parallel
from ds_longstraw.config import parse_config
from ds_longstraw.group import GRPOGroup
from ds_longstraw.grpo.lockstep import Schedule, padded_to_common
from ds_longstraw.grpo.memory import PhaseMeter
from ds_longstraw.grpo.prefix_pass import ReversePass, prefix_backward
from ds_longstraw.grpo.replay import MemberReplay, final_carry_grads, replay_group, score_group
from ds_longstraw.grpo.state import capture_prefix
from ds_longstraw.grpo.topology import OneRank, Topology, build_topology
from ds_longstraw.kernels.dispatch import kernel_mode
from ds_longstraw.objective import GRPOObjective, LossScope, ScaledObjective, ScopedObjective, check_member_scopes
from ds_longstraw.parallel.experts import check_expert_parallel

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from contextlib import AbstractContextManager
    from typing import Any

    from torch.distributed import ProcessGroup
    from tqdm import tqdm

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.document import SharedDocument
    from ds_longstraw.grpo.lockstep import Lockstep
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.parallel.groups import CPContext

    # rollout.generate.Rollouts, by name only: rollout is a layer above grpo (tests/unit/test_structure.py)
    Rollouts = Any


@dataclass
class GroupResult:
    loss: float
    logprobs: list  # per member, detached, float64 on CPU
    ref_logprobs: list | None
    advantages: torch.Tensor
    phases: dict  # name -> PhaseStats(seconds, peak_bytes)
    retained_bytes: dict  # by layer type
    grad_page_bytes: int = 0
    extras: dict = field(default_factory=dict)
    # objective.report_entropy: per member, the policy's entropy at each response token, detached, float64 on CPU
    # (None for a member that ran in steps); else None
    entropies: list | None = None

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())


@contextmanager
def reference_policy(model: torch.nn.Module, ref_model: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference: a separate model, or the same peft model with its adapters disabled (no weight copy)."""
    if ref_model is not None:
        yield ref_model
    elif hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        raise ValueError("kl_coef > 0 needs ref_model, or a peft policy whose adapters can be disabled")


def _progress_bar(enabled: bool, total: int, desc: str) -> AbstractContextManager[tqdm | None]:
    if not enabled:
        return nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, leave=False)


def _capture(adapter: CausalLMAdapter, group: GRPOGroup, longstraw: LongstrawConfig, reference: bool,
             topology: Topology, schedule: Schedule, parent: PrefixState | None = None) -> PrefixState:
    """The group's prompt captured for the policy (in its gradient mode) or the reference (detached); with
    `parent` (a shared document's capture, one rank) only what follows it."""
    prefix_grad = "detached" if reference else longstraw.prefix_grad
    desc = "capture (reference)" if reference else "capture"
    with _progress_bar(longstraw.progress and topology.size == 1, group.prompt_ids.numel() - 1, desc) as bar:
        progress = None if bar is None else bar.update
        if parent is not None:
            return capture_prefix(adapter, group.prompt_ids[parent.offset + parent.length:], longstraw, prefix_grad,
                                  progress, parent=parent)
        return topology.capture(adapter, group.prompt_ids, longstraw, prefix_grad, schedule, progress=progress)


def score_reference(ref_model: torch.nn.Module, group: GRPOGroup, longstraw: LongstrawConfig,
                    topology: Topology | None = None, schedule: Schedule | None = None,
                    parent: PrefixState | None = None, temperature: float = 1.0) -> list[torch.Tensor]:
    """Reference log-probs of every member at `temperature` (the objective's), without a graph; the reference state
    is freed before returning (with `parent`, a shared document's reference capture: only the group's own part)."""
    topology, schedule = topology or OneRank(), schedule or Schedule()
    adapter = adapter_for(ref_model)
    adapter.logprobs_temperature = temperature
    members = topology.replay_members(group)
    state = _capture(adapter, group, longstraw, True, topology, schedule, parent)
    try:
        view = topology.replay_view(adapter, state, "detached")
        try:
            source = MemberReplay(adapter, view.leaves, group.prompt_ids.numel() - 1, longstraw.replay_block,
                                  view.remote_attention)
            scores = score_group(source, group, schedule=schedule, members=members)
            return topology.collect_members(scores, members, group.size)
        finally:
            view.release()
    finally:
        state.release()  # page files of a host/NVMe tier go on error as on success


def grpo_backward(model: torch.nn.Module, group: GRPOGroup, objective: GRPOObjective | ScaledObjective | None = None,
                  *, longstraw: LongstrawConfig | dict[str, Any] | None = None,
                  ref_model: torch.nn.Module | None = None, cp_group: ProcessGroup | CPContext | None = None,
                  ep_group: ProcessGroup | None = None,
                  backward: Callable[[torch.Tensor], object] | None = None, caller_reduces: bool | None = None,
                  lockstep: Lockstep | None = None, capture: Rollouts | None = None,
                  loss_scope: LossScope | Sequence[LossScope] | None = None) -> GroupResult:
    """Run the GRPO transaction for one group and accumulate the gradient of the group loss into `.grad`.

    objective: a GRPOObjective (default GRPOObjective()). loss_scope: the objective.LossScope the group's shares are
    normalised over (the DeepSpeed engine passes the step's: its groups, or every rank's), or one LossScope per
    member (each member normalised over the micro-batch a trainer drew it into); default the group alone.

    longstraw: the "longstraw" block (dict or LongstrawConfig); prefix_grad "detached" (the captured prompt state is
    a constant) or "exact" (gradients equal full-sequence autograd over prompt + response for every member).
    cp_group: None (one rank), or the process group (or parallel.CPContext) of the context-parallel ranks over
    which the prompt is sharded (every rank calls with the same group; topology.py says what crosses ranks).
    backward: callable run on every scalar that is back-propagated (each member's loss share; in exact mode the
    prefix pass's surrogate sum(output * injected grad), whose gradient is exactly the injected one). Default
    `loss.backward()`; the DeepSpeed engine passes its own engine.backward so ZeRO sees every backward.
    caller_reduces: whether the caller sums the gradients over the ranks itself (the DeepSpeed engine: its own
    reduction over every rank of the job), so that under context parallelism no reduction happens here
    (topology.py, ContextParallel); None: True exactly when a `backward` is given (the engine's case).
    lockstep: None, or a lockstep.Lockstep that pads this rank's module calls to those of the other data-parallel
    ranks (ZeRO-3 gathers weights with collectives; the DeepSpeed engine sets it). Results are unchanged.
    ep_group: with "ep_size" > 1, the process group the model's routed experts are sharded over (shard_experts):
    the CP group under context parallelism, or ranks that each bring their own group. Routed pairs travel to
    their experts' owners (parallel/experts.py); an owner's expert gradients then sum the EP group's tokens (each
    rank's other gradients are its own group's, as without EP). The EP ranks pad their calls to a common shape
    (lockstep.py) unless a lockstep is given.
    capture: None, or the Rollouts of generate(..., keep_capture=True) on this group's prompt with these weights
    and this block: the policy capture is skipped and that captured state is used (rollout/generate.py); it is taken
    from the Rollouts and released when this call returns or raises (refused: ValueError, released too). Under a
    lockstep that pads this rank's capture (or with sharded experts) only a capture padded alike is taken: one
    generate made under a decode lockstep (rollout/generate.py, KeptCapture.check); every rank must then reuse its
    capture alike (engine.grpo_step with one rollout prompt per rank does). The result's extras say "capture_reused".
    """
    request = Request(model, group, objective, parse_config(longstraw), ref_model, cp_group, ep_group, backward,
                      backward is not None if caller_reduces is None else bool(caller_reduces), lockstep)
    with kernel_mode(request.longstraw.kernels):
        return _transaction(request, capture, loss_scope)


@dataclass
class Request:
    """One grpo_backward call as the transaction's frames pass it down (grpo_backward's docstring says each part);
    settings: the parsed "longstraw" block; caller_reduces: resolved."""

    model: torch.nn.Module
    group: GRPOGroup
    objective: GRPOObjective | ScaledObjective | ScopedObjective | None
    longstraw: LongstrawConfig
    ref_model: torch.nn.Module | None
    cp_group: ProcessGroup | CPContext | None
    ep_group: ProcessGroup | None
    backward: Callable[[torch.Tensor], object] | None
    caller_reduces: bool
    lockstep: Lockstep | None
    # a group of grpo_backward_shared (shared.py): the document its prompt starts with, captured already (its
    # capture is the parent of this group's; exact mode adds this group's d(carry at the document's end) to it),
    # and the members' reference log-probs, scored already under the document's reference capture
    document: SharedDocument | None = None
    ref_logprobs: list | None = None


def _transaction(request: Request, capture: Rollouts | None,
                 loss_scope: LossScope | Sequence[LossScope] | None) -> GroupResult:
    """Check the group and its objective (a kept capture is released on a refusal), take the kept capture where it
    fits, scope the objective, run."""
    model, group, longstraw, lockstep = request.model, request.group, request.longstraw, request.lockstep
    objective = request.objective
    try:
        if not isinstance(group, GRPOGroup):
            raise ValueError(f"group must be a GRPOGroup, got {type(group).__name__}")
        objective = objective or GRPOObjective()
        objective.check_group(group)
        if loss_scope is not None and not isinstance(loss_scope, LossScope):
            check_member_scopes(loss_scope, group)
    except ValueError:
        if capture is not None:
            capture.release()
        raise
    # released if it won't fit (another prompt, weights, config, or capture padding than this transaction's)
    reused = None if capture is None else capture.take_capture(model, group, longstraw, lockstep)
    try:
        request.objective = ScopedObjective(objective, loss_scope or objective.scope_of([group]))
        return _run_transaction(request, reused)
    finally:
        if reused is not None:
            reused.release()  # page files of a host/NVMe tier go on error as on success (twice is harmless)


def _run_transaction(request: Request, reused: PrefixState | None) -> GroupResult:
    """capture (or the kept one) -> reference -> replay -> prefix (exact mode) -> reduce, phase by phase."""
    model, group, objective, longstraw = request.model, request.group, request.objective, request.longstraw
    ref_model, cp_group, ep_group, backward = request.ref_model, request.cp_group, request.ep_group, request.backward
    caller_reduces, lockstep = request.caller_reduces, request.lockstep
    adapter = adapter_for(model)
    adapter.logprobs_temperature = objective.temperature  # replay's log-probs at the sampling temperature
    group.check_vocab(adapter.vocab_size)
    if objective.needs_reference and ref_model is None and not hasattr(model, "disable_adapter"):
        raise ValueError("kl_coef > 0 needs ref_model, or a peft policy whose adapters can be disabled")
    topology = build_topology(adapter, longstraw, cp_group, prompt_tokens=group.prompt_ids.numel(),
                              caller_reduces=caller_reduces)
    ep = expert_parallel(model)
    check_expert_parallel(ep, longstraw, ep_group, cp_group)
    if ep is not None:
        ep.reset()
        # the dispatches are collectives over the EP group: its ranks pad to a common shape, whatever they bring
        lockstep = lockstep or padded_to_common(group, longstraw, topology.cp, ep.process_group)
    schedule = lockstep or topology.replay_lockstep(group, longstraw) or Schedule()
    members = topology.replay_members(group)
    weight = topology.member_weight()
    if weight != 1.0:
        objective = ScaledObjective(objective, weight)
    meter = PhaseMeter(adapter.device)
    advantages = objective.advantages(group)

    document = request.document
    ref_logprobs = request.ref_logprobs
    if objective.needs_reference and ref_logprobs is None:
        with meter.phase("reference"), topology.phase("reference"), reference_policy(model, ref_model) as reference:
            ref_logprobs = score_reference(reference, group, longstraw, topology, schedule,
                                           temperature=objective.temperature)

    if reused is None:
        with meter.phase("capture"), topology.phase("capture"):
            state = _capture(adapter, group, longstraw, False, topology, schedule,
                             None if document is None else document.policy)
    else:
        state = reused  # generate's capture (keep_capture): same prompt, weights and config
    prefix_seconds = {}  # exact mode: the prefix pass's forward and backward seconds
    try:
        retained = state.retained_bytes()
        before = topology.begin_gradients(model)
        with meter.phase("replay"), topology.phase("replay"):
            view = topology.replay_view(adapter, state, longstraw.prefix_grad)
            source = MemberReplay(adapter, view.leaves, group.prompt_ids.numel() - 1, longstraw.replay_block,
                                  view.remote_attention, span_capture=longstraw.member_span_capture)
            # generate's kept observations (grpo/kept_spans.py): on one rank, where nothing pads the calls
            kept = None if schedule.pads_calls or topology.size != 1 else state.kept_spans
            loss, logprobs, stepped, entropies = replay_group(source, group, objective, advantages, ref_logprobs,
                                                              backward=backward, schedule=schedule, members=members,
                                                              kept=kept)
            view.release()  # staged (or gathered) pages of the replay are not needed by the prefix pass
            loss = topology.collect_loss(loss / weight)
            if entropies is not None:  # a member that ran in steps has none: NaN, so that a CP gather takes tensors
                entropies = topology.collect_members([torch.full_like(lp, float("nan")) if e is None else e
                                                      for lp, e in zip(logprobs, entropies, strict=True)],
                                                     members, group.size)
            logprobs = topology.collect_members(logprobs, members, group.size)
        topology.after_replay(model)

        if longstraw.prefix_grad == "exact":
            with meter.phase("prefix"), topology.phase("prefix"):
                d_final = topology.collect_final_carry_grads(final_carry_grads(view.leaves))
                # prompt[:-1] (under CP the topology takes this rank's shard of it); under a document, what follows it
                ids = group.prompt_ids[0 if document is None else document.tokens:-1]
                with _progress_bar(longstraw.progress and topology.size == 1, state.length, "prefix pass") as bar:
                    reverse = ReversePass(adapter, state, ids, backward=backward,
                                          progress=None if bar is None else bar.update, timings=prefix_seconds)
                    if document is None:
                        topology.prefix(reverse, d_final, longstraw, schedule)
                    else:  # the group's own part; the document's pass runs once, from every group's d(carry)
                        reverse = replace(reverse, prefix_recompute=longstraw.prefix_recompute_runs)
                        document.add_carry_grads(prefix_backward(reverse, d_final))
        grad_page_bytes = state.pool.grad_bytes()
        del view
        if topology.reduces:  # context parallelism, unless the caller reduces
            with meter.phase("reduce"), topology.phase("reduce"):
                topology.reduce(model, before)
    finally:
        state.release()  # page files of a host/NVMe tier go on error as on success
    extras = {f"prefix_{name}_seconds": value for name, value in prefix_seconds.items()}
    extras["capture_reused"] = reused is not None
    if state.kept_graph is not None:  # exact mode's capture graph kept (grpo/kept_graph.py): its tokens and bytes
        extras["kept_graph_tokens"] = state.kept_graph.tokens
        extras["kept_graph_bytes"] = state.kept_graph.saved_bytes
    extras["members_in_steps"] = stepped  # this rank's replayed members that ran in steps (grpo/member_steps.py)
    extras.update(topology.report(state, group))
    if ep is not None:
        extras["ep"] = ep.report()
    return GroupResult(loss=loss, logprobs=logprobs, ref_logprobs=ref_logprobs, advantages=advantages,
                       phases=meter.phases, retained_bytes=retained, grad_page_bytes=grad_page_bytes, extras=extras,
                       entropies=entropies)
