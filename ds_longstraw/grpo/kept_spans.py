"""A member's observations as generate captured them, kept for its training step: its first pass skips them.

A multi-turn rollout (rollout/environment.py) runs each observation through the model without autograd, onto the
sample's own rows, in pieces. A member whose observations are long runs in steps (member_steps.py): pass 1, a
forward without a graph, computes every step's rows and the carry at its start, then pass 2 recomputes each step with
autograd from those, last to first. Where generate kept what pass 1 would compute for the observations (their rows
and the carry at each piece's start and at each observation's end: generate(..., keep_capture=True)), the member's
captured spans are cut at generate's pieces and pass 1 takes them from here instead of running them: the
observations run forward once in the rollout and once with autograd in pass 2, not a third time. The actions still
run in pass 1 (their log-probs at the objective's temperature, their entropies).

Equal to the member's steps computed afresh up to the order of sums (the rows of one token do not depend on how its
sequence was cut into forwards, except by rounding): tests/distributed/test_rollout_turns.py holds them to 1e-8 in
float64.

Not kept, and so computed afresh: members of a group that a lockstep pads (its steps are one replay block each
over the padded length, lockstep.py), members replayed under context parallelism's spread replay, members whose
response or mask differ from what was decoded, and members decoded one at a time (generate's batched=False keeps
none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_longstraw.grpo.member_steps import Step, member_steps


@dataclass
class KeptSpans:
    """What generate kept of one sample's observations (module docstring). pieces: the input positions [a, b) of
    each observation forward, in order; carries: input position -> the carry there (layer -> tensors, detached), at
    every piece's start and every observation's end; rows(a, b): the rows of inputs [a, b) (layer -> a tuple of
    token-major tensors per stream); response_ids, mask: what was decoded and which of it are actions."""

    pieces: list
    carries: dict
    rows: Callable[[int, int], dict]
    response_ids: torch.Tensor
    mask: torch.Tensor

    def steps(self, response_ids: torch.Tensor, mask: torch.Tensor, threshold: int | None,
              block: int) -> list[Step] | None:
        """The member's steps with every captured span cut at the kept pieces, or None where this member cannot
        use them (another response or mask than decoded, no span captured, a span the pieces do not tile)."""
        if not (torch.equal(response_ids.cpu(), self.response_ids) and torch.equal(mask.cpu(), self.mask)):
            return None
        plain = member_steps(mask, threshold, block)
        if plain is None:
            return None
        starts = {a: b for a, b in self.pieces}
        steps, index = [], 0
        while index < len(plain):
            step = plain[index]
            if step.scored:
                steps.append(step)
                index += 1
                continue
            run_end = step.end  # the captured run: this step and the unscored ones right after it
            while index + 1 < len(plain) and not plain[index + 1].scored and plain[index + 1].start == run_end:
                index += 1
                run_end = plain[index].end
            position = step.start
            while position < run_end:
                end = starts.get(position)
                if end is None or end > run_end or position not in self.carries:
                    return None
                steps.append(Step(position, end, False))
                position = end
            if run_end not in self.carries:
                return None
            index += 1
        return steps

    def covers(self, step: Step) -> bool:
        return not step.scored and self.carries.get(step.start) is not None and step.end in self.carries
