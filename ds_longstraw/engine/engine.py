"""`ds_longstraw.initialize`: `deepspeed.initialize` whose engine also runs GRPO groups as transactions.

    engine, optimizer, _, scheduler = ds_longstraw.initialize(model=model, optimizer=opt, config="ds.json")
    result = engine.grpo_step(group)          # capture, score, replay, (prefix), ONE reduction, ONE step

What grpo_step is:
  - every rank runs `grpo_backward` on its own group(s) inside `engine.coalesce_grad_reduction()`, routing each
    backward (each member's loss share, and in exact mode the prefix pass's surrogate) through
    `engine.backward(loss, scale_wrt_gas=False)`; gradients stay local on the parameters until the block exits,
    which issues ONE reduction over the data-parallel ranks; then ONE `engine.step()`.
    (FACTS.md: this path matched a single backward of the summed loss under ZeRO-3; per-member backward with
    gradient_accumulation_steps=1 took a wrong step.)
  - under ZeRO-3 the adapters call the model's submodules directly, so DeepSpeed's module hooks gather each
    submodule's partitioned weights when it runs (capture, scoring, replay, prefix pass) and release them after.
    Those gathers are collectives: ranks agree on a common transaction shape first and pad their own work up to
    it with dummy work of zero gradient (lockstep.py), so ranks may bring groups of any sizes and counts.
  - data parallel: rank r brings its own group(s) with loss L_r (each group's loss normalised within the group by
    the objective's loss_agg; several groups on one rank are averaged). DeepSpeed averages gradients over ranks,
    so the step follows the gradient of mean_r L_r: every rank's group weighs the same, whatever its token count.
  - context parallelism ("longstraw": {"cp_size": N}): consecutive ranks [k N, (k+1) N) form CP group k, built by
    `initialize`, inside data-parallel replica k; the N ranks of a replica bring the same group(s) (checked) and
    shard each prompt (parallel/). DeepSpeed sees all D x N ranks as data parallel (weights partitioned over all
    of them) and no explicit CP all-reduce runs: each CP rank back-propagates the whole replay and N x its own
    exact-mode prefix share (topology.py, ContextParallel), so a replica's N ranks sum to N g_replica and DeepSpeed's
    average over D N ranks is (1/D) sum_k g_k, the average over replicas. Under ZeRO-3 the CP capture is padded
    per shard chunk count (lockstep.calls_of(..., cp)) so all D N ranks make the same submodule calls, and exact
    mode's CP prefix turns are mirrored by the ranks not in turn (grpo/cp/prefix_turns.py).
  - groups whose prompts share a document (GRPOGroup.shared_prefix, or a common prefix of at least
    longstraw.shared_prefix_min tokens) capture it once: as one tree transaction (grpo/shared.py) where no lockstep
    pads the ranks' calls (ZeRO 0-2, or one data-parallel rank) and without CP or sharded experts; otherwise as one
    group over the document whose members open with their group's question (grpo/flat_document.py).
What it is not: no gradient accumulation across calls (gradient_accumulation_steps must be 1), no reuse of a
capture across steps. Groups come in with their responses and rewards, or, with `rollout=`, as prompts whose
responses are sampled from the policy (rollout/step.py); with one rollout prompt per rank the step trains on the
rollout's own capture (one prefill per on-policy step; the result's groups say extras["capture_reused"]).
"""

from __future__ import annotations

import os
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ds_longstraw.arch import adapter_for, zero3_leaf_modules
from ds_longstraw.config import LongstrawConfig
from ds_longstraw.engine.config import load_ds_config, read_block
from ds_longstraw.engine.expert_slices import ExpertSlices, check_engine_settings, without_expert_params
from ds_longstraw.engine.safe_load import check_checkpoint
from ds_longstraw.group import GRPOGroup
from ds_longstraw.grpo.document import document_tokens
from ds_longstraw.grpo.flat_document import can_flatten, flatten, split
from ds_longstraw.grpo.lockstep import Lockstep, calls_of, common_calls, dummy_group
from ds_longstraw.grpo.shared import grpo_backward_shared
from ds_longstraw.grpo.topology import resolve_layout
from ds_longstraw.grpo.transaction import GroupResult, grpo_backward
from ds_longstraw.objective import GRPOObjective, LossScope, ScaledObjective
from ds_longstraw.parallel.parallelism import Parallelism, build_parallelism

if TYPE_CHECKING:
    import argparse

    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    from ds_longstraw.parallel.groups import CPContext
    from ds_longstraw.rollout.generate import Rollouts
    from ds_longstraw.rollout.step import RolloutConfig


@dataclass
class StepResult:
    # this rank's loss: the mean of its groups' losses (objective.loss_scope "group"), their loss ("rank"), or their
    # part of the step's loss ("step")
    loss: float
    mean_loss: float  # the loss whose gradient the step followed, over every data-parallel rank
    groups: list  # GroupResult per group of this rank
    global_step: int  # engine.global_steps after the step
    lr: float | None
    grad_norm: float | None  # global gradient norm DeepSpeed measured (None where it did not)
    seconds: float
    tokens: int  # prompt + response tokens of this rank's groups
    skipped: bool = False  # the optimizer skipped the step (fp16 overflow)
    extras: dict = field(default_factory=dict)


def _float_or_none(value: float | torch.Tensor | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    return float(value)


def _zero3_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


class LongstrawEngineMixin:
    """Adds `grpo_step` to whatever engine class `deepspeed.initialize` built (its class stays a subclass)."""

    longstraw: LongstrawConfig
    longstraw_parallelism = None  # parallel.parallelism.Parallelism: the job's groups, this rank's place (initialize)
    longstraw_experts = None  # engine_experts.ExpertSlices (ep_size > 1), built by initialize

    def grpo_step(self, group: GRPOGroup | Sequence[GRPOGroup] | torch.Tensor | Sequence[int]
                  | Sequence[torch.Tensor | Sequence[int]],
                  objective: GRPOObjective | None = None,
                  ref_model: torch.nn.Module | DeepSpeedEngine | None = None,
                  rollout: RolloutConfig | dict[str, Any] | None = None,
                  loss_scopes: Sequence[LossScope | Sequence[LossScope]] | None = None,
                  captures: Sequence[Rollouts | None] | None = None) -> StepResult:
        """One optimizer step for this rank's GRPO group (or list of groups); see the module docstring.

        ref_model: reference policy when objective.kl_coef > 0 and the policy is not a peft model (a module or a
        DeepSpeed engine; under ZeRO-3 give a ZeRO-3 engine so its weights are partitioned too). A peft policy's
        reference is itself with its adapters disabled.
        rollout: a `rollout:` block (rollout/step.py); `group` is then this rank's prompt (1-D ids) or list of
        prompts, and the groups are sampled from the policy and rewarded first (result.extras: the rewards).
        loss_scopes: per group, the LossScope its shares are normalised over, or one per member, in place of the
        objective's loss_scope (a trainer that fixes its own normalisation: integrations/trl/scopes.py); the
        scopes' weights then carry any data-parallel factor, and the step's loss is the sum of the groups'.
        captures: per group, the Rollouts of generate(..., keep_capture=True) on its prompt with these weights (or
        None): the group's transaction takes that capture instead of capturing again (under ZeRO-3 with several
        ranks, only a capture decoded in lockstep, as rollout/step.rollout_samples does); released in any case.
        """
        if not self.longstraw.enabled:
            raise RuntimeError("grpo_step: the DeepSpeed config's 'longstraw' block has enabled=false")
        extras = {}
        if rollout is not None:
            if captures is not None:
                raise ValueError("grpo_step: give rollout= (which keeps its own captures) or captures=, not both")
            from ds_longstraw.rollout.step import engine_rollouts

            # the old log-probs at the temperature the objective scores at, whatever the rollout samples at
            temperature = 1.0 if objective is None else objective.temperature
            group, extras, captures = engine_rollouts(self, group, rollout, temperature)
        try:
            return self._grpo_step(group, objective, ref_model, extras, captures, loss_scopes)
        finally:  # a kept capture the step did not take (an error before its transaction): its pages go
            for kept in captures or ():
                if kept is not None:
                    kept.release()

    def _grpo_step(self, group: GRPOGroup | Sequence[GRPOGroup], objective: GRPOObjective | None,
                   ref_model: torch.nn.Module | DeepSpeedEngine | None, extras: dict[str, Any],
                   captures: list[Rollouts | None] | None,
                   loss_scopes: Sequence[LossScope | Sequence[LossScope]] | None = None) -> StepResult:
        groups = [group] if isinstance(group, GRPOGroup) else list(group)
        if not groups:
            raise ValueError("grpo_step needs at least one group on every rank")
        if loss_scopes is not None and len(loss_scopes) != len(groups):
            raise ValueError(f"grpo_step: loss_scopes has {len(loss_scopes)} entries for {len(groups)} groups")
        adapter = adapter_for(self.module)
        for index, item in enumerate(groups):
            if not isinstance(item, GRPOGroup):
                raise ValueError(f"grpo_step: group {index} is a {type(item).__name__}, not a GRPOGroup")
            item.check_vocab(adapter.vocab_size)  # fail before any collective, not halfway through one
        if isinstance(ref_model, DeepSpeedEngine):
            ref_model = ref_model.module
        longstraw = self.longstraw
        start = time.perf_counter()
        cp = self.longstraw_parallelism.cp
        if cp is not None:
            _check_same_groups(groups, cp)
        objective = objective or GRPOObjective()
        for item in groups:
            objective.check_group(item)
        scopes = self._loss_scopes(objective, groups) if loss_scopes is None else list(loss_scopes)
        route, tokens = self._document_route(groups, objective, captures)
        flat = flatten(groups, tokens, objective, scopes, longstraw.prefix_grad) if route == "flat" else None
        plan = [] if route == "tree" else self._lockstep_plan([flat.group] if flat else groups)
        skipped_before = getattr(self, "skipped_steps", 0)
        results: list[GroupResult] = []

        def backward(loss: torch.Tensor) -> None:
            self.backward(loss, scale_wrt_gas=False)

        def keep(slot: int, result: GroupResult) -> None:
            if loss_scopes is None:  # this rank's part of the loss (the weight is DeepSpeed's average)
                result.loss /= scopes[slot].weight
            results.append(result)

        experts = self.longstraw_experts
        with self.coalesce_grad_reduction():
            if route == "tree":  # the document captured once, each question as its child (grpo/shared.py)
                for slot, result in enumerate(grpo_backward_shared(self.module, groups, objective,
                                                                   longstraw=longstraw, ref_model=ref_model,
                                                                   backward=backward, loss_scopes=scopes)):
                    keep(slot, result)
            for slot, (item, lockstep, real) in enumerate(plan):
                # The normaliser and weight go on the loss shares, not on what is back-propagated: exact mode's
                # prefix pass back-propagates injected gradients that already carry them. A dummy group's are 0.
                scope = (flat.scopes if flat else scopes[slot]) if real else None
                result = grpo_backward(self.module, item, objective if real else ScaledObjective(objective, 0.0),
                                       longstraw=longstraw, ref_model=ref_model, cp_group=cp, backward=backward,
                                       caller_reduces=True, lockstep=lockstep,
                                       ep_group=None if experts is None else experts.ep.process_group,
                                       capture=captures[slot] if captures and slot < len(captures) else None,
                                       loss_scope=scope)
                if real and flat is not None:  # the document's groups, each its own result (flat_document.py)
                    for index, part in enumerate(split(flat, result, groups, objective)):
                        keep(index, part)
                elif real:
                    keep(slot, result)
            _fill_missing_grads(self)
        if experts is not None:
            experts.reduce_()
        self.step()
        if experts is not None:
            lrs = self.get_lr() if self.optimizer is not None else None
            experts.step(_float_or_none(lrs[0]) if lrs else None)
        by_group = loss_scopes is None and objective.loss_scope == "group"
        loss = sum(r.loss for r in results) / (len(results) if by_group else 1)
        mean_loss = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(mean_loss, group=self.data_parallel_group)
        # "step": the replicas' parts add up (each counted by its cp_size ranks); else the ranks' losses average
        ranks = dist.get_world_size(group=self.data_parallel_group)
        summed = loss_scopes is None and objective.loss_scope == "step"
        mean_loss = float(mean_loss.item()) / (self._cp_size() if summed else ranks)
        lrs = self.get_lr() if self.optimizer is not None else None
        return StepResult(loss=loss, mean_loss=mean_loss, groups=results, global_step=self.global_steps,
                          lr=_float_or_none(lrs[0]) if lrs else None,
                          grad_norm=_float_or_none(self.get_global_grad_norm()),
                          seconds=time.perf_counter() - start,
                          tokens=sum(g.prompt_ids.numel() + g.response_tokens for g in groups),
                          skipped=getattr(self, "skipped_steps", 0) != skipped_before, extras=extras)

    def _cp_size(self) -> int:
        return 1 if self.longstraw_parallelism is None else self.longstraw_parallelism.cp_size

    def _loss_scopes(self, objective: GRPOObjective, groups: list[GRPOGroup]) -> list[LossScope]:
        """Each of this rank's groups' LossScope (objective.py): the group alone, weighed 1/len ("group"); this
        rank's groups ("rank"); or every group of the step on every rank ("step": one all-reduce of two counts),
        weighed by the number of data-parallel replicas, whose gradients DeepSpeed averages where the step's loss
        wants their sum."""
        if objective.loss_scope == "group":
            return [objective.scope_of([g], weight=1.0 / len(groups)) for g in groups]
        local = objective.scope_of(groups)
        if objective.loss_scope == "rank":
            return [local] * len(groups)
        counts = torch.tensor([local.tokens, local.members], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.data_parallel_group)
        cp_size = self._cp_size()  # the CP ranks of a replica hold its groups alike: each counted cp_size times
        tokens, members = (round(c / cp_size) for c in counts.tolist())
        replicas = dist.get_world_size(group=self.data_parallel_group) // cp_size
        return [LossScope(tokens, members, weight=float(replicas))] * len(groups)

    def _document_route(self, groups: list[GRPOGroup], objective: GRPOObjective,
                        captures: list | None) -> tuple[str | None, int | None]:
        """How this rank's groups whose prompts share a document (grpo/document.document_tokens) run, and the
        document's tokens: "tree" (captured once, each question as its child: grpo/shared.py) where nothing pads
        the ranks' calls (no lockstep: ZeRO 0-2 or one data-parallel rank) and nothing shards the prompt or the
        experts; else "flat" (one group over the document, each member opening with its question:
        flat_document.py); (None, None) without a document, with kept captures to take, or where the flat form is
        not the groups' step (an entropy term). Every rank of a CP group holds the same
        groups and decides alike."""
        if len(groups) < 2 or captures:
            return None, None
        tokens = document_tokens(groups, self.longstraw.shared_prefix_min)
        if tokens is None:
            return None, None
        if not self._pads_calls() and self.longstraw_parallelism.cp is None and self.longstraw_experts is None:
            return "tree", tokens
        return ("flat", tokens) if can_flatten(objective) else (None, None)

    def _pads_calls(self) -> bool:
        """Whether the ranks pad their module calls to each other's (lockstep.py): their calls are collectives
        (ZeRO-3's gathers, sharded experts' dispatches) and there are several data-parallel ranks."""
        collective_calls = self.zero_optimization_stage() == 3 or self.longstraw_experts is not None
        return collective_calls and dist.get_world_size(group=self.data_parallel_group) > 1

    def _lockstep_plan(self, groups: list[GRPOGroup]) -> list[tuple[GRPOGroup, Lockstep | None, bool]]:
        """[(group, Lockstep or None, real)]: this rank's groups, padded under ZeRO-3 with data parallelism to the
        slots and calls every rank runs, dummy groups (not real: their loss weighs 0) filling missing slots."""
        longstraw = self.longstraw
        if not self._pads_calls():
            return [(group, None, True) for group in groups]
        cp = self.longstraw_parallelism.cp  # with CP, capture chunks are those of this rank's shard, in its layout
        if cp is not None:
            cp.layout = resolve_layout(adapter_for(self.module), longstraw)
        calls = [calls_of(group, longstraw, cp) for group in groups]
        plan = []
        for slot, common in enumerate(common_calls(calls, process_group=self.data_parallel_group)):
            if slot < len(groups):
                plan.append((groups[slot], Lockstep(calls[slot], common, longstraw), True))
            else:
                dummy = dummy_group()
                plan.append((dummy, Lockstep(calls_of(dummy, longstraw, cp), common, longstraw), False))
        return plan


    # -- checkpoints: the engine's, plus the expert slices it does not see (engine/expert_slices.py) ---------------
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        **kwargs: Any) -> bool:
        out = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                      **kwargs)
        if self.longstraw_experts is not None:
            self.longstraw_experts.save(save_dir, tag if tag is not None else f"global_step{self.global_steps}")
        return out

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None, trust_pickle: bool = False,
                        **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's load_checkpoint, after every file of the tag is read as data (engine/safe_load.py: a file
        needing more is refused, naming it, before anything loads); trust_pickle skips that for a trusted file."""
        if not trust_pickle:
            check_checkpoint(load_dir, tag)
        out = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if self.longstraw_experts is not None and out[0] is not None:
            if tag is None:
                with open(os.path.join(load_dir, "latest")) as handle:
                    tag = handle.read().strip()
            self.longstraw_experts.load(load_dir, tag)
        return out


if TYPE_CHECKING:
    class LongstrawEngine(LongstrawEngineMixin, DeepSpeedEngine):
        """For type checkers: what `initialize` returns, the engine class DeepSpeed built with grpo_step added."""


def _check_same_groups(groups: Sequence[GRPOGroup], cp: CPContext) -> None:
    """Every rank of a CP group must bring the same group(s) (the prompt is sharded, not the groups): a cheap
    fingerprint is all-gathered over the CP group, so a mismatch fails here rather than as wrong gradients."""
    import hashlib

    digest = hashlib.sha256()
    for group in groups:
        for tensor in [group.prompt_ids, *group.response_ids]:
            digest.update(str(tensor.numel()).encode())
            digest.update(tensor.detach().cpu().to(torch.int64).numpy().tobytes())
        for values in (group.rewards, group.advantages, *(group.old_logprobs or []),
                       *(getattr(group, "response_masks", None) or [])):
            if values is not None:
                digest.update(torch.as_tensor(values).detach().cpu().to(torch.float64).numpy().tobytes())
    gathered = [None] * cp.size
    torch.distributed.all_gather_object(gathered, digest.hexdigest(), group=cp.process_group)
    if len(set(gathered)) != 1:
        raise ValueError("grpo_step with cp_size > 1: the ranks of a context-parallel group (consecutive ranks) "
                         "must bring the same group(s); they differ")


def _fill_missing_grads(engine: DeepSpeedEngine) -> None:
    """Give a zero gradient to a trainable parameter that some ranks left without one: DeepSpeed's one reduction
    walks the parameters that HAVE a gradient (in buckets), and ranks that walk different sets issue mismatched
    collectives. One small all-reduce per step finds such parameters. Under ZeRO-3 lockstep already makes every
    rank call every module the same way; this serves stages 1 and 2, where a rank's model path may skip a part."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if not params:
        return
    counts = torch.tensor([0 if p.grad is None else 1 for p in params], dtype=torch.int32, device=engine.device)
    dist.all_reduce(counts, group=engine.data_parallel_group)
    world = dist.get_world_size(group=engine.data_parallel_group)
    needed = [p for p, count in zip(params, counts.tolist(), strict=True) if 0 < count < world]
    if not needed:
        return
    zero3 = [p for p in needed if _zero3_param(p)]
    with deepspeed.zero.GatheredParameters(zero3, enabled=bool(zero3)):  # same list on every rank: a collective
        for p in needed:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


_ENGINE_CLASSES: dict = {}


def _with_grpo_step(engine: DeepSpeedEngine) -> LongstrawEngine:
    base = type(engine)
    if not isinstance(engine, LongstrawEngineMixin):
        if base not in _ENGINE_CLASSES:
            _ENGINE_CLASSES[base] = type(f"Longstraw{base.__name__}", (LongstrawEngineMixin, base),
                                         {"__module__": __name__, "__doc__": base.__doc__})
        engine.__class__ = _ENGINE_CLASSES[base]
    return engine


def enable_grpo_step(engine: DeepSpeedEngine, longstraw: LongstrawConfig,
                     parallelism: Parallelism | None = None) -> LongstrawEngine:
    """`grpo_step` on an engine built elsewhere (accelerate's, for a trainer), with the block's context-parallel
    groups (consecutive ranks, as `initialize` makes them; built here, a collective: every rank calls this alike).
    Expert slices must leave ZeRO before the engine exists: with ep_size > 1 the caller built `parallelism` and
    sharded the experts with it before the engine, and sets engine.longstraw_experts (integrations/trl/experts.py).
    Idempotent."""
    if longstraw.ep_size > 1 and parallelism is None:
        raise ValueError(f"'longstraw.ep_size' = {longstraw.ep_size}: expert slices leave ZeRO before the engine is "
                         "built (ds_longstraw.initialize, or the caller's parallelism and ExpertSlices)")
    if engine.zero_optimization_stage() not in (1, 2, 3):
        raise ValueError(f"'zero_optimization.stage' = {engine.zero_optimization_stage()}: grpo_step reduces through "
                         "DeepSpeed's coalesce_grad_reduction, which needs ZeRO stage 1, 2 or 3")
    if isinstance(engine, LongstrawEngineMixin) and engine.longstraw is longstraw:
        return engine
    engine = _with_grpo_step(engine)
    engine.longstraw = longstraw
    if parallelism is None:
        parallelism = (build_parallelism(longstraw.cp_size) if longstraw.cp_size > 1
                       else Parallelism(dist.get_world_size(), dist.get_rank()))
    engine.longstraw_parallelism = parallelism
    return engine


def _config_of(args: argparse.Namespace | None,
               kwargs: dict[str, Any]) -> tuple[dict[str, Any] | str | os.PathLike[str], str | None]:
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key], key
    for name in ("deepspeed_config", "deepscale_config"):
        if getattr(args, name, None) is not None:
            return getattr(args, name), None
    raise ValueError("ds_longstraw.initialize needs a DeepSpeed config: config=<dict or JSON path> "
                     "(or args.deepspeed_config)")


def _zero_stage(ds_config: dict[str, Any]) -> int:
    zero = ds_config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def _world_size() -> int | None:
    import os

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    size = os.environ.get("WORLD_SIZE")
    return int(size) if size and size.isdigit() else None


def initialize(args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
               **kwargs: Any) -> tuple[LongstrawEngine, torch.optim.Optimizer | DeepSpeedOptimizer | None,
                                       DeepSpeedDataLoader | None, Any]:
    """A drop-in for `deepspeed.initialize` (same keyword arguments, same 4-tuple back).

    Before any work (no process group, no partitioning) it reads and validates the config's "longstraw" block
    (ValueError naming the key; a near-miss block name such as "long_straw" is an error too) and checks that the
    model has an architecture adapter. The engine returned is the engine DeepSpeed built, with `grpo_step` added and
    the validated block at `engine.longstraw`.
    """
    config, key = _config_of(args, kwargs)
    ds_config = load_ds_config(config)
    longstraw = read_block(ds_config, world_size=_world_size())
    if model is None:
        raise ValueError("ds_longstraw.initialize requires a model")
    if longstraw.enabled:
        adapter_for(model)  # an unsupported architecture fails here, not at the first step
        check_engine_settings(ds_config, longstraw)
    parallel = longstraw.enabled and (longstraw.cp_size > 1 or longstraw.ep_size > 1)
    if parallel:
        deepspeed.init_distributed()
    # the CP and EP groups (parallel/parallelism.py), made before the engine: sharding comes first
    parallelism = build_parallelism(longstraw.cp_size, longstraw.ep_size) if parallel else None
    experts = None
    if parallel and longstraw.ep_size > 1:
        # The expert slices leave ZeRO's sight (engine/expert_slices.py); the MoE block is then no ZeRO-3 leaf: its
        # router and shared expert are gathered by their own hooks, and the routed experts are not ZeRO's.
        experts = ExpertSlices(model, parallelism.ep_group, parallelism.expert_dp_group, parallelism.world)
        _drop_replaced(kwargs, experts.replaced)
    leaves = zero3_leaf_modules(model) if experts is None else []
    if leaves and _zero_stage(ds_config) == 3:  # before the engine sets its hooks
        deepspeed.utils.set_z3_leaf_modules(model, leaves)
    if key is not None:
        kwargs[key] = ds_config  # DeepSpeed accepts str paths only; a pathlib.Path works here too
    client_optimizer = kwargs.get("optimizer")
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, **kwargs)
    engine = _with_grpo_step(engine)
    engine.longstraw = longstraw
    engine.longstraw_parallelism = parallelism or Parallelism(dist.get_world_size(), dist.get_rank())
    if experts is not None:
        experts.world = dist.get_world_size(group=engine.data_parallel_group)
        experts.make_optimizer(client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer) else None,
                               ds_config)
        engine.longstraw_experts = experts
    return engine, optimizer, loader, scheduler


def _drop_replaced(kwargs: dict[str, Any], replaced: Container[int]) -> None:
    """The whole expert tensors that sharding replaced leave the client optimizer and model_parameters (built
    before initialize, they may hold them); the slices get their own optimizer."""
    optimizer = kwargs.get("optimizer")
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in replaced]
    if kwargs.get("model_parameters") is not None:
        kwargs["model_parameters"] = without_expert_params(kwargs["model_parameters"], replaced)
