"""Multi-turn rollouts: an environment answers a sample's tool calls with observations, decoded from the same capture.

    generate(model, prompt, G, max_new_tokens, environment=env, max_turns=...)

A sample decodes its action until it draws one of env.stop_ids (the end of a tool call). The environment gets the
sample's index and its response so far (actions and earlier observations) and returns the observation's token ids,
or None to end the sample. The observation joins the sample's response, masked out of the loss (Rollouts'
response_masks: True for the actions the policy sampled, False for observations); its tokens run through the model
in one forward without autograd, from the sample's own carry and rows, onto the sample's own rows (the rows its
later actions attend to); decoding then resumes from its last token. Samples that wait on no observation keep
decoding in the same batch, each at its own position.

    capture       an observation's tokens run in forwards of at most the longstraw block's capture_chunk tokens, as
                  the prompt's capture does (a decode lockstep pads the forwards, not the observations)
    turn          an action (ended by a stop id) and its observation; max_turns (None: no limit) caps the
                  observations a sample gets: a stop id drawn past it ends the sample, unfinished
    budget        max_new_tokens caps the whole response, actions and observations: an observation that does not
                  fit is cut to the tokens left and ends the sample, unfinished (Rollouts.finished: False)
    eos           ends the sample, finished, as without an environment; so does observe() returning None
    log-probs     the actions' tokens get the sampler's log-probs; an observation's tokens 0.0 (no loss reads them)
    context       under context parallelism only the group's first rank calls observe(); its observation is sent
                  to the others (every rank decodes every sample). Under a decode lockstep (ZeRO-3's data-parallel
                  ranks, sharded experts) each rank calls its own environment for its own samples, and the ranks'
                  observation forwards are padded to the same count per step (decode_lockstep.py).

What it is not: an asynchronous agent runtime (observe() runs between decode steps, one sample after another), nor a
chat-template parser (token ids in, token ids out; integrations/trl maps TRL's tool messages).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ds_longstraw.grpo.topology import Topology


@runtime_checkable
class Environment(Protocol):
    """What generate asks of an environment (module docstring)."""

    stop_ids: Sequence[int]  # token ids that end an action and hand the turn to observe()

    def observe(self, sample: int, response_ids: torch.Tensor) -> Sequence[int] | torch.Tensor | None:
        """The observation's token ids for sample `sample` (its index in the rollouts) whose response so far is
        `response_ids` (1-D, ending with the stop id it drew), or None to end the sample."""


def check_environment(environment: object, max_turns: int | None, eos: tuple[int, ...], vocab: int) -> tuple:
    """The environment's stop ids as a tuple, with generate's environment arguments checked (ValueError naming the
    argument and value) before any work; () without an environment."""
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 0):
        raise ValueError(f"max_turns must be None or an integer >= 0, got {max_turns!r}")
    if environment is None:
        if max_turns is not None:
            raise ValueError("max_turns is given without an environment (it caps an environment's observations)")
        return ()
    if not isinstance(environment, Environment):
        raise ValueError(f"environment {type(environment).__name__!r} needs `stop_ids` (token ids) and "
                         "`observe(sample, response_ids)`")
    stops = environment.stop_ids
    stops = (stops,) if isinstance(stops, int) else tuple(stops)
    if not stops or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in stops):
        raise ValueError(f"environment.stop_ids must be token ids in [0, {vocab}), at least one, got "
                         f"{environment.stop_ids!r}")
    both = sorted(set(stops) & set(eos))
    if both:
        raise ValueError(f"token ids {both} are both eos_token_id and environment.stop_ids: a sample drawing one "
                         "would both end and call the environment")
    return stops


def as_observation(value: object, sample: int, vocab: int) -> list[int] | None:
    """observe()'s result as a list of token ids (None: the sample ends); ValueError naming the sample otherwise."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"environment.observe(sample={sample}) returned a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)}: expected 1-D token ids")
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise ValueError(f"environment.observe(sample={sample}) returned {value!r}: expected token ids or None")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"environment.observe(sample={sample}) returned token id {bad[0]} outside [0, {vocab})")
    return list(value)


def observer(environment: Environment, topology: Topology, vocab: int) -> Callable[[int, array], list | None]:
    """(sample, response ids so far) -> the observation every rank of the topology takes: the environment's on one
    rank; under context parallelism the CP group's first rank asks it and sends its answer to the others."""
    cp = getattr(topology, "cp", None)

    def ask(sample: int, ids: array) -> list[int] | None:
        return as_observation(environment.observe(sample, _tensor(ids, torch.long)), sample, vocab)

    if cp is None:
        return ask

    def first_ranks(sample: int, ids: array) -> list[int] | None:
        box = [None]
        if cp.rank == 0:
            try:
                box = [("observation", ask(sample, ids))]
            except Exception as error:  # the other ranks wait in the broadcast: they raise with it, not hang
                box = [("error", f"{type(error).__name__}: {error}")]
        with cp.waiting():
            dist.broadcast_object_list(box, src=dist.get_global_rank(cp.process_group, 0), group=cp.process_group)
        kind, value = box[0]
        if kind == "error":
            raise ValueError(f"environment.observe(sample={sample}) failed on the context-parallel group's first "
                             f"rank: {value}")
        return value

    return first_ranks


@dataclass(frozen=True)
class TurnRules:
    """What ends a sample and what asks for an observation, for every sample of one generate call. ask: observer()'s
    callable, None without an environment."""

    max_new_tokens: int
    eos: tuple[int, ...]
    stops: tuple[int, ...] = ()
    max_turns: int | None = None
    ask: Callable[[int, array], list[int] | None] | None = None
    # an observation runs through the model in forwards of at most this many tokens (the longstraw block's
    # capture_chunk, as the prompt's capture): its activations are a chunk's, not the whole observation's
    chunk: int = 1 << 62
    # seconds of the observations' forwards so far (generate reports them, with `asked`'s wall seconds, as its
    # "observations" phase, inside "decode")
    captured: list = field(default_factory=lambda: [0.0])
    # [wall, CPU] seconds so far of asking for observations: the environment's answer (a tool's run, under context
    # parallelism the wait for the first rank's) and taking it into the response. Not decoding: a decode step's
    # time (generate.DecodeStep) leaves it out, as it leaves out the observation's forward
    asked: list = field(default_factory=lambda: [0.0, 0.0])

    def note_captured(self, seconds: float) -> None:
        self.captured[0] += seconds

    def forwards(self, segment: list[int]) -> list[list[int]]:
        """The forwards an observation's captured tokens run in (chunk tokens each)."""
        return [segment[i: i + self.chunk] for i in range(0, len(segment), self.chunk)]

    def response(self) -> Response:
        return Response(self.max_new_tokens, self.eos, self.stops, self.max_turns)

    def step(self, sample: int, response: Response, token: int, logp: torch.Tensor) -> tuple[list[int], int]:
        """Take sample `sample`'s drawn token: ([], the token to feed next) where it decodes on; (the tokens to
        capture, the token to feed after them) where the environment answered; ([], the token) where it ended."""
        if response.draw(token, logp):
            began, began_cpu = time.perf_counter(), time.process_time()
            try:
                capture = response.observe(self.ask(sample, response.ids))
            finally:
                self.asked[0] += time.perf_counter() - began
                self.asked[1] += time.process_time() - began_cpu
            if capture is not None:
                return capture
        return [], token


class Response:
    """One sample's response as it is decoded: its tokens, the actions' log-probs, which tokens are actions, its
    turns, and the rules of the module docstring for what a drawn token or an observation does to it.

    Kept in typed arrays, 17 bytes a token: as Python lists (an int object and three pointers a token) a sample's
    observations of tens of thousands of tokens held ~50 bytes a token, ~7 MiB over the 4 x 33K-token rollout of
    bench/bench_agent_rollouts.py, a twentieth of its pages."""

    def __init__(self, max_new_tokens: int, eos: tuple[int, ...], stops: tuple[int, ...],
                 max_turns: int | None) -> None:
        self.max_new_tokens, self.eos, self.stops, self.max_turns = max_new_tokens, eos, stops, max_turns
        # token ids; log-probs (float64, 0 at an observation's tokens); 1 where a token is an action
        self.ids, self.logps, self.trained = array("q"), array("d"), bytearray()
        self.turns, self.ended, self.finished = 0, False, False

    def draw(self, token: int, logp: torch.Tensor) -> bool:
        """Take a sampled token; whether it asks the environment for an observation (else the sample decodes on, or
        it has ended)."""
        self.ids.append(token)
        self.logps.append(float(logp))  # a float64 value: exact
        self.trained.append(1)
        if token in self.eos:
            self.ended = self.finished = True
        elif len(self.ids) >= self.max_new_tokens:
            self.ended = True
        elif token in self.stops:
            if self.max_turns is not None and self.turns >= self.max_turns:
                self.ended = True
            else:
                return True
        return False

    def observe(self, observation: list[int] | None) -> tuple[list[int], int] | None:
        """Take the environment's answer (None ends the sample). Returns (the tokens to capture, the next token to
        feed) where decoding resumes: the stop id and every observation token but the last are captured, the last
        is fed to the next step; None where the sample ended (an observation cut to the budget is not captured)."""
        self.turns += 1
        if observation is None:
            self.ended = self.finished = True
            return None
        stop, room = self.ids[-1], self.max_new_tokens - len(self.ids)
        kept = observation[:room]
        self.ids.extend(kept)
        self.logps.frombytes(bytes(8 * len(kept)))  # 0.0 each
        self.trained.extend(bytes(len(kept)))
        if len(observation) >= room:  # no room left for an action: cut (or exactly filled), unfinished
            self.ended = True
            return None
        if not kept:
            return [], stop
        return [stop, *kept[:-1]], kept[-1]

    def result(self) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor, int]:
        """(ids, log-probs in float64, finished, response mask (True: action), turns)."""
        return (_tensor(self.ids, torch.long), _tensor(self.logps, torch.float64), self.finished,
                _tensor(self.trained, torch.bool), self.turns)


def _tensor(values: array | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A copy of a typed array as a 1-D tensor (the array may grow on, moving its buffer)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype).clone()
