"""Where a stepped member keeps its state between its two passes: one buffer per stream for the whole response,
not one tensor per replay block.

A member in steps (member_steps.py) keeps, from pass 1 to pass 2, every step's rows and the carry at each step's
start, and pass 2 sums the rows' gradients. Kept as the tensors each forward returns, they are hundreds of small
allocations made one by one in the middle of each step's temporaries, and on the host they break up the heap:
measured (the small qwen3_5 shape, one member, 16,384 tool tokens, exact mode, glibc's mallinfo2 after each
pass-1 step), the heap's live bytes grew by what was kept (+24 MiB) while its free bytes grew by 55 MiB, about
0.9 MiB a step that no later temporary could reuse. Copying only the rows into a buffer still left the carries
scattered (free bytes +87 MiB). So both live here: each stream's buffer holds every step (or every position) of
the member, allocated once when its first value comes, and the kept values are views of it. On an accelerator the
caching allocator makes the same choice cheap either way; the copies cost one pass over bytes the planner already
counts (offload/plan.member_replay: tool_rows, tool_carries).

`keep_row`/`keep_carry` copy a value in and return its view; `row_grad` is the zeroed view a row block's gradient
sums into. The plain form is member_steps with buffers=None: each value kept as it came (tests hold both equal).
"""

from __future__ import annotations

import torch


class MemberBuffers:
    """One member's kept rows, carries and row gradients (module docstring). first, end: the response's input
    positions the rows cover; steps: how many start carries are kept."""

    def __init__(self, first: int, end: int, steps: int) -> None:
        self.first, self.end, self.steps = first, end, steps
        self._rows: dict = {}  # layer -> one [end - first, ...] tensor per part
        self._grads: dict = {}  # layer -> one zeroed [end - first, ...] tensor per part, made at its first sum
        self._carries: dict = {}  # layer -> one [steps, ...] tensor per part

    def keep_row(self, layer: int, position: int, parts: tuple) -> tuple:
        """The rows of inputs [position, position + T) of `layer`, copied into its buffers: their views."""
        buffers = self._rows.get(layer)
        if buffers is None:
            buffers = self._rows[layer] = _buffers(parts, self.end - self.first)
        return _copy_in(buffers, position - self.first, parts)

    def keep_carry(self, index: int, carry: dict) -> dict:
        """Step `index`'s start carry (layer -> tensors), copied into its buffers: views."""
        out = {}
        for layer, parts in carry.items():
            buffers = self._carries.get(layer)
            if buffers is None:
                buffers = self._carries[layer] = _buffers(parts, self.steps, per_value=True)
            out[layer] = tuple(buffer[index].copy_(part) for buffer, part in zip(buffers, parts, strict=True))
        return out

    def row_grad(self, layer: int, part: int, position: int, like: torch.Tensor) -> torch.Tensor:
        """The zeroed view the gradient of `layer`'s rows part `part` at [position, position + len(like)) sums
        into."""
        grads = self._grads.setdefault(layer, {})
        buffer = grads.get(part)
        if buffer is None:
            buffer = grads[part] = like.new_zeros((self.end - self.first, *like.shape[1:]))
        offset = position - self.first
        return buffer[offset:offset + like.shape[0]]


def _buffers(parts: tuple, count: int, per_value: bool = False) -> list[torch.Tensor]:
    """One empty buffer per part: `count` values of its shape (per_value) or `count` rows of its row shape."""
    return [part.new_empty((count, *(part.shape if per_value else part.shape[1:]))) for part in parts]


def _copy_in(buffers: list[torch.Tensor], offset: int, parts: tuple) -> tuple:
    return tuple(buffer[offset:offset + part.shape[0]].copy_(part) for buffer, part in zip(buffers, parts,
                                                                                          strict=True))
