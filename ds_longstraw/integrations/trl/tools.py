"""TRL's tool-calling loop (`tools=`, `environment_factory`) on generate's environment hook, for generate_from_capture.

TRL (GRPOTrainer._generate and _tool_call_loop) generates a turn up to an eos id, parses it (parse_response with
the prompt's tools), runs its tool calls, renders the tool messages with the chat template (_get_tool_suffix_ids),
appends them to the completion (tool_mask 0) and generates the next turn from prompt + completion so far, until a
turn calls no tool, max_tool_calling_iterations turns have run their tools, or a tool result would not fit. Here
each prompt's samples decode from its capture (ds_longstraw.generate) with `environment=ToolTurns`:

    stop_ids        TRL's eos ids (the ids its generation stops a turn at); generate gets no eos of its own, so
                    every turn's end asks observe(), which ends the sample (None) where TRL's loop would
    observe()       parses the turn just finished as TRL does (parse_response, prefix = prompt + completion so far,
                    the row's tools), runs its calls as TRL's loop does (sync tools by name; an exception, an unknown
                    name or another call type becomes {"error": ...} and counts as a failure; every call counts),
                    and returns the tool messages' ids from TRL's own _get_tool_suffix_ids; None for a turn without
                    a tool call
    max_turns       max_tool_calling_iterations: a turn past it is parsed (its message) but its calls do not run
                    (TRL's loop has stopped)
    overlong        TRL runs the calls, then drops results that would take the completion past
                    max_completion_length (or prompt + completion to max_position_embeddings) and ends the sample
                    with its completion as it is: observe() runs and counts them too, and returns None
    last turn       a turn cut at max_completion_length (or one ended by an eos at the budget's last token, where
                    generate asks no observation) is parsed after generate (finish); its calls run and count, and
                    their results are dropped (none fits), as TRL's loop does
    environments    TRL builds one environment instance per row and resets it (`_generate_and_score_completions`)
                    before generation; its tool dicts (`_sync_tool_dicts[row]`) are the ones called here
    outputs         completion ids, tool_mask (generate's response_masks: 1 for the model's tokens, 0 for tool
                    messages), the message list per row (TRL's `completions`), the call and failure counts, sampler
                    log-probs None (TRL's transformers generation has none): what _tool_call_loop returns

What it is not: TRL's breadth-first order. TRL runs every row's first-turn calls, then generates every row's second
turn, and so on; here a row's calls run in its own order (turn 1 before turn 2) as its sample decodes, interleaved
with other rows' by the decode and prompt after prompt. Tools that are functions of their arguments, or environments
(one instance per row), give the same results either way; tools sharing state across rows may not. Refused (named,
at construction where it can be known then): async tools (TRL awaits them on its event loop between its batched
turns), a processor (multimodal prompts and tool images; the capture holds token ids only), context parallelism
(only a CP group's first rank would run the tools); at run time, a tool that returns a list (TRL's multimodal content
blocks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def async_tool_names(tools: Sequence[Callable] | None, environment_factory: Any) -> list[str]:
    """The names of the async tools among `tools` and the tool methods of `environment_factory` (a class, or a dict
    of classes; a factory that is not a class is read from TRL's probed instances instead, after construction)."""
    names = [tool.__name__ for tool in tools or () if inspect.iscoroutinefunction(tool)]
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    for factory in factories:
        if inspect.isclass(factory):
            names += [f"{factory.__name__}.{name}" for name, member in _tool_methods(factory)
                      if inspect.iscoroutinefunction(member)]
    return names


def _tool_methods(cls: type) -> list[tuple[str, Callable]]:
    """TRL's rule for an environment's tools: its public functions other than reset and get_reward."""
    return [(name, member) for name, member in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


@dataclass
class _Row:
    """One TRL row's loop state: its prompt ids, the tools it may call, and what its turns gave so far."""

    prompt_ids: list[int]
    tools: list  # parse_response's tools= (the schema the prompt was rendered with)
    sync_tools: dict
    async_tools: dict
    messages: list = field(default_factory=list)  # TRL's completions[row]: assistant and tool messages
    executed: int = 0  # turns whose calls ran (TRL's loop iterations this row took part in)
    turn_start: int = 0  # where the current turn starts in the response
    parsed_to: int = 0  # the response length through the last parsed turn
    ids: list | None = None  # the final completion (finish)
    mask: list | None = None


class ToolLoop:
    """TRL's tool loop over one generation batch's rows (module docstring). parse(ids, prefix, tools): TRL's
    parse_response with the tokenizer; suffix_ids(tool_messages): TRL's _get_tool_suffix_ids; stop_ids: TRL's eos
    ids; max_turns: max_tool_calling_iterations (None: no limit)."""

    def __init__(self, rows: list[_Row], *, parse: Callable, suffix_ids: Callable, stop_ids: Sequence[int],
                 max_turns: int | None, max_completion_length: int, max_model_len: int) -> None:
        self.rows, self.parse, self.suffix_ids = rows, parse, suffix_ids
        self.stop_ids, self.max_turns = tuple(stop_ids), max_turns
        self.max_completion_length, self.max_model_len = max_completion_length, max_model_len
        self.calls = self.failures = 0

    @classmethod
    def from_trainer(cls, trainer: Any, prompt_ids: Sequence[Sequence[int]]) -> ToolLoop:
        """The loop of TRL's generation batch `prompt_ids` (one row each), with the trainer's tokenizer, tools,
        environments' tool dicts (built and reset by TRL for this batch), chat template and limits."""
        import sys

        from trl.chat_template_utils import parse_response

        if trainer.environment_factories is not None:
            tools = [trainer._env_tools[name] for name in trainer._batch_environments]
        else:
            tools = [trainer.tools] * len(prompt_ids)
        rows = [_Row(list(ids), tools[i], trainer._sync_tool_dicts[i], trainer._async_tool_dicts[i])
                for i, ids in enumerate(prompt_ids)]
        config = trainer.model.config
        config = config.text_config if getattr(trainer, "_is_vlm", False) else config
        iterations = trainer.max_tool_calling_iterations
        return cls(rows, parse=lambda ids, prefix, tools: parse_response(trainer._tokenizer, ids, prefix=prefix,
                                                                         tools=tools),
                   suffix_ids=trainer._get_tool_suffix_ids, stop_ids=trainer.eos_token_ids,
                   max_turns=None if iterations >= sys.maxsize else iterations,
                   max_completion_length=trainer.max_completion_length,
                   max_model_len=config.max_position_embeddings)

    def environment(self, rows: Sequence[int]) -> ToolTurns:
        """The environment of one generate call whose sample g is TRL's row rows[g]."""
        return ToolTurns(self, list(rows))

    # -- a turn's calls, as TRL's _tool_call_loop runs them ---------------------------------------------------
    def run_calls(self, row: _Row, calls: list) -> list[dict]:
        """The tool messages of one turn's calls (TRL's order and error results), counting calls and failures."""
        messages = []
        for call in calls:
            self.calls += 1
            if call["type"] != "function":
                self.failures += 1
                name, result = call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call['type']}"}
            else:
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                if name in row.async_tools:  # refused at construction where it could be seen; caught here otherwise
                    raise ValueError(f"generate_from_capture: tool {name!r} is async; TRL awaits async tools on its "
                                     "event loop between its batched turns, which the capture's decode does not run")
                try:
                    if name not in row.sync_tools:
                        raise ValueError(f"Tool {name} not found.")
                    result = row.sync_tools[name](**arguments)
                except Exception as error:  # TRL's rule: a failing call answers with its error
                    self.failures += 1
                    result = {"error": str(error)}
            if isinstance(result, list):
                raise ValueError(f"generate_from_capture: tool {name!r} returned a list (TRL's multimodal content "
                                 "blocks); the capture's decode takes text tool results only")
            messages.append({"role": "tool", "name": name, "content": str(result)})
        return messages

    def observe(self, row: _Row, response_ids: list[int]) -> list[int] | None:
        """The tool messages' ids after the turn that ends `response_ids`, or None where TRL's loop ends the row."""
        turn = response_ids[row.turn_start:]
        message = self.parse(turn, row.prompt_ids + response_ids[: row.turn_start], row.tools)
        row.messages.append(message)
        row.parsed_to = len(response_ids)
        if not message.get("tool_calls"):
            return None
        # generate asks only while fewer than max_turns turns ran their calls: TRL's loop runs this iteration
        tool_messages = self.run_calls(row, message["tool_calls"])
        row.executed += 1
        suffix = list(self.suffix_ids(tool_messages))
        # TRL drops results that would push the completion past max_completion_length (or the sequence to the
        # model's length) and ends the row with its completion as it is: the calls above ran and counted, their
        # messages are not kept, and None ends the sample. A suffix that fills the budget exactly is kept (TRL's
        # next turn is then cut to nothing; generate ends the sample at the full budget).
        completion = len(response_ids) + len(suffix)
        if completion > self.max_completion_length or len(row.prompt_ids) + completion >= self.max_model_len:
            return None
        row.messages.extend(tool_messages)
        row.turn_start = completion
        return suffix

    def finish(self, rows: Sequence[int], rollouts: Any) -> None:
        """Take one generate call's samples (rows[g] is sample g): their completions and masks, and their last
        turn where observe() did not see it (module docstring: "last turn")."""
        for g, index in enumerate(rows):
            row = self.rows[index]
            row.ids = rollouts.response_ids[g].tolist()
            row.mask = [int(m) for m in rollouts.response_masks[g].tolist()]
            if row.parsed_to == len(row.ids) or row.turn_start == len(row.ids):
                continue  # observe() parsed the last turn, or the tool messages filled the budget (no turn after)
            message = self.parse(row.ids[row.turn_start:], row.prompt_ids + row.ids[: row.turn_start], row.tools)
            row.messages.append(message)
            if message.get("tool_calls") and (self.max_turns is None or row.executed < self.max_turns):
                # a turn at the budget: TRL runs its calls, then drops every result (none fits after it)
                self.run_calls(row, message["tool_calls"])
                row.executed += 1

    # -- what TRL's _generate takes ----------------------------------------------------------------------------
    def first_turns(self) -> list[list[int]]:
        """Each row's first turn (its tokens before the first tool message): what TRL's first generation returns
        and _generate parses into completions[row][0]."""
        out = []
        for row in self.rows:
            end = row.mask.index(0) if 0 in row.mask else len(row.ids)
            out.append(row.ids[:end])
        return out

    def trl_outputs(self, logprobs: Any) -> tuple:
        """_tool_call_loop's return value: (tool_mask, completions, completion_ids, logprobs, tool_call_count,
        tool_failure_count, tool_images)."""
        return ([row.mask for row in self.rows], [row.messages for row in self.rows], [row.ids for row in self.rows],
                logprobs, self.calls, self.failures, [[] for _ in self.rows])


class ToolTurns:
    """generate's environment (rollout/environment.py) for one prompt's samples: sample g is TRL's row rows[g]."""

    def __init__(self, loop: ToolLoop, rows: list[int]) -> None:
        self.loop, self.rows = loop, rows
        self.stop_ids = loop.stop_ids

    def observe(self, sample: int, response_ids: torch.Tensor) -> list[int] | None:
        return self.loop.observe(self.loop.rows[self.rows[sample]], response_ids.tolist())
