"""The "lse" layers' replay spread (grpo/cp/spread.py says the schedule): each rank's queries against every rank's
pages by all-gather, the partials back to their owners by all-to-all, merged in rank order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.cp.kinds.attention.ring import merge_in_order, remote_pages_attention, sum_in_order
from ds_longstraw.kernels.attention import attention_delta

if TYPE_CHECKING:
    from ds_longstraw.grpo.interfaces import OwnPages, Partial


class SpreadPagesAttention:
    """remote_attention of "lse" layers when each rank replays its own members (see the module docstring);
    `pages` is the replicated schedule's PagesAttention, whose per-rank pieces it calls."""

    keys = None  # one request per layer (interfaces.RemoteAttention)

    def __init__(self, pages: OwnPages) -> None:
        self.pages, self.cp = pages, pages.cp
        self.stager = pages.stager  # what the replay's leaves close

    def __call__(self, layer: int, q_HTD: torch.Tensor, known: Partial | None = None) -> Partial:
        return remote_pages_attention(self, layer, q_HTD, known)

    def forward(self, layer: int, q_HTD: torch.Tensor) -> Partial:
        (q_all,), counts = self.cp.gather_tokens((q_HTD,), 1, layer, "spread_q")
        out, lse = self.pages.own_partial(layer, q_all)
        outs, lses = self.cp.return_tokens_together((out, lse), counts, 1, layer, "spread_partial")
        return merge_in_order(list(zip(outs, lses, strict=True)))

    def backward(self, layer: int, q_HTD: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout_HTD: torch.Tensor,
                 dlse_HT: torch.Tensor | None) -> torch.Tensor:
        delta = attention_delta(out, dout_HTD, dlse_HT)
        (q_all, dout_all, lse_all, delta_all), counts = self.cp.gather_tokens(
            (q_HTD, dout_HTD.to(q_HTD.dtype), lse, delta.to(lse.dtype)), 1, layer, "spread_backward")
        dq = self.pages.own_grads(layer, q_all, lse_all, dout_all, delta_all)
        return sum_in_order(self.cp.return_tokens(dq, counts, 1, layer, "spread_dq"))

    def close(self) -> None:
        self.pages.close()
