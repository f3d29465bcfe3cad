"""LongStrawGRPOTrainer: TRL's GRPOTrainer whose optimizer steps run as transactions.

What stays TRL's: the dataset and sampler, prompt formatting, generation (transformers, vLLM server or colocate,
rollout_func, the tool-calling loop), rewards and advantages (scale_rewards, multi-objective aggregation),
truncation masks, logging, checkpoints, the optimizer and scheduler, accelerate's DeepSpeed engine.
What changes, when the DeepSpeed config carries a "longstraw" block (without DeepSpeed: `longstraw={...}`):
  - TRL's full-sequence scoring of old and reference log-probs is not run (_generate_and_score_completions keeps
    its generation and rewards only): the reference is scored inside each transaction without a graph, and with
    num_iterations > 1 the old log-probs are the transaction's own log-probs of the generation's first iteration
    (the same weights TRL would score them with).
  - training_step: at the last micro-step of each optimizer step the micro-batches TRL handed its micro-steps
    (with steps_per_generation = the accumulation, the whole generation batch) are grouped by prompt and each group
    runs one transaction (grpo_backward) with TRL's advantages, loss mask and sampler log-probs, every member
    normalised over its own micro-batch (scopes.py);
    under DeepSpeed all groups go through engine.grpo_step: one gradient reduction and one optimizer step. Prompts
    that share a document (a common prefix of at least the block's shared_prefix_min tokens) share its capture
    (grpo/shared.py; under DeepSpeed where engine.grpo_step runs them so). The earlier micro-steps of the optimizer
    step only take their micro-batch (TRL's _prepare_inputs, which generates when due). The loss returned is TRL's
    loss summed over the micro-batches (what TRL's Trainer adds up for its log).
Context parallelism ("cp_size" N in the block, under DeepSpeed): consecutive processes form a CP group; TRL's
sampler is wrapped so that a group's processes receive copies of one batch (replicas.py) and each prompt is
sharded over them; DeepSpeed averages over every process, as under ds_longstraw.initialize.
Expert parallelism ("ep_size" E, under DeepSpeed; experts.py): consecutive processes form EP groups, the policy's
routed experts are sharded over them and taken out of ZeRO before accelerate builds the engine, and the engine's
step reduces and steps them; under ZeRO-3 the MoE blocks of TRL's reference model (and, without EP, the policy's)
are ZeRO-3 leaf modules, set before each engine is built.
What it is not (refused, naming the setting): settings.py's list; experts.py's list under expert parallelism;
several processes without DeepSpeed (one reduction per step needs DeepSpeed's engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Iterator
from typing import Any

import torch
from trl import GRPOTrainer

from ds_longstraw.config import LongstrawConfig, parse_config
from ds_longstraw.integrations.trl.batch import Member, PromptGroup, prompt_groups
from ds_longstraw.integrations.trl.experts import (
    attach_experts,
    check_expert_parallel,
    leaves_before_reference_engine,
    set_leaf_modules,
    shard_policy_experts,
)
from ds_longstraw.integrations.trl.metrics import entropy_bonus_metrics, transaction_metrics, trl_metrics
from ds_longstraw.integrations.trl.replicas import replica_sampler
from ds_longstraw.integrations.trl.sampling import CaptureSampler
from ds_longstraw.integrations.trl.settings import check_trl_settings, objective_from_trl
from ds_longstraw.integrations.trl.tools import ToolLoop, async_tool_names

BLOCK = "longstraw"


def _deepspeed_config(args: Any) -> dict | None:
    """The DeepSpeed config the run was given (args.deepspeed: a dict or a JSON path), or None without one."""
    from ds_longstraw.engine.config import load_ds_config

    config = getattr(args, "deepspeed", None)
    return None if config is None else load_ds_config(config)


def _read_block(args: Any, given: dict | LongstrawConfig | None) -> LongstrawConfig | None:
    """The longstraw block (None: no block, plain TRL; `given`: the trainer's longstraw= argument), validated before
    any model work (ValueError naming the key)."""
    from ds_longstraw.engine.config import near_miss_block_names

    ds_config = _deepspeed_config(args)
    if ds_config is not None:
        misses = near_miss_block_names(ds_config)
        if misses:
            raise ValueError(f"DeepSpeed config has a top-level key {misses[0]!r}: did you mean '{BLOCK}'?")
        if given is not None and BLOCK in ds_config:
            raise ValueError(f"the '{BLOCK}' block is given twice (the DeepSpeed config and longstraw=): keep one")
        given = ds_config.get(BLOCK, given)
    if given is None:
        return None
    longstraw = parse_config(given)
    if not longstraw.enabled:
        return None
    if longstraw.ep_size > 1 and ds_config is None:
        raise ValueError(f"'{BLOCK}.ep_size' = {longstraw.ep_size} needs DeepSpeed (GRPOConfig(deepspeed=...)): the "
                         "expert slices reduce and step beside its engine")
    if longstraw.cp_size > 1:
        _check_context_parallel(args, longstraw, ds_config)
    return longstraw


def _check_context_parallel(args: Any, longstraw: LongstrawConfig, ds_config: dict | None) -> None:
    """Context parallelism (replicas.py): DeepSpeed, and each process batch whole groups (a CP group's ranks hold
    copies of one batch, and TRL normalises rewards over consecutive num_generations rows of every copy)."""
    if ds_config is None:
        raise ValueError(f"'{BLOCK}.cp_size' = {longstraw.cp_size} needs DeepSpeed (GRPOConfig(deepspeed=...)): the "
                         "context-parallel ranks reduce through its engine")
    batch = args.per_device_train_batch_size * args.steps_per_generation
    if batch % args.num_generations:
        raise ValueError(f"'{BLOCK}.cp_size' = {longstraw.cp_size} needs per_device_train_batch_size x "
                         f"steps_per_generation = {batch} to hold whole groups of num_generations = "
                         f"{args.num_generations}")
    if args.scale_rewards == "batch":
        raise ValueError(f"scale_rewards = 'batch' with '{BLOCK}.cp_size' = {longstraw.cp_size}: the batch's std "
                         "would count each replica's rewards cp_size times")


def _check_capture_generation(args: Any, kwargs: dict, longstraw: LongstrawConfig | None = None) -> None:
    """generate_from_capture's refusals (sampling.py, tools.py): what TRL's own generation would honour and it does
    not. TRL's tool loop (`tools`, `environment_factory`) maps, except async tools, a processor (multimodal) and
    context parallelism (tools.py says why)."""
    refused = [(name, value) for name, value, default in (
        ("use_vllm", args.use_vllm, False), ("rollout_func", kwargs.get("rollout_func"), None),
        ("top_k", args.top_k, 0), ("min_p", args.min_p, None), ("repetition_penalty", args.repetition_penalty, 1.0),
        ("use_transformers_continuous_batching", args.use_transformers_continuous_batching, False))
        if value not in (default, None)]
    batch = args.per_device_train_batch_size * args.steps_per_generation
    if batch % args.num_generations:
        refused.append(("per_device_train_batch_size x steps_per_generation", batch))
    tools, factory = kwargs.get("tools"), kwargs.get("environment_factory")
    if tools or factory:
        names = async_tool_names(tools, factory)
        if names:
            refused.append(("async tools", names))
        if longstraw is not None and longstraw.cp_size > 1:
            refused.append((f"tools with '{BLOCK}.cp_size'", longstraw.cp_size))
    from transformers import ProcessorMixin

    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        refused.append(("processing_class", type(kwargs["processing_class"]).__name__))
    if refused:
        lines = "; ".join(f"{name} = {value!r}" for name, value in refused)
        raise ValueError(f"generate_from_capture samples with ds_longstraw.generate (temperature, top_p, eos, TRL's "
                         f"sync tools on text; each process's batch whole groups of num_generations = "
                         f"{args.num_generations}): {lines}")


class LongStrawGRPOTrainer(GRPOTrainer):
    """GRPOTrainer's arguments, plus `longstraw`: the longstraw block where no DeepSpeed config carries them
    (module docstring), and `generate_from_capture`: sample the completions from the captured prompt and train the
    step on that capture (sampling.py) instead of TRL's generation, every turn of TRL's tool loop included
    (tools.py). Without a block it is TRL's GRPOTrainer."""

    _parallelism = None  # parallel.parallelism.Parallelism with ep_size > 1 (experts.py), else enable_grpo_step's
    _experts = None  # engine.expert_slices.ExpertSlices: the policy's experts sharded over the EP group

    def __init__(self, *args: Any, longstraw: dict | LongstrawConfig | None = None,
                 generate_from_capture: bool = False, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        given, longstraw = longstraw, None
        if training_args is not None:  # refuse before TRL loads or builds anything
            longstraw = _read_block(training_args, given)
            if longstraw is not None:
                check_trl_settings(training_args)
                check_expert_parallel(training_args, longstraw, _deepspeed_config(training_args), kwargs,
                                      generate_from_capture)
            if generate_from_capture:
                _check_capture_generation(training_args, kwargs, longstraw)
        with leaves_before_reference_engine() if longstraw is not None else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        if training_args is None:
            longstraw = _read_block(self.args, given)
            if generate_from_capture:
                _check_capture_generation(self.args, kwargs, longstraw)
        if generate_from_capture:
            self._check_probed_tools()
        if generate_from_capture and longstraw is None:
            raise ValueError("generate_from_capture needs the 'longstraw' block (the DeepSpeed config's or longstraw=)")
        self.longstraw = longstraw
        self._skip_scoring = False
        # the optimizer step's micro-batches so far, (generation, index in its batch); the generations made in it;
        # TRL's buffered generation batches by number; old log-probs by (generation, index, row)
        self._window: list[tuple[int, int]] = []
        self._fresh: list[int] = []
        self._generation = 0
        self._generations: dict[int, list] = {}
        self._old_logprobs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._sampler = CaptureSampler(longstraw) if generate_from_capture else None
        self._tool_loop: ToolLoop | None = None  # generate_from_capture with tools: the batch's turns (tools.py)
        if longstraw is None:
            return
        self.longstraw_objective = objective_from_trl(self.args, use_vllm=self.use_vllm)
        if self.aux_loss_enabled:
            raise ValueError("output_router_logits = True (TRL's router auxiliary loss): the transaction adds none")
        if self.accelerator.num_processes > 1 and self.is_deepspeed_enabled is False:
            raise ValueError(f"{self.accelerator.num_processes} processes without DeepSpeed: LongStrawGRPOTrainer "
                             "needs a DeepSpeed config (with the 'longstraw' block) to reduce once per step")
        if self.top_entropy_quantile < 1.0 and (longstraw.cp_size > 1 or (
                self.accelerator.num_processes > 1 and self.accelerator.state.deepspeed_plugin.zero_stage == 3)):
            raise ValueError(f"top_entropy_quantile = {self.top_entropy_quantile!r} under ZeRO-3 on several processes "
                             f"or with cp_size > 1: its entropy pass (entropies.py) runs each process's prompts alone")
        # expert parallelism: the policy's experts leave ZeRO now, before accelerate builds its engine (experts.py)
        if longstraw.ep_size > 1:
            self._parallelism, self._experts = shard_policy_experts(self.accelerator.unwrap_model(self.model),
                                                                    longstraw)
        elif self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            set_leaf_modules(self.accelerator.unwrap_model(self.model))  # before accelerate builds the engine

    def _check_probed_tools(self) -> None:
        """What could not be seen before TRL built them: a processor loaded from the model's path, and async tool
        methods of environments whose factory is not a class (TRL probed one instance of each)."""
        refused = []
        if self._is_vlm:
            refused.append(("processing_class", type(self.processing_class).__name__))
        names = [tool.__name__ for tool in self.tools if inspect.iscoroutinefunction(tool)]
        if names:
            refused.append(("async tools", names))
        if refused:
            lines = "; ".join(f"{name} = {value!r}" for name, value in refused)
            raise ValueError(f"generate_from_capture samples with ds_longstraw.generate (TRL's sync tools on text): "
                             f"{lines}")

    # -- context parallelism: a CP group's processes hold copies of one replica's batch ---------------------------
    def _get_train_sampler(self, dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(dataset)
        if self.longstraw is None or self.longstraw.cp_size == 1:
            return sampler
        return replica_sampler(sampler, cp_size=self.longstraw.cp_size,
                               per_process=self.args.per_device_train_batch_size * self.args.steps_per_generation)

    def _engine(self) -> Any:
        """accelerate's DeepSpeed engine with grpo_step, the block's CP groups (enable_grpo_step) and, with
        ep_size > 1, the policy's expert slices (experts.py), or None."""
        if not self.is_deepspeed_enabled:
            return None
        from ds_longstraw.engine.engine import enable_grpo_step

        engine = enable_grpo_step(self.model_wrapped, self.longstraw, self._parallelism)
        if self._experts is not None and engine.longstraw_experts is None:
            attach_experts(engine, self._experts, self.args.weight_decay)
        return engine

    def _same_randomness_in_cp_group(self) -> None:
        """A CP group's processes copy its first rank's random state before TRL generates and shuffles: they must
        sample the same completions and split them into the same micro-batches (their processes' seeds and what
        DeepSpeed's setup drew may differ)."""
        engine = self._engine()
        cp = None if engine is None else engine.longstraw_parallelism.cp
        if cp is None:
            return
        states = [torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None]
        leader = torch.distributed.get_global_rank(cp.process_group, 0)
        torch.distributed.broadcast_object_list(states, src=leader, group=cp.process_group)
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])

    # -- TRL's generation without its scoring ------------------------------------------------------------------
    @contextlib.contextmanager
    def _without_scoring(self) -> Iterator[None]:
        """TRL's _generate_and_score_completions with its old, reference and importance-sampling forwards off."""
        saved = self.beta, self.vllm_importance_sampling_correction
        self.beta, self.vllm_importance_sampling_correction, self._skip_scoring = 0.0, False, True
        try:
            yield
        finally:
            (self.beta, self.vllm_importance_sampling_correction), self._skip_scoring = saved, False

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple:
        if self._skip_scoring:  # the old log-probs' full forward: the transaction scores them instead
            return None, None, None
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: list) -> dict:
        if self.longstraw is None or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        with self._without_scoring():
            return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any, num_generations: int,
                              has_tool_images: bool = False) -> tuple:
        if self._sampler is None or not self.model.training:
            self._tool_loop = None  # TRL's own loop runs (evaluation): nothing of an earlier batch's may answer it
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        engine = self._engine()
        dp_group = parallelism = None
        if engine is not None:
            parallelism = engine.longstraw_parallelism
            if engine.zero_optimization_stage() == 3 and self.accelerator.num_processes > 1:
                dp_group = engine.data_parallel_group  # ZeRO-3's gathers are collectives: decode in lockstep
        # TRL's tool loop (tools.py): every turn decodes here from the capture; TRL's _generate then parses the
        # first turns and _tool_call_loop (below) hands it the rest
        tool_loop = ToolLoop.from_trainer(self, prompt_ids) if self.tools else None
        completions = self._sampler.sample(
            self.accelerator.unwrap_model(self.model), prompt_ids, num_generations=num_generations,
            max_new_tokens=self.max_completion_length, temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, eos_token_ids=self.eos_token_ids, seed=self.args.seed,
            step=self.state.global_step,
            replica=self.accelerator.process_index if parallelism is None else parallelism.replica,
            dp_group=dp_group, cp_group=None if parallelism is None else parallelism.cp, tool_loop=tool_loop)
        if tool_loop is not None:
            self._tool_loop = tool_loop
            completions = tool_loop.first_turns()
        return completions, None  # sampler log-probs: TRL reads them only for vLLM's importance sampling

    def _tool_call_loop(self, prompts: list, prompt_ids: list, completion_ids: list, completions: list,
                        logprobs: Any, images: Any, multimodal_fields: Any) -> tuple:
        loop, self._tool_loop = self._tool_loop, None
        if loop is None:  # TRL generated the first turns (no capture sampling): its own loop
            return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                           multimodal_fields)
        return loop.trl_outputs(logprobs)

    # -- one optimizer step as transactions ----------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self.longstraw is None:
            return super().training_step(model, inputs, num_items_in_batch)
        start = time.perf_counter()
        accumulation = self.current_gradient_accumulation_steps
        model.train()
        self._buffer_micro_batch(inputs)
        if len(self._window) == accumulation:  # the optimizer step's last micro-step: its micro-batches are known
            loss = self._transactions(accumulation)
        else:
            loss = torch.zeros((), device=self.accelerator.device)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - start
        if self._step % accumulation == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _buffer_micro_batch(self, inputs: Any) -> None:
        """TRL's _prepare_inputs for this micro-step (it generates every steps_per_generation x num_iterations
        micro-steps and hands out the generation batch's micro-batch _step % steps_per_generation); the micro-batch
        joins the optimizer step's window, named (generation, index) so that its old log-probs can be found."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self._same_randomness_in_cp_group()
        before = self._buffered_inputs
        self._prepare_inputs(inputs)  # TRL's generation (when due) and its buffer
        if self._buffered_inputs is not before:
            self._generation += 1
            self._generations[self._generation] = self._buffered_inputs
            self._fresh.append(self._generation)
        self._window.append((self._generation, self._step % self.args.steps_per_generation))

    def _transactions(self, accumulation: int) -> torch.Tensor:
        """The window's micro-batches as transactions. Old log-probs (TRL's, at the generation's weights): a
        generation made in this window has this window's weights, so its members train with none (ratio 1, as TRL's
        old log-probs of the same weights); its micro-batches that train in a later window (steps_per_generation >
        gradient_accumulation_steps, or num_iterations > 1) are replayed here too, with a share of 0, for their
        log-probs: the old log-probs those later windows use."""
        window, fresh = self._window, set(self._fresh)
        self._window, self._fresh = [], []
        trained = set(window)
        scored = [(g, c) for g in sorted(fresh) for c in range(len(self._generations[g])) if (g, c) not in trained]
        names = window + scored
        chunks = [self._generations[g][c] for g, c in names]
        old = {}
        for k, (g, c) in enumerate(window):
            if g in fresh:
                continue
            for row in range(int(chunks[k]["completion_mask"].shape[0])):
                if (g, c, row) in self._old_logprobs:
                    old[Member(k, row)] = self._old_logprobs[(g, c, row)]
        objective = self.longstraw_objective
        if self.use_adaptive_entropy:  # TRL's controller: the coefficient applies while the entropy is at or below
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            objective = dataclasses.replace(objective, entropy_coef=coef)
        groups = prompt_groups(chunks, loss_type=self.loss_type, accumulation=accumulation,
                               processes=self.accelerator.num_processes,
                               steps_per_generation=self.args.steps_per_generation,
                               pad_token_id=self._tokenizer.pad_token_id, old_logprobs=old, scored=len(scored),
                               policy_masks=self._entropy_masks(chunks[:len(window)], old, accumulation))
        results = self._run_groups(groups, objective)
        for entry, result in zip(groups, results, strict=True):
            for member, logprobs in zip(entry.members, result.logprobs, strict=True):
                g, c = names[member.chunk]
                if g in fresh:
                    self._old_logprobs.setdefault((g, c, member.row), logprobs)
        # only the latest generation is trained again (its buffer is TRL's)
        self._generations = {g: b for g, b in self._generations.items() if g == self._generation}
        self._old_logprobs = {key: v for key, v in self._old_logprobs.items() if key[0] == self._generation}
        self._log_transactions(chunks[:len(window)], groups, results, objective)
        if self._entropy_bonus_enabled:
            self._entropy_bonus_step(len(window), groups, results, objective, accumulation)
        loss = sum(result.loss for result in results)
        return torch.tensor(float(loss), device=self.accelerator.device)

    def _entropy_bonus_step(self, count: int, groups: list[PromptGroup], results: list, objective: Any,
                            accumulation: int) -> None:
        """TRL's entropy bonus bookkeeping at the optimizer step's end: its policy_loss per micro-batch, the adaptive
        controller's update from the step's entropy (every process) and the coefficient it logs."""
        losses, world_entropy = entropy_bonus_metrics(
            count, groups, results, objective, loss_type=self.loss_type, accumulation=accumulation,
            reduce=lambda x: self.accelerator.reduce(x, reduction="sum"), gather=self.accelerator.gather,
            device=self.accelerator.device)
        self._metrics["train"]["policy_loss"].extend(losses)
        if self.use_adaptive_entropy:
            if world_entropy <= self.args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
            self._last_world_entropy = world_entropy
        self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def _entropy_masks(self, chunks: list[dict], old: dict, accumulation: int) -> list | None:
        """top_entropy_quantile < 1: per trained micro-batch, TRL's entropy mask (None otherwise; entropies.py)."""
        if self.top_entropy_quantile >= 1.0:
            return None
        from ds_longstraw.integrations.trl.entropies import entropy_masks, score_entropies

        groups = prompt_groups(chunks, loss_type=self.loss_type, accumulation=accumulation,
                               processes=self.accelerator.num_processes,
                               steps_per_generation=self.args.steps_per_generation,
                               pad_token_id=self._tokenizer.pad_token_id, old_logprobs=old)
        entropies = score_entropies(self.accelerator.unwrap_model(self.model), groups, self.longstraw,
                                    self.longstraw_objective.temperature)
        return entropy_masks(chunks, entropies, self.get_high_entropy_mask, self.top_entropy_quantile)

    def _run_groups(self, groups: list[PromptGroup], objective: Any) -> list:
        ref_model = self.ref_model if self.beta != 0.0 else None
        # generate_from_capture: each group takes its prompt's kept capture (taken and released by the transaction)
        captures = None if self._sampler is None else [self._sampler.take(g.group.prompt_ids) for g in groups]
        try:
            engine = self._engine()
            if engine is not None:
                engine.set_gradient_accumulation_boundary(True)  # this step is the accumulation window's only one
                result = engine.grpo_step([g.group for g in groups], objective=objective, ref_model=ref_model,
                                          loss_scopes=[g.scopes for g in groups], captures=captures)
                return result.groups
            from ds_longstraw.grpo.shared import grpo_backward_shared
            from ds_longstraw.grpo.transaction import grpo_backward

            if captures is None:  # prompts that share a document share its capture (grpo/shared.py)
                return grpo_backward_shared(self.model, [g.group for g in groups], objective,
                                            longstraw=self.longstraw, ref_model=ref_model,
                                            loss_scopes=[g.scopes for g in groups])
            return [grpo_backward(self.model, g.group, objective, longstraw=self.longstraw, ref_model=ref_model,
                                  loss_scope=g.scopes, capture=captures[i]) for i, g in enumerate(groups)]
        finally:
            if self._sampler is not None:
                self._sampler.release()  # a capture no group took (a later iteration's weights differ)

    def _log_transactions(self, chunks: list[dict], groups: list[PromptGroup], results: list, objective: Any) -> None:
        """TRL's metrics (kl, entropy, clip ratios: one value per trained micro-batch `chunks`, by TRL's
        definitions) and the transaction's own (capture seconds, pages' bytes, captures reused) from the step's
        results (metrics.py)."""
        device = self.accelerator.device
        per_micro_batch = trl_metrics(chunks, groups, results, objective,
                                      reduce=lambda x: self.accelerator.reduce(x, reduction="sum"),
                                      gather=self.accelerator.gather, device=device)
        for name, values in per_micro_batch.items():
            self._metrics["train"][name].extend(values)
        for name, value in transaction_metrics(results, gather=self.accelerator.gather, device=device).items():
            self._metrics["train"][name].append(value)
