"""Exact mode's capture that keeps its graph where it fits (longstraw.prefix_keep_graph).

Exact mode's capture runs the prompt without autograd, and the prefix pass runs it again segment by segment with
autograd (with prefix_recompute, once more layer by layer in backward): one forward more than full-sequence
autograd, the price of a live graph bounded by one segment. Where the prompt's graph fits a budget
(offload/auto.graph_budget) that price buys nothing, so capture runs its first segments WITH autograd and keeps their
graph until the prefix pass:
  - a kept segment reads the kept segments before it as live tensors (not pages): its attention's gradient reaches
    their rows through the graph, and its carry is the previous segment's live end carry;
  - its rows still go to the pages (detached) for the replay, which leaves their gradients on the gradient pages;
  - the prefix pass recomputes only the segments after the kept ones, last first, as before, and ends with ONE
    backward of the kept graph from the gradients on its rows' gradient pages (the replay's and the later
    segments') and d(the last kept segment's end carry).
Every prompt token's contribution is counted once, as in full-sequence autograd: the gradient pages hold only what
reached the rows from outside the kept graph.

What stays alive: the kept graph, at most the budget, plus one member's replay graph at a time: flat in G. The graph
is measured: saved-tensor hooks count the storages autograd saves (each once; the parameters' not) until two
segments of the same length in a row save within STEADY of each other; from then on a segment of that length is
charged the larger of the two plus STEADY (a hook per saved tensor costs a few percent of the forward), and any
other (the prompt's last, one cut to fit) is counted again. A token's graph grows with its position only while its
past is shorter than what it attends (a top-k selection saves fewer rows below k); beyond, the past it reads is the
earlier segments' rows, counted once, and a segment also saves a few per-segment tensors (a Gated DeltaNet layer's
initial state): tests/equivalence/test_kept_graph.py holds the charges against a count of every segment. The first kept
segment is a probe of at most PROBE_TOKENS tokens (a token's graph at a large model's width is tens of MiB); each
later one takes as many tokens, up to the capture segment, as the bytes per token measured so far say still fit
(a segment cut to fit can overshoot the budget by its per-segment part; nothing is kept after it).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.prefix_pass import injected_grads, segment_roots

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ds_longstraw.arch.base import CausalLMAdapter, SegmentOutput
    from ds_longstraw.offload import PagePool
    from ds_longstraw.offload.tiered import TieredPagePool

# The first kept segment's tokens: small enough that its graph fits any budget worth keeping (Qwen3.6-27B under
# LoRA saves about 31 MiB a token: 4 GiB here), large enough that its bytes per token stand for the rest's.
PROBE_TOKENS = 128
# The hooks count segments until two of the same length in a row save within this fraction of each other.
STEADY = 0.02


class SavedBytes:
    """While entered, counts the bytes of the storages autograd saves for backward, each storage once (by address)
    and none of the model's parameters' (a projection saves its weight, or a view of it). A parameter ZeRO-3
    gathers into a fresh storage is counted, an overestimate on the safe side."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in parameters}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in self._skip and address not in self._seen:
            self._seen.add(address)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class KeptSegment:
    start: int  # captured tokens [start, end)
    end: int
    out: SegmentOutput  # its forward's outputs, with their graph
    saved_bytes: int  # what its forward saved for backward: measured, or charged (the module docstring)
    measured: bool


class KeptGraph:
    """The kept segments of one capture, first to last from the prompt start. budget: the bytes of saved graph it
    may hold (None: no bound). `open` is False once a segment no longer fits; capture then goes on without."""

    def __init__(self, adapter: CausalLMAdapter, budget: int | None) -> None:
        self.adapter = adapter
        self.budget = budget
        self.segments: list[KeptSegment] = []
        self.tokens = 0  # the captured tokens the kept segments cover, from the prompt start (kept after release)
        self.open = budget is None or budget > 0
        self._saved = SavedBytes(list(adapter.model.parameters()))
        self.saved_bytes = 0  # measured or charged (the module docstring); kept after release, for the report
        self._last: tuple[int, int] | None = None  # (tokens, bytes) of the last measured segment
        self._steady: tuple[int, int] | None = None  # (tokens, bytes charged) once two in a row agree

    def next_end(self, start: int, length: int, segment: int) -> int:
        """Where a kept segment from `start` ends: the probe (the first), then up to `segment` tokens as far as the
        budget reaches at the steady segment's bytes per token (else the last measured one's); `start` where none
        fits (the graph is then closed)."""
        tokens = min(segment, length - start)
        if not self.segments:
            tokens = min(tokens, PROBE_TOKENS)
        elif self.budget is not None:
            measured_tokens, saved = self._steady or self._last
            if saved > 0:
                tokens = min(tokens, int((self.budget - self.saved_bytes) * measured_tokens // saved))
        if tokens <= 0:
            self.open = False
            return start
        return start + tokens

    def run(self, ids: torch.Tensor, start: int, end: int, position: int,
            carry: Mapping[int, Sequence[torch.Tensor]]) -> SegmentOutput:
        """Captured tokens ids[start:end] (at prompt position `position`) with autograd, from the previous kept
        segment's live end carry, over the kept segments' live rows; kept. A probe whose graph exceeds the
        budget is kept all the same (it ran already) and closes the graph."""
        past = {layer: [segment.out.rows[layer] for segment in self.segments]
                for layer in (self.segments[0].out.rows if self.segments else ())}
        tokens = end - start
        measured = self._steady is None or self._steady[0] != tokens
        before = self._saved.bytes
        with torch.enable_grad(), self._saved if measured else nullcontext():
            # no hidden states: the kept segments' rows and carries are what the replay and the later ones read
            out = self.adapter.forward_segment(ids[start:end], position, carry, past, need_hidden=False)
        if measured:
            saved = self._saved.bytes - before
            last, self._last = self._last, (tokens, saved)
            if self._steady is None and last is not None and last[0] == tokens and \
                    abs(saved - last[1]) <= STEADY * last[1]:
                self._steady = (tokens, int(max(saved, last[1]) * (1 + STEADY)))
        else:
            saved = self._steady[1]
        self.saved_bytes += saved
        self.segments.append(KeptSegment(start, end, out, saved, measured))
        self.tokens = end
        if self.budget is not None and self.saved_bytes >= self.budget:
            self.open = False
        return out

    def backward(self, pool: PagePool | TieredPagePool, d_carry: Mapping[int, Sequence[torch.Tensor]],
                 backward: Callable[[torch.Tensor], object] | None, timings: dict[str, float]) -> None:
        """The kept graph's one backward, after the replay and the prefix pass over the later segments: each kept
        segment's rows get the gradients on their gradient pages, the last one's end carry d_carry (layer ->
        d(its carry), the later segments' or the replay's); `backward` as ReversePass.backward. The graph is
        dropped afterwards."""
        outputs, grads = [], []
        specs = self.adapter.specs
        for index, segment in enumerate(self.segments):
            last = index == len(self.segments) - 1  # the earlier ones' end carries are inside the graph
            outputs += segment_roots(specs, segment.out, carries=last)
            grads += injected_grads(specs, d_carry, pool, segment.start, segment.end, carries=last)
        # A frozen model part (a LoRA policy whose adapters miss a layer) can leave an output graph-free.
        live = [(o, g.to(o)) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        started = time.perf_counter()
        if live and backward is None:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        elif live:
            backward(sum((o * g.detach()).sum() for o, g in live))
        timings["backward"] = timings.get("backward", 0.0) + time.perf_counter() - started
        self.release()

    def release(self) -> None:
        """Drop the kept graph (after its backward, or on error)."""
        self.segments.clear()
