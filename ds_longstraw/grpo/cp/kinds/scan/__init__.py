"""The "affine_scan" layer kind: a recurrence whose segment map is affine in its carry; ranks fold summaries of
their segments in prompt order (the family's own math: arch/qwen3_5_scan.py, arch/qwen3_5_scan_backward.py).

capture.py    the capture's scan: summaries all-gathered and folded, each piece from its true initial carry
backward.py   exact mode's layer-major prefix pass: the state adjoint's summaries folded from the prompt's end
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.cp.kinds.base import CaptureFrame, LayerKind, LayerMajorFrame, Selection, register_kind
from ds_longstraw.grpo.cp.kinds.scan.backward import prefix_scan_layer, scan_layer_forward
from ds_longstraw.grpo.cp.kinds.scan.capture import capture_scan_layer, holds_scan_outputs

if TYPE_CHECKING:
    from ds_longstraw.arch.specs import LayerState


class ScanKind(LayerKind):
    name = "affine_scan"

    def begin_capture(self, frame: CaptureFrame) -> None:
        # decided from the largest shard, so every rank decides alike (the module calls differ between the two)
        frame.hold = holds_scan_outputs(frame.longstraw, frame.adapter.scan_output_bytes(frame.largest),
                                        frame.adapter.device)

    def capture(self, frame: CaptureFrame, spec: LayerState, normed: torch.Tensor) -> torch.Tensor:
        mixed, frame.final_carry[spec.layer] = capture_scan_layer(frame, spec.layer, normed)
        return mixed

    def forward(self, frame: LayerMajorFrame, spec: LayerState, normed: torch.Tensor,
                selection: Selection | None) -> tuple[list[torch.Tensor], Selection | None]:
        return scan_layer_forward(frame.adapter.recurrent_scan(spec.layer), spec.layer, normed, frame.chunks,
                                  frame.state), selection

    def backward(self, frame: LayerMajorFrame, spec: LayerState, read_input: Callable[[int, int], torch.Tensor],
                 d_hidden: torch.Tensor) -> torch.Tensor:
        return prefix_scan_layer(frame, spec.layer, read_input, d_hidden)


SCAN = register_kind(ScanKind())
