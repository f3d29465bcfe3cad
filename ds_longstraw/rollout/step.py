"""Rollouts inside training: a `rollout:` block turns a step's prompts into GRPO groups.

    rollout:
      source: internal                          # sample from the policy being trained (ds_longstraw.generate)
      num_samples: 8                            # G per prompt, >= 2 (one sample has no advantage)
      max_new_tokens: 4
      temperature: 1.0                          # 0: greedy (every sample the same: no learning signal)
      top_p: 1.0
      reward: ds_longstraw.tasks.recall:reward  # "package.module:function", called function(prompt_ids, response_ids)
      eos_token_id: null                        # an id or a list of ids that end a sample
      seed: 0                                   # with the step number and the prompt's index: the samples' seed
      zero3_weights: auto                       # auto | per_call | whole: how decoding reaches ZeRO-3's weights
      zero3_whole_budget: 0.8                   # auto: the share of free device memory "whole" may fill
      prompts: ds_longstraw.tasks.recall:prompt # launch/train.py only, optional: function(seed, index, **prompt_args)
      prompt_args: {prompt_tokens: 64}          # (without `prompts` the step's prompts come from data.path's JSONL)
      environment: null                         # optional "package.module:function", called function(prompt_ids):
                                                # the Environment that answers that prompt's samples' tool calls
                                                # (rollout/environment.py); max_new_tokens then caps actions and
                                                # observations together, and the groups mask the observations
      max_turns: null                           # with an environment: the observations per sample (null: no cap)

Per prompt: `generate` decodes G samples from the prompt captured once, with the policy's current weights (under
the DeepSpeed engine its module, whose ZeRO-3 hooks gather the weights as they are used), the run's "longstraw"
block as config and the engine's context-parallel group; the reward function scores each (prompt, response); the
group is `Rollouts.group(rewards)`, so its old log-probs are the sampling policy's, at the temperature the step's
objective scores at (engine.grpo_step: GRPOObjective.temperature, 1 by default), not the rollout's sampling
temperature, so that a block sampling hotter than it trains (the recall task's 2.0) starts on-policy at a ratio of
1. Training on it then captures the prompt again (generate releases its capture), or with one prompt per rank
takes its kept capture.

Seeds: prompt i of step s samples with seed `sample_seed(seed, s, i)`, i counting over the data-parallel replicas
(replica r holds i = n_0 + ... + n_(r-1) onwards, n_q the prompts replica q brings: r k .. r k + k - 1 with k
each): a run reproduces its samples from its seed and step alone, on any topology, and the ranks of one
context-parallel group draw the same samples.

Under ZeRO-3 with several data-parallel replicas, or with sharded experts, every rank's module calls are
collectives: the ranks decode in lockstep (decode_lockstep.py), so each brings its own number of prompts, of any
lengths, and its samples stop at eos when they draw it; the samples are those each rank would draw alone.

Weights under ZeRO-3 (engine.grpo_step): "per_call" leaves ZeRO-3's hooks to gather each submodule's weights when
it runs and release them after, so every decode step all-gathers the whole model, one submodule at a time, and
nothing beyond one submodule's weights is ever whole. "whole" gathers every weight once for the step's rollouts and
takes the hooks off while they decode (decode steps then make no weight collective), and puts them back before
training: faster decoding (BENCHMARKS.md has the ratio) for the price of the whole model's weights on every rank
during the rollouts, which the largest models cannot pay. "auto" (the default) takes "whole" where every rank has
room for it: the weights beyond its ZeRO-3 share plus what decoding keeps on the device (the longest prompt's
pages on the "none" tier, else two staged layers; every sample's carry and response rows; a step's logits) within
`zero3_whole_budget` of its free device memory (host memory shared by the node's ranks on CPU); else "per_call".
The step's extras say which ran ("zero3_weights").

Not here: asynchronous or off-policy rollouts.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, field_validator, model_validator

from ds_longstraw.config import parse_block
from ds_longstraw.group import as_ids
from ds_longstraw.grpo.memory import free_device_bytes
from ds_longstraw.offload.plan import decode_state_bytes
from ds_longstraw.seeds import splitmix64

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import ProcessGroup

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.group import GRPOGroup
    from ds_longstraw.parallel.groups import CPContext
    from ds_longstraw.rollout.environment import Environment
    from ds_longstraw.rollout.generate import Rollouts

BLOCK = "rollout"
_MASK62 = (1 << 62) - 1


def load_callable(path: str, key: str = f"{BLOCK}.reward") -> Callable[..., Any]:
    """The callable named by "package.module:function" (ValueError naming `key` when it does not import or is not
    callable)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"'{key}' = {path!r}: expected an import path 'package.module:function'")
    module_name, attribute = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"'{key}' = {path!r}: module {module_name!r} does not import ({error})") from None
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"'{key}' = {path!r}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"'{key}' = {path!r}: {attribute!r} is a {type(target).__name__}, not callable")
    return target


class RolloutConfig(DeepSpeedConfigModel):
    """The `rollout:` block (module docstring); unknown keys and bad values are errors naming the key."""

    source: Literal["internal"]
    num_samples: int = Field(8, ge=2)
    max_new_tokens: int = Field(..., ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    reward: str
    eos_token_id: int | list[int] | None = None
    seed: int = Field(0, ge=0)
    zero3_weights: Literal["auto", "per_call", "whole"] = "auto"
    zero3_whole_budget: float = Field(0.8, ge=0, le=1, allow_inf_nan=False)
    prompts: str | None = None
    prompt_args: dict[str, Any] = Field(default_factory=dict)
    environment: str | None = None
    max_turns: int | None = Field(None, ge=0)

    @field_validator("reward")
    @classmethod
    def _reward_imports(cls, value: str) -> str:
        load_callable(value, f"{BLOCK}.reward")
        return value

    @field_validator("prompts")
    @classmethod
    def _prompts_import(cls, value: str | None) -> str | None:
        if value is not None:
            load_callable(value, f"{BLOCK}.prompts")
        return value

    @field_validator("environment")
    @classmethod
    def _environment_imports(cls, value: str | None) -> str | None:
        if value is not None:
            load_callable(value, f"{BLOCK}.environment")
        return value

    @model_validator(mode="after")
    def _turns_need_an_environment(self) -> RolloutConfig:
        if self.max_turns is not None and self.environment is None:
            raise ValueError(f"'{BLOCK}.max_turns' = {self.max_turns} is given without '{BLOCK}.environment' (it "
                             "caps an environment's observations)")
        return self

    @field_validator("eos_token_id")
    @classmethod
    def _eos_ids(cls, value: int | list[int] | None) -> int | list[int] | None:
        ids = [value] if isinstance(value, int) else value or []
        if any(token < 0 for token in ids):
            raise ValueError(f"token ids must be >= 0, got {value!r}")
        return value

    def reward_function(self) -> Callable[[torch.Tensor, torch.Tensor], float | torch.Tensor]:
        return load_callable(self.reward, f"{BLOCK}.reward")

    def prompt_function(self) -> Callable[..., torch.Tensor | Sequence[int]] | None:
        return None if self.prompts is None else load_callable(self.prompts, f"{BLOCK}.prompts")

    def environment_for(self, prompt_ids: torch.Tensor) -> Environment | None:
        """The environment of one prompt's samples (None without one)."""
        if self.environment is None:
            return None
        return load_callable(self.environment, f"{BLOCK}.environment")(prompt_ids)


def parse_rollout(block: RolloutConfig | dict[str, Any]) -> RolloutConfig:
    """A dict (the YAML / JSON block) or a RolloutConfig -> a validated RolloutConfig (ValueError naming the key)."""
    return parse_block(RolloutConfig, block, BLOCK)


def sample_seed(seed: int, step: int, index: int) -> int:
    """generate's seed for prompt `index` of step `step` of a run seeded `seed` (SplitMix64 of the three: no two
    (step, index) pairs of a run share a seed in practice, and neighbouring runs share none either)."""
    return splitmix64(splitmix64(splitmix64(int(seed)) ^ int(step)) ^ int(index)) & _MASK62


def as_prompts(prompts: torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]]) -> list:
    """One prompt (1-D ids) or a list of them -> a list of CPU LongTensors (ValueError naming the prompt)."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, int) for p in prompts):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollouts need at least one prompt")
    return [as_ids(f"prompts[{i}]", p).cpu() for i, p in enumerate(prompts)]


def _reward(function: Callable[[torch.Tensor, torch.Tensor], float | torch.Tensor], rollout: RolloutConfig,
            prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> float:
    value = function(prompt_ids, response_ids)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'{BLOCK}.reward' = {rollout.reward!r} returned {value!r}: expected a finite number")
    return float(value)


def rollout_groups(model: torch.nn.Module,
                   prompts: torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]],
                   rollout: RolloutConfig | dict[str, Any], *, step: int, first_index: int = 0,
                   longstraw: LongstrawConfig | dict[str, Any] | None = None,
                   cp_group: ProcessGroup | CPContext | None = None, score_temperature: float | None = None) -> list:
    """GRPOGroups of `prompts` (one or a list of 1-D ids) sampled from `model` as the `rollout` block says: for
    prompt j, `rollout.num_samples` samples seeded sample_seed(rollout.seed, step, first_index + j), rewarded by
    `rollout.reward`, their log-probs as old log-probs (at score_temperature; None: the sampling temperature;
    engine.grpo_step takes its objective's). longstraw: the "longstraw" block (capture chunks, pages, tier); cp_group:
    the context-parallel group the prompt is sharded over (None: one rank)."""
    return [group for group, _ in rollout_samples(model, prompts, rollout, step=step, first_index=first_index,
                                                   longstraw=longstraw, cp_group=cp_group,
                                                   score_temperature=score_temperature)]


def rollout_samples(model: torch.nn.Module,
                    prompts: torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]],
                    rollout: RolloutConfig | dict[str, Any], *, step: int, first_index: int = 0,
                    longstraw: LongstrawConfig | dict[str, Any] | None = None,
                    cp_group: ProcessGroup | CPContext | None = None, dp_group: ProcessGroup | None = None,
                    keep_capture: bool = False, score_temperature: float | None = None) -> list:
    """[(GRPOGroup, Rollouts)] as `rollout_groups`; with keep_capture each Rollouts keeps its prompt's capture for
    grpo_backward(..., capture=) (the caller trains on it or releases it; on error here every kept one goes).
    dp_group: the ranks that decode in lockstep, each with its own prompts (generate's dp_group): a rank with fewer
    prompts than another pads its calls with idle slots. score_temperature: the temperature of the groups' old
    log-probs (generate's; None: the sampling temperature)."""
    from ds_longstraw.rollout.generate import decode_idle_slot, decode_schedules, generate

    rollout = parse_rollout(rollout)
    prompts = as_prompts(prompts)
    reward = rollout.reward_function()
    schedules = decode_schedules(model, prompts, rollout.num_samples, longstraw=longstraw, cp_group=cp_group,
                                 dp_group=dp_group, keep_capture=keep_capture)
    sampled = []  # (group, Rollouts); the group is None until its rewards are in
    try:
        for j, schedule in enumerate(schedules):
            if schedule.idle:
                decode_idle_slot(model, schedule, rollout.max_new_tokens, longstraw=longstraw, cp_group=cp_group,
                                 keep_capture=keep_capture)
                continue
            samples = generate(model, prompts[j], rollout.num_samples, rollout.max_new_tokens,
                               temperature=rollout.temperature, top_p=rollout.top_p,
                               eos_token_id=rollout.eos_token_id, seed=sample_seed(rollout.seed, step, first_index + j),
                               longstraw=longstraw, cp_group=cp_group, keep_capture=keep_capture, lockstep=schedule,
                               environment=rollout.environment_for(prompts[j]), max_turns=rollout.max_turns,
                               score_temperature=score_temperature)
            sampled.append((None, samples))
            rewards = [_reward(reward, rollout, samples.prompt_ids, response) for response in samples.response_ids]
            sampled[-1] = (samples.group(rewards), samples)
    except BaseException:  # a failed reward or sample: no kept capture outlives the call
        for _, samples in sampled:
            samples.release()
        raise
    return sampled


def decoding_bytes(adapter: CausalLMAdapter, prompts: Sequence[torch.Tensor], rollout: RolloutConfig,
                   longstraw: LongstrawConfig) -> int:
    """What decoding this rank's prompts keeps on the device (module docstring): the longest prompt's pages (its
    CP shard) on the "none" tier, else two staged layers of them; every sample's carry and its response rows
    (allocated whole up front); a step's logits in the head's dtype and in float64."""
    specs = adapter.specs
    tokens = -(-max(p.numel() - 1 for p in prompts) // longstraw.cp_size)
    per_token = sum(spec.bytes_per_token for spec in specs)
    pages = tokens * (per_token if longstraw.offload.tier == "none"
                      else 2 * max(spec.bytes_per_token for spec in specs))
    samples, logits = decode_state_bytes(rollout.num_samples, rollout.max_new_tokens,
                                         sum(spec.carry_bytes for spec in specs), per_token, adapter.vocab_size,
                                         torch.empty((), dtype=adapter.dtype).element_size())
    return pages + samples + logits


def resolve_zero3_weights(engine: DeepSpeedEngine, prompts: Sequence[torch.Tensor], rollout: RolloutConfig,
                          dp_group: ProcessGroup | None) -> str:
    """"per_call" or "whole" for this step's rollouts (collective over dp_group when `auto`): "whole" only where
    every rank has room for the weights beyond its ZeRO-3 share beside what decoding keeps (module docstring)."""
    if engine.zero_optimization_stage() != 3:
        return "per_call"  # the weights are whole already: nothing is gathered either way
    if rollout.zero3_weights != "auto":
        return rollout.zero3_weights
    from deepspeed import comm as dist

    from ds_longstraw.arch import adapter_for

    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    beyond_share = sum((p.ds_numel - p.ds_tensor.numel()) * p.element_size() for p in partitioned)
    need = beyond_share + decoding_bytes(adapter_for(engine.module), prompts, rollout, engine.longstraw)
    fits = torch.tensor([1 if need <= rollout.zero3_whole_budget * free_device_bytes(engine.device) else 0],
                        device=engine.device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=dp_group)
    return "whole" if bool(fits.item()) else "per_call"


@contextmanager
def decoding_weights(engine: DeepSpeedEngine, how: str) -> Iterator[None]:
    """The engine's weights as the rollouts decode them (module docstring), `how` as resolve_zero3_weights says:
    "per_call" as ZeRO-3 serves them; "whole" every partitioned weight gathered once, and ZeRO-3's module hooks off
    until the block ends, when they go back on (on error too) and the weights are partitioned again."""
    if how != "whole":
        yield
        return
    import deepspeed

    # the hooks' owner: the ZeRO-3 optimizer's parameter offload, or the engine's offload without an optimizer
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


def engine_rollouts(engine: DeepSpeedEngine,
                    prompts: torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]],
                    rollout: RolloutConfig | dict[str, Any],
                    score_temperature: float = 1.0) -> tuple[list[GRPOGroup], dict[str, Any], list[Rollouts | None]]:
    """(groups, extras, captures) for `engine.grpo_step(prompts, rollout=...)`: this rank's prompts sampled with the
    engine's module, its "longstraw" block and CP group; the seed's step is engine.global_steps (restored on
    resume), the prompt index counts over data-parallel replicas. extras: "rewards" (this rank's, per group),
    "mean_reward" (over every data-parallel rank's samples), "rollout_seconds", "groups" (this rank's sampled
    GRPOGroups: responses, rewards, the sampling log-probs as old log-probs; another grpo_step on them is an
    off-policy update), "finished" (per group, whether each sample ended with eos), "zero3_weights" (how decoding
    reached the weights: "per_call" or "whole"; module docstring). captures: per group, the
    Rollouts whose kept capture the training step reuses (one prompt per rank), else None."""
    from deepspeed import comm as dist

    from ds_longstraw.arch import adapter_for

    rollout = parse_rollout(rollout)
    prompts = as_prompts(prompts)
    vocab = adapter_for(engine.module).vocab_size
    for i, prompt_ids in enumerate(prompts):  # fail before any collective, not halfway through one
        if prompt_ids.numel() and int(prompt_ids.max()) >= vocab:
            raise ValueError(f"prompts[{i}] holds token id {int(prompt_ids.max())} >= vocab size {vocab}")
    start = time.perf_counter()
    dp_group = engine.data_parallel_group
    parallelism = engine.longstraw_parallelism
    # The ranks' module calls are collectives under ZeRO-3 and with sharded experts: they decode in lockstep.
    lockstep = ((engine.zero_optimization_stage() == 3 or engine.longstraw_experts is not None)
                and dist.get_world_size(group=dp_group) > 1)
    # One prompt per rank (the long-context case): keep its capture, so the training step skips a second prefill.
    # In lockstep every rank must skip its capture alike (the decode lockstep pads the kept captures as the training
    # step's lockstep pads its captures): all ranks have one prompt, or none keeps. Several prompts would keep
    # several prompts' pages alive at once: they capture again.
    counts = [None] * dist.get_world_size(group=dp_group)  # every rank's prompts (a CP group's ranks: the same)
    torch.distributed.all_gather_object(counts, len(prompts), group=dp_group)
    keep = all(count == 1 for count in counts)
    # the replicas before this one
    first_index = sum(counts[r * parallelism.cp_size] for r in range(parallelism.replica))
    weights = resolve_zero3_weights(engine, prompts, rollout, dp_group)
    was_training = engine.module.training
    engine.module.eval()
    try:
        with decoding_weights(engine, weights):
            sampled = rollout_samples(engine.module, prompts, rollout, step=engine.global_steps,
                                      first_index=first_index, longstraw=engine.longstraw,
                                      cp_group=parallelism.cp, dp_group=dp_group if lockstep else None,
                                      keep_capture=keep, score_temperature=score_temperature)
    finally:
        engine.module.train(was_training)
    groups = [group for group, _ in sampled]
    captures = [samples if keep else None for _, samples in sampled]
    rewards = [group.rewards.tolist() for group in groups]
    total = torch.tensor([sum(map(sum, rewards)), sum(map(len, rewards))], dtype=torch.float64, device=engine.device)
    dist.all_reduce(total, group=dp_group)
    extras = {"rewards": rewards, "mean_reward": float(total[0] / total[1]),
              "rollout_seconds": time.perf_counter() - start,
              "groups": groups, "finished": [samples.finished for _, samples in sampled], "zero3_weights": weights}
    return groups, extras, captures
