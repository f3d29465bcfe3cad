"""The output side of an attention layer's exact-mode prefix backward, shared by dense and sparse attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_longstraw.arch.base import grad_leaf, grad_of, inject_gradients

if TYPE_CHECKING:
    from ds_longstraw.arch.base import CausalLMAdapter


def output_side(adapter: CausalLMAdapter, layer: int, x_1TC: torch.Tensor, position: int, out: torch.Tensor,
                dy_1TC: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None,
                finish_input: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d out, d x) of y = mlp_residual(x + attention_finish(out, f)) given d y, with
    f = finish_input(adapter, layer, mixer_input(x), position): what the output needs from x (dense: the output gate,
    its half of the query projection; sparse: the absorbed W_UV map), recomputed here with its graph rather than
    held over the shard."""
    x, out = grad_leaf(x_1TC), grad_leaf(out)
    with torch.enable_grad():
        finish = finish_input(adapter, layer, adapter.mixer_input(layer, x), position)
        y = adapter.mlp_residual(layer, x + adapter.attention_finish(layer, out, finish))
        inject_gradients([y], [dy_1TC], backward)
    return grad_of(out), grad_of(x)
