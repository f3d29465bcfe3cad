"""`generate_from_capture`: TRL's completions sampled from the captured prompt, and the step trained on that capture.

TRL's transformers generation prefills every member's copy of the prompt; here each of this process's prompts is
captured once (ds_longstraw.generate, keep_capture=True), its num_generations samples are decoded from those
pages, and the optimizer step's transaction takes the kept capture instead of capturing again: one prompt pass
per step. Seeds are rollout/step.sample_seed(args.seed, global step, prompt index over processes), so a run
samples alike on any number of processes. Under ZeRO-3 the processes decode in lockstep (their module calls are
collectives; rollout/decode_lockstep.py) and keep a capture only when every one holds a single prompt, as the
engine's rollouts do (several kept prompts would hold their pages at once); otherwise the step captures again.
With TRL's tool loop (tools.py) every sample decodes all its turns from the capture: TRL's eos ids end a turn and
ask the loop's environment, which answers with TRL's tool messages or ends the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_longstraw.config import LongstrawConfig


class CaptureSampler:
    """Samples a process's prompts from their captures and keeps them (by prompt) for the step that trains on them."""

    def __init__(self, longstraw: LongstrawConfig) -> None:
        self.longstraw = longstraw
        self.kept: dict[tuple, Any] = {}  # prompt ids -> rollout.generate.Rollouts holding its kept capture

    def release(self) -> None:
        for rollouts in self.kept.values():
            rollouts.release()
        self.kept = {}

    def take(self, prompt_ids: torch.Tensor) -> Any:
        """The kept Rollouts of this prompt (its capture is then the caller's), or None."""
        return self.kept.pop(tuple(prompt_ids.tolist()), None)

    def sample(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], *, num_generations: int,
               max_new_tokens: int, temperature: float, top_p: float, eos_token_ids: Sequence[int], seed: int,
               step: int, replica: int, dp_group: Any = None, cp_group: Any = None,
               tool_loop: Any = None) -> list[list[int]]:
        """Completions for TRL's local batch `prompt_ids` (each prompt num_generations times, in runs), in order.
        replica: this process's data-parallel replica (its process index, or its CP group's); cp_group: the
        CPContext its prompts are sharded over (its ranks sample alike). tool_loop: TRL's tool loop over these rows
        (tools.ToolLoop): each prompt's samples then decode their turns with its environment (TRL's eos ids end a
        turn, not the sample) and the loop keeps their turns, messages and masks."""
        from ds_longstraw.rollout.generate import decode_idle_slot, decode_schedules, generate
        from ds_longstraw.rollout.step import sample_seed

        self.release()  # a capture of the last step's weights is of no use now
        occurrences: dict[tuple, int] = {}  # each prompt, in order of first appearance, and how often it comes
        rows: dict[tuple, list[int]] = {}  # each prompt's rows, in order: its samples' rows
        for row, ids in enumerate(prompt_ids):
            occurrences[tuple(ids)] = occurrences.get(tuple(ids), 0) + 1
            rows.setdefault(tuple(ids), []).append(row)
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in occurrences]
        counts = set(occurrences.values())
        if counts != {num_generations}:
            raise ValueError(f"generate_from_capture: every prompt of a process's batch must come num_generations = "
                             f"{num_generations} times, got {sorted(counts)}")
        keep = _everyone_has_one(len(prompts), dp_group)
        schedules = decode_schedules(model, prompts, num_generations, longstraw=self.longstraw, cp_group=cp_group,
                                     dp_group=dp_group, keep_capture=keep)
        sampled = {}
        was_training = model.training
        model.eval()
        try:
            for j, schedule in enumerate(schedules):
                if schedule.idle:
                    decode_idle_slot(model, schedule, max_new_tokens, longstraw=self.longstraw, cp_group=cp_group,
                                     keep_capture=keep)
                    continue
                key = tuple(prompts[j].tolist())
                turns = {} if tool_loop is None else dict(environment=tool_loop.environment(rows[key]),
                                                          max_turns=tool_loop.max_turns)
                rollouts = generate(model, prompts[j], num_generations, max_new_tokens, temperature=temperature,
                                    top_p=top_p, eos_token_id=None if turns else list(eos_token_ids),
                                    seed=sample_seed(seed, step, replica * len(prompts) + j),
                                    longstraw=self.longstraw, cp_group=cp_group, keep_capture=keep, lockstep=schedule,
                                    **turns)
                if tool_loop is not None:
                    tool_loop.finish(rows[key], rollouts)
                sampled[key] = [r.tolist() for r in rollouts.response_ids]
                if keep:
                    self.kept[key] = rollouts
        except BaseException:
            self.release()
            raise
        finally:
            model.train(was_training)
        taken = {key: iter(responses) for key, responses in sampled.items()}
        return [next(taken[tuple(ids)]) for ids in prompt_ids]


def _everyone_has_one(prompts: int, dp_group: Any) -> bool:
    """Whether every process of dp_group (this one alone without it) holds exactly one prompt."""
    if dp_group is None:
        return prompts == 1
    counts = [None] * torch.distributed.get_world_size(group=dp_group)
    torch.distributed.all_gather_object(counts, prompts, group=dp_group)
    return all(count == 1 for count in counts)
