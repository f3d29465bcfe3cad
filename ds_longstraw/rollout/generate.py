"""generate: rollouts of one prompt, decoded from the state the transaction's capture keeps.

    capture   the prompt[:-1] once, without autograd, onto pages (the topology's capture: one rank, or the prompt
              sharded over a context-parallel group; the longstraw block's tiers)
    decode    step t of every sample in one forward (adapter.decode_step, arch/decode.py): feed prompt[-1], then
              each sample's sampled token, through the topology's replay view of the captured state (the prompt's
              pages, staged a layer at a time and read once per step for the whole batch; under context
              parallelism every rank's pages through all-gathered (out, lse) partials). Each sample keeps only its
              own carry (recurrent layers) and its own response rows (paged layers); the prompt state is read,
              never copied or changed, so every sample starts from the same captured state. A sample that draws
              eos leaves the batch. batched=False (or an adapter without decode_step) decodes the samples one
              after another through the segment forward: the plain reference.
    lockstep  (ranks whose module calls are collectives: ZeRO-3 data-parallel ranks, sharded experts) captures and
              decode steps padded to every rank's, so each rank brings its own prompts, samples and eos
              (decode_lockstep.py)
    release   the pages go (on error as on success), unless the caller keeps the capture for training
              (keep_capture=True): then Rollouts holds it until grpo_backward(..., capture=rollouts) takes it (and
              releases it when that call returns or raises), or until Rollouts.release() / the end of a `with` block

What it is: ancestral sampling at `temperature` with nucleus (top-p) truncation, or greedy argmax at temperature 0.
What it is not: a serving engine (no continuous batching across prompts, no speculative decoding; one token per
sample per forward).

Reusing the capture for training (the on-policy step): generate(..., keep_capture=True) captures with the training
config as given (exact mode: with the checkpoints at segment starts the prefix pass needs, as the transaction's own
capture), and records a fingerprint of the trainable weights (each one's version counter: any in-place change, an
optimizer step or a load, bumps it). grpo_backward(model, rollouts.group(rewards), ..., capture=rollouts) then skips
its policy capture; it refuses (ValueError) a capture whose weights, prompt, model or capture-relevant settings
differ from the call's. Under context parallelism every rank keeps (and reuses) its own shard.

Sampling is reproducible across topologies and devices: the distribution of a step is moved to the CPU in float64,
and sample g draws its step-t uniform from its own CPU torch.Generator (seeded from (seed, g)), by inverse CDF over
the tokens sorted by probability (ties: lower id first). Ranks of a context-parallel group compute the same logits
(the replicated replay's property); the token of the group's first rank is taken by every rank all the same, so
the ranks' calls cannot drift apart even where a uniform lands on a rounding boundary.

Legend: V vocabulary, G samples still in the batch; rows are token-major [T, ...] per stream of a paged layer, as
the adapter returns them; the batched path keeps each sample's rows in its slot of arch/decode.OwnRows
([G, max_new_tokens, ...] per stream).
"""

from __future__ import annotations

import math
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ds_longstraw.arch import adapter_for, expert_parallel
from ds_longstraw.arch.decode import OwnRows
from ds_longstraw.config import parse_config
from ds_longstraw.group import GRPOGroup, as_ids
from ds_longstraw.grpo.kept_spans import KeptSpans
from ds_longstraw.grpo.lockstep import PAD_TOKEN, Schedule
from ds_longstraw.grpo.memory import PhaseMeter, PhaseStats, return_freed_host_memory
from ds_longstraw.grpo.topology import build_topology
from ds_longstraw.kernels.dispatch import kernel_mode
from ds_longstraw.parallel.experts import check_expert_parallel
from ds_longstraw.rollout.decode_lockstep import decode_locksteps
from ds_longstraw.rollout.environment import Environment, TurnRules, check_environment, observer
from ds_longstraw.seeds import splitmix64

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.lockstep import Lockstep
    from ds_longstraw.grpo.replay import PrefixLeaves, ResponsePast
    from ds_longstraw.grpo.state import PrefixState
    from ds_longstraw.grpo.topology import ReplayView, Topology
    from ds_longstraw.offload import StagedPast
    from ds_longstraw.parallel.groups import CPContext


@dataclass(frozen=True)
class DecodeStep:
    """One step of the batched decode: `samples` decoded one token each, the longest of them at `context` tokens
    (prompt and response so far), in `seconds` of wall time and `cpu_seconds` of the process's CPU time (the
    forward, the head, the draw; the observations the step asked for are not counted: neither the environment's
    answers nor their forwards). CPU time is what the step cost where other work shares the cores."""

    samples: int
    context: int
    seconds: float
    cpu_seconds: float


@dataclass
class Rollouts:
    """G samples of one prompt. response_ids: G 1-D LongTensors (each ends with an eos id where one was sampled);
    logprobs: G float64 tensors, each sampled token's log-prob under the model at the sampling temperature (greedy:
    1; no top-p truncation): the sampling policy's log-probs, usable as a GRPOGroup's old_logprobs (0.0 at an
    observation's tokens); finished: whether each sample ended with eos, or its environment ended it (else it stopped
    at max_new_tokens or max_turns); seed: the seed that reproduces the samples (drawn at random when none was
    given); phases: name -> memory.PhaseStats of "capture" and "decode" (and "observations", the seconds within
    "decode" of the observations: the environment's answers and their forwards). With an environment
    (rollout/environment.py): response_masks, G boolean tensors (True: an action token the policy sampled, False:
    an observation's), and turns, the observations each sample got; without one response_masks is None and turns
    all 0. decode_steps: one DecodeStep per step of the batched decode (empty with batched=False): how many samples
    it decoded, at what context, in how many seconds; a batch decodes fewer tokens per second once samples of
    different lengths have ended, and these say how fast each step was at the batch it had."""

    prompt_ids: torch.Tensor
    response_ids: list
    logprobs: list
    finished: list
    seed: int
    phases: dict = field(default_factory=dict)
    capture: KeptCapture | None = None  # keep_capture=True: the captured prompt state, until taken or released
    response_masks: list | None = None
    turns: list = field(default_factory=list)
    decode_steps: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.response_ids)

    def group(self, rewards: torch.Tensor | Sequence[float]) -> GRPOGroup:
        """The GRPO group of these samples with `rewards` [G], the sampled log-probs as its old log-probs."""
        masks = None if self.response_masks is None else list(self.response_masks)
        return GRPOGroup(self.prompt_ids, list(self.response_ids), rewards=rewards, old_logprobs=list(self.logprobs),
                         response_masks=masks)

    def release(self) -> None:
        """Drop the kept capture (its pages and page files), if any is still held; safe to call twice."""
        if self.capture is not None:
            self.capture.release()
            self.capture = None

    def take_capture(self, model: torch.nn.Module, group: GRPOGroup, longstraw: LongstrawConfig,
                     lockstep: Lockstep | None = None) -> PrefixState:
        """The kept capture's PrefixState for a transaction on `group` under `settings` and `lockstep` (what
        grpo_backward's `capture=` calls). The capture leaves these Rollouts whatever happens: the caller owns the
        state and must release it; on a refusal (ValueError: weights changed since generate, another model, prompt,
        config or capture padding) it is released here."""
        kept, self.capture = self.capture, None
        if kept is None:
            raise ValueError("capture: these Rollouts hold no kept capture (generate(..., keep_capture=True) keeps "
                             "one; a transaction or release() took it)")
        try:
            kept.check(model, group, longstraw, lockstep)
        except BaseException:
            kept.release()
            raise
        return kept.take()

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# Settings that change only how the replay runs, not what capture keeps: a kept capture serves any value of them.
_REPLAY_ONLY = ("replay_block", "cp_replay", "progress", "prefix_recompute")


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """The trainable parameters' version counters (and storage addresses): any in-place change (an optimizer step,
    a load) or a new tensor assigned to .data changes it. Under ZeRO-3 the partition (ds_tensor) is what the
    optimizer writes, so its counter is the one read."""
    out = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            tensor = getattr(param, "ds_tensor", param)
            out.append((name, tensor._version, tensor.data_ptr()))
    return tuple(out)


class KeptCapture:
    """A prompt's captured state kept by generate for the training step: the PrefixState, the settings it was
    captured under, the model and its weights' fingerprint. Page files of a host/NVMe tier go with release(), or
    when this object is garbage collected. padded_to: the capture chunks its capture was padded to under a decode
    lockstep (decode_lockstep.py), None without one."""

    def __init__(self, state: PrefixState, longstraw: LongstrawConfig, model: torch.nn.Module,
                 prompt_ids: torch.Tensor, padded_to: int | None = None) -> None:
        self.longstraw, self.prompt_ids, self.padded_to = longstraw, prompt_ids, padded_to
        self.model, self.fingerprint = weakref.ref(model), weights_fingerprint(model)
        self._holder = [state]
        self._finalizer = weakref.finalize(self, _release_held, self._holder)

    def check(self, model: torch.nn.Module, group: GRPOGroup, longstraw: LongstrawConfig,
              lockstep: Lockstep | None = None) -> None:
        """ValueError when this capture cannot stand for the capture a transaction of `group` under `settings`
        would make, padded by `lockstep` (lockstep.Lockstep or None): skipping the transaction's capture skips its
        padding calls too, so every rank must skip alike. That holds where the capture needs no padding, or was
        padded under a decode lockstep to the same chunks as the transaction's."""
        if lockstep is None and expert_parallel(model) is not None:
            raise ValueError("capture: a kept capture is reused with sharded experts only under a lockstep "
                             "(engine.grpo_step's); train without capture=")
        if lockstep is not None and lockstep.capture_pad and self.padded_to != lockstep.common.chunks:
            raise ValueError(f"capture: this rank's capture is padded to {lockstep.common.chunks} chunks in the "
                             f"transaction, but the kept capture was padded to {self.padded_to} (None: no decode "
                             "lockstep) and the other ranks' capture calls would not pair up; train without "
                             "capture=, or generate under the same data-parallel group")
        if self.model() is not model:
            raise ValueError("capture: it was captured with another model than the one being trained")
        if weights_fingerprint(model) != self.fingerprint:
            raise ValueError("capture: the trainable weights changed since generate (an optimizer step?); the "
                             "captured state is stale: train with a fresh capture (no capture=)")
        if not torch.equal(group.prompt_ids.cpu(), self.prompt_ids):
            raise ValueError("capture: the group's prompt is not the prompt that was captured")
        mine = self.longstraw.model_dump(exclude=set(_REPLAY_ONLY))
        theirs = longstraw.model_dump(exclude=set(_REPLAY_ONLY))
        differ = sorted(key for key in mine if mine[key] != theirs.get(key))
        if differ:
            raise ValueError(f"capture: 'longstraw' keys {differ} differ between generate's config and the training "
                             f"call's ({[mine[k] for k in differ]} vs {[theirs.get(k) for k in differ]}); a kept "
                             "capture is reused only under the config it was captured with")

    def take(self) -> PrefixState:
        """The PrefixState, now the caller's to release."""
        state = self._holder.pop()
        self._finalizer.detach()
        return state

    def release(self) -> None:
        self._finalizer()  # at most once: releases the state if still held


def _release_held(holder: list[PrefixState]) -> None:
    while holder:
        holder.pop().release()


def generate(model: torch.nn.Module, prompt_ids: torch.Tensor | Sequence[int], num_samples: int,
             max_new_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0,
             eos_token_id: int | Iterable[int] | None = None, seed: int | None = None,
             longstraw: LongstrawConfig | dict[str, Any] | None = None,
             cp_group: dist.ProcessGroup | CPContext | None = None, dp_group: dist.ProcessGroup | None = None,
             keep_capture: bool = False, batched: bool = True, lockstep: Schedule | None = None,
             environment: Environment | None = None, max_turns: int | None = None,
             score_temperature: float | None = None) -> Rollouts:
    """Sample `num_samples` responses of at most `max_new_tokens` tokens to `prompt_ids` (1-D, at least 2 tokens).

    The prompt is captured once (longstraw: the "longstraw" block, whose capture_chunk, page_tokens and offload tier
    apply as in the transaction) and every sample is decoded from those same pages, one token per forward, samples
    one after another (module docstring). temperature: 0 is greedy (argmax, lowest id among ties), else the logits
    are divided by it; top_p: nucleus sampling, the smallest set of most probable tokens whose probability reaches
    top_p (1.0: the whole vocabulary); eos_token_id: an id or a list of ids that end a sample (kept as its last
    token); seed: reproduces the samples on any topology (None: a random seed, reported in Rollouts.seed).
    cp_group: None (one rank), or the process group (or parallel.CPContext) of the context-parallel ranks the
    prompt is sharded over, with the config's cp_size; every rank calls with the same arguments and gets the same
    samples (decoded on every rank: over the whole prompt's pages gathered once where "cp_replay" resolves to
    "gathered" for this prompt, else as the replicated replay does).
    dp_group: None, or the ranks whose module calls are collectives (ZeRO-3's data-parallel ranks): every rank of it
    calls generate together, each with its own prompt, samples and eos, and the calls are padded to the same ones
    (decode_lockstep.py). A model with sharded experts (shard_experts) decodes in lockstep over its expert-parallel
    group when dp_group is None. lockstep: one prompt slot's decode_lockstep.DecodeLockstep, computed by the caller
    for several prompts at once (rollout/step.py), instead of dp_group.
    keep_capture: keep the captured state in Rollouts.capture for grpo_backward(..., capture=rollouts) (module
    docstring), captured under the config as given (exact mode: with the prefix pass's checkpoints); release it
    with Rollouts.release() or a `with` block when not training on it.
    batched: decode the samples' steps as one batch (the adapter's decode_step: qwen3_5 and glm_moe_dsa); False
    decodes them one after another (the plain reference; the same tokens and log-probs up to rounding).
    environment: None (one turn), or what answers a sample's tool calls with observations (rollout/environment.py:
    `stop_ids` and `observe(sample, response_ids)`); the samples' responses then hold their actions and
    observations, max_new_tokens caps both together, max_turns the observations per sample, and
    Rollouts.response_masks marks the actions.
    score_temperature: the temperature of the returned log-probs (None: the sampling temperature, 1 for greedy);
    set it to the training objective's temperature where that differs from the sampling one (a rollout block that
    samples hotter than it trains), so that the group's old log-probs are the policy's at the loss's temperature.
    """
    prompt_ids, eos = _check_arguments(prompt_ids, num_samples, max_new_tokens, temperature, top_p, eos_token_id, seed)
    longstraw = parse_config(longstraw)
    adapter = adapter_for(model)
    if int(prompt_ids.max()) >= adapter.vocab_size:
        raise ValueError(f"prompt_ids holds token id {int(prompt_ids.max())} >= vocab size {adapter.vocab_size}")
    bad = [token for token in eos if token >= adapter.vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} >= vocab size {adapter.vocab_size}")
    stops = check_environment(environment, max_turns, eos, adapter.vocab_size)
    if score_temperature is not None and (isinstance(score_temperature, bool) or not isinstance(
            score_temperature, (int, float)) or not (math.isfinite(score_temperature) and score_temperature > 0)):
        raise ValueError(f"score_temperature must be None or a finite number > 0, got {score_temperature!r}")
    if lockstep is not None and dp_group is not None:
        raise ValueError("generate: give dp_group or lockstep (a slot of decode_schedules over that group), not both")
    longstraw, topology = _decode_setup(model, adapter, longstraw, cp_group, keep_capture, prompt_ids.numel())
    if lockstep is None:
        lockstep = decode_lockstep_for(model, [prompt_ids], num_samples, longstraw, topology, dp_group)[0]
    elif lockstep.idle:
        raise ValueError("generate: this lockstep is an idle slot's (decode_idle_slot runs it)")
    choose = _first_rank_token(topology, adapter.device)
    seed = choose([secrets.randbits(62)])[0] if seed is None else seed  # under CP: the first rank's, as its tokens
    ask = None if environment is None else observer(environment, topology, adapter.vocab_size)
    # observations in forwards of capture_chunk tokens; a kept capture's at most a replay block each: the training
    # step's captured steps are those forwards (grpo/kept_spans.py), each its graph in pass 2
    chunk = min(longstraw.capture_chunk, longstraw.replay_block) if keep_capture else longstraw.capture_chunk
    rules = TurnRules(max_new_tokens, eos, stops, max_turns, ask, chunk)
    scored = (temperature or 1.0) if score_temperature is None else score_temperature
    return _generate(model, adapter, topology, longstraw, prompt_ids, num_samples,
                     Sampling(temperature, top_p, seed, choose, scored), rules, keep_capture, batched, lockstep)


def decode_idle_slot(model: torch.nn.Module, lockstep: Schedule, max_new_tokens: int, *,
                     longstraw: LongstrawConfig | dict[str, Any] | None = None,
                     cp_group: dist.ProcessGroup | CPContext | None = None, keep_capture: bool = False,
                     batched: bool = True) -> None:
    """A prompt slot this rank has no prompt for (lockstep.idle): the dummy prompt's capture and ghost decode steps
    that pad its calls to the other ranks' (decode_lockstep.py); nothing is sampled or kept. keep_capture and
    batched: as the other ranks' generate calls of the slot (they decide the capture's settings and the steps)."""
    from ds_longstraw.rollout.decode_lockstep import IDLE_PROMPT

    adapter = adapter_for(model)
    longstraw, topology = _decode_setup(model, adapter, parse_config(longstraw), cp_group, keep_capture,
                                               IDLE_PROMPT.numel())
    _generate(model, adapter, topology, longstraw, IDLE_PROMPT, 0, Sampling(0.0, 1.0, 0, list),
              TurnRules(max_new_tokens, ()), False, batched, lockstep)


def _decode_setup(model: torch.nn.Module, adapter: CausalLMAdapter, longstraw: LongstrawConfig,
                  cp_group: dist.ProcessGroup | CPContext | None, keep_capture: bool,
                  prompt_tokens: int | None = None) -> tuple[LongstrawConfig, Topology]:
    """(the longstraw block the prompt is captured under, the topology) of a generate call, checked before any work;
    prompt_tokens: the length of the prompt it captures (None: it captures none)."""
    # Capture: a kept capture is the training's, under its config as given; otherwise nothing is kept for a prefix
    # pass, so exact mode's cap on capture segments (prefix_block) would only slow it.
    captured = longstraw if keep_capture else longstraw.model_copy(update={"prefix_grad": "detached"})
    # Every rank decodes every sample, so the view is the gathered pages' where cp_replay resolves so for this
    # prompt (no exchange per token), else the replicated replay's (the spread one splits the members).
    topology = build_topology(adapter, captured, cp_group, prompt_tokens=prompt_tokens, decoding=True)
    ep = expert_parallel(model)
    check_expert_parallel(ep, longstraw, None if ep is None else ep.process_group, cp_group)
    return captured, topology


def decode_schedules(model: torch.nn.Module, prompts: Sequence[torch.Tensor], num_samples: int, *,
                     longstraw: LongstrawConfig | dict[str, Any] | None = None,
                     cp_group: dist.ProcessGroup | CPContext | None = None, dp_group: dist.ProcessGroup | None = None,
                     keep_capture: bool = False) -> list:
    """Per prompt slot, the schedule this rank's generate (or decode_idle_slot, past its last prompt) runs under
    for its `prompts` (1-D ids), with generate's arguments of the same names (decode_lockstep_for; collective over
    dp_group, or the model's expert-parallel group)."""
    adapter = adapter_for(model)
    longstraw, topology = _decode_setup(model, adapter, parse_config(longstraw), cp_group, keep_capture)
    return decode_lockstep_for(model, prompts, num_samples, longstraw, topology, dp_group)


def decode_lockstep_for(model: torch.nn.Module, prompts: Sequence[torch.Tensor], num_samples: int,
                        longstraw: LongstrawConfig, topology: Topology,
                        dp_group: dist.ProcessGroup | None) -> list:
    """Per prompt slot, the schedule this rank decodes under: decode_lockstep.decode_locksteps over dp_group (or,
    without one, over the model's expert-parallel group), or plain Schedules when neither is given (collective
    over that group)."""
    ep = expert_parallel(model)
    group = dp_group if dp_group is not None else None if ep is None else ep.process_group
    if group is None or dist.get_world_size(group=group) == 1:
        return [Schedule() for _ in prompts]
    return decode_locksteps(prompts, num_samples, longstraw, topology.cp, group)


def _generate(model: torch.nn.Module, adapter: CausalLMAdapter, topology: Topology,
              longstraw: LongstrawConfig, prompt_ids: torch.Tensor, num_samples: int, sampling: Sampling,
              rules: TurnRules, keep_capture: bool, batched: bool, schedule: Schedule) -> Rollouts:
    """generate's capture, decode and release, with its arguments checked (num_samples 0: an idle slot's)."""
    meter = PhaseMeter(adapter.device)
    kept, samples, decode_steps = None, [], []
    with torch.no_grad(), kernel_mode(longstraw.kernels):
        with meter.phase("capture"), topology.phase("capture"):
            state = topology.capture(adapter, prompt_ids, longstraw, longstraw.prefix_grad, schedule)
        try:
            with meter.phase("decode"), topology.phase("decode"):
                view = topology.replay_view(adapter, state, "detached")
                try:
                    if batched and hasattr(adapter, "decode_step"):
                        # a kept capture of a multi-turn rollout keeps its observations for the training step
                        kept_spans = [None] * num_samples if keep_capture and rules.ask is not None else None
                        samples = _decode_batch(adapter, view, state.length, prompt_ids[-1], num_samples, sampling,
                                                rules, schedule, kept_spans, decode_steps)
                        state.kept_spans = kept_spans
                    else:
                        samples = _decode_each(adapter, view, state.length, prompt_ids[-1], num_samples, sampling,
                                               rules, schedule)
                finally:
                    view.release()
            if keep_capture:
                kept = KeptCapture(state, longstraw, model, prompt_ids, schedule.capture_padded_to)
        finally:
            if kept is None:
                state.release()  # page files of a host/NVMe tier go on error as on success
    if rules.ask is not None:  # the observations, inside "decode": seconds only (its peak is decode's)
        meter.phases["observations"] = PhaseStats(seconds=rules.captured[0] + rules.asked[0], peak_measured=False)
    ids, logprobs, finished, masks, turns = (list(column) for column in zip(*samples, strict=True)) if samples \
        else ([],) * 5
    return Rollouts(prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs, finished=finished,
                    seed=sampling.seed, phases=meter.phases, capture=kept,
                    response_masks=None if rules.ask is None else masks, turns=turns, decode_steps=decode_steps)


def _check_arguments(prompt_ids: torch.Tensor | Sequence[int], num_samples: int, max_new_tokens: int,
                     temperature: float, top_p: float, eos_token_id: int | Iterable[int] | None,
                     seed: int | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """ValueError naming the argument; returns (prompt ids as a CPU LongTensor, eos ids as a tuple)."""
    prompt_ids = as_ids("prompt_ids", prompt_ids).cpu()
    if prompt_ids.numel() < 2:
        raise ValueError(f"prompt_ids needs at least 2 tokens, got {prompt_ids.numel()}")
    for name, value in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
    eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if any(isinstance(token, bool) or not isinstance(token, int) or token < 0 for token in eos):
        raise ValueError(f"eos_token_id must be None, a token id or a list of token ids, got {eos_token_id!r}")
    return prompt_ids, eos


@dataclass(frozen=True)
class Sampling:
    """How a generate call draws its tokens: temperature (0: greedy), top_p, the samples' seed, choose (the tokens
    every rank takes: _first_rank_token), and the temperature its log-probs are reported at."""

    temperature: float
    top_p: float
    seed: int
    choose: Callable[[list[int]], list[int]]
    score_temperature: float = 1.0


class _ResponseRows:
    """One sample's own rows of every paged layer, token-major, in buffers that double when full: appending a token
    costs O(1) amortised (an observation's rows are appended at once), and attention sees the response as one segment
    after the prompt's pages (a list of one-token segments would make every attention call merge one partial per
    generated token)."""

    def __init__(self) -> None:
        self.buffers, self.length = {}, 0

    def append(self, rows: dict[int, tuple[torch.Tensor, ...]], tokens: int = 1) -> None:
        """rows: layer -> tuple of the rows [tokens, ...] per stream (a decoded token, or an observation's)."""
        for layer, parts in rows.items():
            buffers = self.buffers.get(layer)
            if buffers is None or buffers[0].shape[0] < self.length + tokens:
                capacity = max(16, 2 * self.length, self.length + tokens)
                grown = tuple(_new_buffer(part, capacity) for part in parts)
                if buffers is not None:
                    for new, old in zip(grown, buffers, strict=True):
                        new[: self.length] = old[: self.length]
                self.buffers[layer] = buffers = grown
            for buffer, part in zip(buffers, parts, strict=True):
                buffer[self.length: self.length + tokens] = part
        self.length += tokens

    def past(self, leaves: PrefixLeaves) -> StagedPast | ResponsePast:
        """The past a decode step attends: the prompt's pages (or none: context parallelism reaches them remotely),
        then this sample's rows."""
        past = leaves.past.fresh()
        for layer, buffers in self.buffers.items():
            past.append(layer, tuple(buffer[: self.length] for buffer in buffers))
        return past


def _new_buffer(part: torch.Tensor, shape: int | tuple) -> torch.Tensor:
    """Room for rows like `part`'s: `shape` a capacity of rows (part's row shape after it) or a whole shape
    (uninitialised: only the rows written are ever read; tests poison it)."""
    return part.new_empty((shape, *part.shape[1:]) if isinstance(shape, int) else shape)


def _decode_each(adapter: CausalLMAdapter, view: ReplayView, start: int, first: torch.Tensor, num_samples: int,
                 sampling: Sampling, rules: TurnRules, schedule: Schedule) -> list[tuple]:
    """The samples one after another (the plain reference of _decode_batch): [Response.result()] per sample.
    Under a lockstep the sample slots other ranks have and this one lacks are decoded as ghosts."""
    samples = []
    for sample in range(schedule.sample_slots(num_samples)):
        if sample < num_samples:
            samples.append(_decode(adapter, view, start, first, sample, sampling, rules, schedule))
        else:
            _ghost_steps(adapter, view, start, rules.max_new_tokens, False, schedule)
        return_freed_host_memory(adapter.device)
    return samples


def _decode_batch(adapter: CausalLMAdapter, view: ReplayView, start: int, first: torch.Tensor, num_samples: int,
                  sampling: Sampling, rules: TurnRules, schedule: Schedule, kept: list | None = None,
                  steps: list | None = None) -> list[tuple]:
    """Every sample's step t in one forward (adapter.decode_step): the prompt's pages are read once per step for
    all the samples still running; a sample that ends leaves the batch (its carry is dropped, its rows stay in their
    slot: nothing is copied). Each sample's own rows lie in its slot of arch/decode.OwnRows, so a sample the
    environment answered, whose observation was captured onto its rows (one segment forward, no head), decodes on
    from its own position. Each sample draws from its own generator in the same order as _decode, so the tokens
    are the sequential path's. Under a lockstep, steps this rank takes with no sample running are ghost steps.
    Returns [Response.result()] per sample; kept (a list of num_samples): filled with each sample's
    grpo/kept_spans.KeptSpans, its observations' rows and carries for its training step; steps (a list): gets one
    DecodeStep per step that decoded a sample."""
    max_new = rules.max_new_tokens
    records = [([], {}) for _ in range(num_samples)]  # per sample: its observation forwards, the carries around them
    generators = [_generator(sampling.seed, sample) for sample in range(num_samples)]
    responses = [rules.response() for _ in range(num_samples)]
    active = list(range(num_samples))  # the samples in the batch, in batch order (each its own slot of `own`)
    own = OwnRows(num_samples, max_new, _new_buffer)
    # every sample starts from the prompt's carry: its own copy, [G, ...]
    carry = {layer: tuple(t.expand(num_samples, *t.shape[1:]).clone() for t in parts)
             for layer, parts in view.leaves.carry.items()}
    tokens = first.view(1).expand(num_samples)
    for step in range(max_new):
        if not active:  # this rank's samples have all stopped (or it has none) while another rank decodes
            _ghost_steps(adapter, view, start, max_new - step, True, schedule)
            break
        began, began_cpu = time.perf_counter(), time.process_time()
        asked, asked_cpu = rules.asked  # the environment's time this step (rules.step) is not the step's
        lengths = [own.lengths[sample] for sample in active]
        # no observation yet: one position for all
        position = start + lengths[0] if len(set(lengths)) == 1 else start + torch.tensor(lengths)
        out = adapter.decode_step(tokens, position, carry, view.leaves.past.fresh(), own, view.remote_attention,
                                  active)
        for sample in active:
            own.advance(sample)
        carry = dict(out.carry)
        logits_GV = adapter.lm_head(adapter.body.norm(out.hidden))[:, -1].double().cpu()
        del out
        return_freed_host_memory(adapter.device)  # a step's scattered small temporaries (G times one sample's)
        drawn = [_draw(logits_GV[row], sampling, generators[sample]) for row, sample in enumerate(active)]
        keep, next_tokens, captures = [], [], []
        # the step's tokens in one exchange
        for row, (sample, chosen) in enumerate(zip(active, sampling.choose(drawn), strict=True)):
            logp = torch.log_softmax(logits_GV[row] / sampling.score_temperature, dim=-1)[chosen]
            segment, token = rules.step(sample, responses[sample], chosen, logp)
            if segment:
                captures.append((row, sample, segment))
            if not responses[sample].ended:
                keep.append(row)
                next_tokens.append(token)
        forwards = [(row, sample, piece) for row, sample, segment in captures for piece in rules.forwards(segment)]
        running, common = schedule.next_step(bool(keep), len(forwards), adapter.device)
        captured, captured_cpu = time.perf_counter(), time.process_time()
        for row, sample, piece in forwards:
            _capture_into_slot(adapter, view, start, row, sample, piece, carry, own,
                               None if kept is None else records[sample])
        rules.note_captured(time.perf_counter() - captured)
        _ghost_captures(adapter, view, start, common - len(forwards))
        if steps is not None:  # the context: the prompt, the sample's response so far and this step's token
            asked, asked_cpu = rules.asked[0] - asked, rules.asked[1] - asked_cpu
            steps.append(DecodeStep(len(active), start + max(lengths) + 1, captured - began - asked,
                                    captured_cpu - began_cpu - asked_cpu))
        if len(keep) < len(active):  # finished samples leave the batch
            index = torch.tensor(keep, dtype=torch.long, device=adapter.device)
            carry = {layer: tuple(t.index_select(0, index) for t in parts) for layer, parts in carry.items()}
            active = [active[row] for row in keep]
        if not running:
            break
        tokens = torch.tensor(next_tokens)
    results = [response.result() for response in responses]
    if kept is not None:
        for sample, ((pieces, carries), (ids, _, _, mask, _)) in enumerate(zip(records, results, strict=True)):
            kept[sample] = KeptSpans(pieces, carries, partial(_slot_rows, own, sample), ids, mask)
    return results


def _slot_rows(own: OwnRows, sample: int, first: int, end: int) -> dict:
    """Sample `sample`'s own rows of inputs [first, end), by layer (KeptSpans.rows)."""
    return {layer: tuple(buffer[sample, first:end] for buffer in buffers) for layer, buffers in own.buffers.items()}


def _capture_into_slot(adapter: CausalLMAdapter, view: ReplayView, start: int, row: int, sample: int,
                       segment: list[int], carry: dict, own: OwnRows, record: tuple | None = None) -> None:
    """Sample `sample`'s (batch row `row`) observation tokens `segment` through the model in one forward without
    autograd, from its carry and own rows; its new rows join its own, its carry moves past them (in place).
    record: (pieces, carries) to which this forward's input positions and the sample's carry before and after it
    are added (a kept capture's KeptSpans), or None."""
    first = own.lengths[sample]
    mine = {layer: tuple(t[row: row + 1] for t in parts) for layer, parts in carry.items()}
    if record is not None:
        record[0].append((first, first + len(segment)))
        record[1][first] = {layer: tuple(t.clone() for t in parts) for layer, parts in mine.items()}
    out = adapter.forward_segment(torch.tensor(segment, dtype=torch.long), start + first, mine,
                                  own.past(view.leaves.past.fresh(), sample), view.remote_attention)
    for layer, parts in out.rows.items():
        own.extend(layer, sample, parts)
    own.advance(sample, len(segment))
    for layer, parts in out.carry.items():
        for kept, new in zip(carry[layer], parts, strict=True):
            kept[row] = new[0]
    if record is not None:
        record[1][first + len(segment)] = {layer: tuple(t.clone() for t in parts) for layer, parts in out.carry.items()}


def _decode(adapter: CausalLMAdapter, view: ReplayView, start: int, first: torch.Tensor, sample: int,
            sampling: Sampling, rules: TurnRules, schedule: Schedule) -> tuple:
    """One sample: its Response.result(). Under a lockstep the steps after it ends that other ranks still take
    are ghost steps."""
    carry, rows, response = dict(view.leaves.carry), _ResponseRows(), rules.response()
    generator = _generator(sampling.seed, sample)
    token = first.view(1)
    for step in range(rules.max_new_tokens):
        if response.ended:  # it stopped while another rank decodes
            _ghost_steps(adapter, view, start, rules.max_new_tokens - step, False, schedule)
            break
        out = adapter.forward_segment(token, start + rows.length, carry, rows.past(view.leaves),
                                      view.remote_attention)
        carry = dict(out.carry)
        rows.append(out.rows)
        logits_V = adapter.lm_head(adapter.body.norm(out.hidden))[0, -1].double().cpu()
        chosen = sampling.choose([_draw(logits_V, sampling, generator)])[0]
        logp = torch.log_softmax(logits_V / sampling.score_temperature, dim=-1)[chosen]
        segment, fed = rules.step(sample, response, chosen, logp)
        forwards = rules.forwards(segment)
        running, common = schedule.next_step(not response.ended, len(forwards), adapter.device)
        began = time.perf_counter()
        for piece in forwards:
            out = adapter.forward_segment(torch.tensor(piece, dtype=torch.long), start + rows.length, carry,
                                          rows.past(view.leaves), view.remote_attention)
            carry = dict(out.carry)
            rows.append(out.rows, len(piece))
        rules.note_captured(time.perf_counter() - began)
        _ghost_captures(adapter, view, start, common - len(forwards))
        if not running:
            break
        token = torch.tensor([fed])
    return response.result()


def _draw(logits_V: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """A sample's token from its step's float64 logits: greedy draws nothing; a sample draws one uniform per step
    from its own stream."""
    uniform = 0.0 if sampling.temperature == 0 else float(torch.rand((), generator=generator, dtype=torch.float64))
    return _sample(logits_V, sampling.temperature, sampling.top_p, uniform)


def _ghost_steps(adapter: CausalLMAdapter, view: ReplayView, start: int, steps: int, batched: bool,
                 schedule: Schedule) -> None:
    """At most `steps` ghost steps, until no rank of the schedule has a sample running (decode_lockstep.py), each
    followed by the ghost observation forwards that pad the step's to the other ranks'."""
    for _ in range(steps):
        _ghost_step(adapter, view, start, batched)
        running, captures = schedule.next_step(False, 0, adapter.device)
        _ghost_captures(adapter, view, start, captures)
        if not running:
            return


def _ghost_step(adapter: CausalLMAdapter, view: ReplayView, start: int, batched: bool) -> None:
    """A decode step whose result is thrown away (decode_lockstep.py): one dummy token decoded from the prompt's
    state, as a first step, through the forward the real steps take (decode_step batched, else the segment
    forward) and the head, so it calls the same submodules as a real step."""
    token = torch.full((1,), PAD_TOKEN, dtype=torch.long)
    carry = dict(view.leaves.carry)
    if batched:
        past = view.leaves.past.fresh()
        out = adapter.decode_step(token, start, carry, past, OwnRows(1, 1, _new_buffer), view.remote_attention)
    else:
        out = adapter.forward_segment(token, start, carry, _ResponseRows().past(view.leaves), view.remote_attention)
    adapter.lm_head(adapter.body.norm(out.hidden))


def _ghost_captures(adapter: CausalLMAdapter, view: ReplayView, start: int, count: int) -> None:
    """`count` observation forwards whose results are thrown away: one dummy token from the prompt's state through
    the segment forward (no head), as a real observation's capture calls the model (decode_lockstep.py)."""
    for _ in range(count):
        adapter.forward_segment(torch.full((1,), PAD_TOKEN, dtype=torch.long), start, dict(view.leaves.carry),
                                _ResponseRows().past(view.leaves), view.remote_attention)


def _sample(logits_V: torch.Tensor, temperature: float, top_p: float, uniform: float) -> int:
    """A token id from float64 CPU logits: argmax at temperature 0, else the token where `uniform` (in [0, 1)) falls
    in the cumulative probability of the nucleus (the most probable tokens, ties lower id first, until their
    probability reaches top_p), renormalised."""
    if temperature == 0:
        return int(torch.argmax(logits_V))
    probs_V = torch.softmax(logits_V / temperature, dim=-1)
    sorted_V, order_V = torch.sort(probs_V, descending=True, stable=True)
    cumulative_V = torch.cumsum(sorted_V, dim=0)
    # keep a token while the mass before it is below top_p: the first token always stays
    kept = max(1, int(((cumulative_V - sorted_V) < top_p).sum()))
    target = torch.tensor(uniform, dtype=torch.float64) * cumulative_V[kept - 1]
    index = int(torch.searchsorted(cumulative_V[:kept], target, right=True))
    return int(order_V[min(index, kept - 1)])


def _generator(seed: int, sample: int) -> torch.Generator:
    """Sample `sample`'s own CPU generator: its seed mixes (seed, sample) (SplitMix64), so seeds s and s + 1 share no
    sample's stream, and a sample's draws depend on neither the rank nor how many samples are drawn."""
    return torch.Generator().manual_seed(splitmix64(splitmix64(seed) ^ sample) >> 1)


def _first_rank_token(topology: Topology, device: torch.device) -> Callable[[list[int]], list[int]]:
    """tokens (a list of ints) -> the tokens (or drawn seed) every rank of the topology takes: its own on one rank,
    the CP group's first rank's under context parallelism (one int64 all-gather per call: a decode step's tokens
    of every sample together)."""
    cp = getattr(topology, "cp", None)
    if cp is None:
        return lambda tokens: list(tokens)

    def choose(tokens: list[int]) -> list[int]:
        first = cp.all_gather(torch.tensor(tokens, dtype=torch.int64, device=device), op="rollout_token")[0]
        return [int(token) for token in first.tolist()]

    return choose
