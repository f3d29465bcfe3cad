"""The rows some query selected, and their gradients handed out piece by piece: the row-sparse side of sparse MLA.

Legend as in attention.py: T queries, K selected slots each, N rows in all the pieces (in position order from 0),
U the distinct rows that some valid slot selects (U <= min(N, T K)), R + E a row's width (latent | rope key).

The backward of an attention over selected rows only ever touches those U rows. Laying all N rows side by side
(and a dense [N, R + E] gradient for them, handed to each piece's owner in full) costs O(N (R + E)) per call,
which at GLM-5.2's 2.1M-token prompt is gigabytes moved for every replayed block of every layer; the compact form
costs O(N) bytes (one mark per row, the running count of the marks) plus O(T K + U (R + E)):

- `select_rows`: rows [U] (ascending) and slots [T, K] (each slot's index into rows, 0 where the slot is not
  valid), from `selected_marks` (one mark per row; context parallelism's pages use it alone). No sort of the T K
  positions: a row's index is the number of marked rows before it. Where most rows are
  selected anyway (a prompt segment's queries over the rows before it), every row is taken ("whole": the slots are
  the positions, the table one concatenation), which costs less than gathering nearly all of them.
- `compact_table`: the U rows [U, R + E], gathered piece by piece (each piece's rows are one contiguous run of
  the ascending `rows`).
- `hand_out`: the rows' gradients ([U, R] latent, [U, E] rope) given to the pieces: to a piece's row sink where it
  has one (`sink(rows, d_latent, d_rope)`, rows local to the piece: the prompt pages' gradient pages take only the
  selected rows, offload/staged_past.py), else as the piece's dense gradient (an earlier replay block, the segment).

The plain form beside it is the dense one (every row's gradient by position, as autograd's indexing gives it):
tests/unit/test_sparse_mla_backward.py holds the pieces' gradients and the sinks' rows to plain autograd's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# sink(rows [u] int64 ascending, local to the piece; d_latent [u, R]; d_rope [u, E]), in the piece's dtype
RowSink = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


# Above this share of the N rows selected, the rows are laid out whole (the table one concatenation, each piece's
# gradient a slice of the table's) instead of compactly (a gather of the U rows, a scatter of their gradients): in a
# replayed block's backward the compact form cost 1.11-1.17x the whole one at U = 0.98 N and 0.78-0.85x at
# U = 0.63 N, at the small GLM shape's row width and at GLM-5.2's (bench/bench_sparse_row_grads.py; BENCHMARKS.md,
# "The prompt pages' gradients by rows"): the two cross near 0.8.
WHOLE_FRACTION = 0.75


@dataclass(frozen=True)
class SelectedRows:
    rows: torch.Tensor  # [U] int64, ascending: the distinct positions some valid slot selects (every one if whole)
    slots: torch.Tensor  # [T, K] int64: each slot's index into rows (0 where the slot is not valid)
    whole: bool = False  # rows are every position 0 .. N-1 (more than WHOLE_FRACTION of them were selected)

    def piece_runs(self, lengths: Sequence[int]) -> list[tuple[int, int, int]]:
        """Per piece (lengths in position order from 0): (its first position, lo, hi), rows[lo:hi] being the
        selected rows that lie in it."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        if self.whole:
            return [(starts[i], starts[i], starts[i + 1]) for i in range(len(lengths))]
        bounds = torch.searchsorted(self.rows, torch.tensor(starts, dtype=self.rows.dtype,
                                                            device=self.rows.device)).tolist()
        return [(starts[i], bounds[i], bounds[i + 1]) for i in range(len(lengths))]


def selected_marks(positions: torch.Tensor, valid: torch.Tensor, total: int) -> torch.Tensor:
    """[total] bool: whether some valid slot of positions [T, K] selects each row 0 .. total-1 (the valid slots'
    positions lie in that range; the others, whatever they hold, mark a spare last row that is dropped)."""
    marks = torch.zeros(total + 1, dtype=torch.bool, device=positions.device)
    marks.index_fill_(0, positions.masked_fill(~valid, total).reshape(-1), True)
    return marks[:total]


def select_rows(positions: torch.Tensor, valid: torch.Tensor, total: int) -> SelectedRows:
    """The distinct rows among the valid slots of positions [T, K] (each in [0, total)), and each slot's index
    among them: one mark per row, their running count, one gather. Where more than WHOLE_FRACTION of the rows are
    selected, every row (whole: the slots are the positions)."""
    if total == 0:  # no rows at all (every piece empty): nothing is selected
        return SelectedRows(rows=positions.new_zeros(0), slots=torch.zeros_like(positions))
    invalid = ~valid
    marks = selected_marks(positions, valid, total)
    at = positions.masked_fill(invalid, 0)  # the positions, 0 where not valid
    if int(marks.sum()) > WHOLE_FRACTION * total:
        return SelectedRows(rows=torch.arange(total, device=positions.device), slots=at, whole=True)
    index = marks.cumsum(0) - 1  # [N]: the compact index of each marked row
    slots = index.index_select(0, at.reshape(-1)).view(at.shape).masked_fill_(invalid, 0)
    return SelectedRows(rows=marks.nonzero().squeeze(1), slots=slots)


def compact_table(selected: SelectedRows, latents: Sequence[torch.Tensor], ropes: Sequence[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """The selected rows [max(U, 1), R + E] in `dtype`, latent then rope-key columns (one zero row where nothing is
    selected, so that the unselected slots' index 0 stays in range)."""
    if selected.whole:
        return torch.cat([torch.cat(list(latents)).to(dtype), torch.cat(list(ropes)).to(dtype)], dim=-1)
    rank = latents[0].shape[-1]
    width = rank + ropes[0].shape[-1]
    table = torch.zeros(max(1, selected.rows.numel()), width, dtype=dtype, device=latents[0].device)
    for (start, lo, hi), lat, rope in zip(selected.piece_runs([p.shape[0] for p in latents]), latents, ropes,
                                          strict=True):
        if hi > lo:
            local = selected.rows[lo:hi] - start
            table[lo:hi, :rank] = lat.index_select(0, local)
            table[lo:hi, rank:] = rope.index_select(0, local)
    return table


def hand_out(selected: SelectedRows, d_latent: torch.Tensor, d_rope: torch.Tensor, latents: Sequence[torch.Tensor],
             ropes: Sequence[torch.Tensor], needs: Sequence[bool], sinks: Sequence[RowSink | None] | None,
             ) -> list[torch.Tensor | None]:
    """The pieces' gradients (latents then ropes, None where not needed or where a sink took them) from the
    selected rows' gradients d_latent [U, R] and d_rope [U, E] (rows beyond U, if any, are ignored). A piece with a
    sink gets only its selected rows' gradients, through the sink (nothing when none of its rows is selected); any
    other piece needing a gradient gets it dense, zero in its unselected rows. needs: per latent piece then per
    rope piece."""
    count = len(latents)
    sinks = sinks or [None] * count
    out: list[torch.Tensor | None] = [None] * (2 * count)
    runs = selected.piece_runs([p.shape[0] for p in latents])
    for i, ((start, lo, hi), lat, rope, sink) in enumerate(zip(runs, latents, ropes, sinks, strict=True)):
        if not (needs[i] or needs[count + i]):
            continue
        local = selected.rows[lo:hi] - start
        grads = d_latent[lo:hi].to(lat.dtype), d_rope[lo:hi].to(rope.dtype)
        if sink is not None:
            if hi > lo:
                sink(local, *grads)
            continue
        every = hi - lo == lat.shape[0]  # every row of the piece selected: its gradient is the slice itself
        for slot, piece, grad in zip((i, count + i), (lat, rope), grads, strict=True):
            if needs[slot]:
                # contiguous: a view would keep the whole gradient table alive as long as the piece's gradient
                out[slot] = grad.contiguous() if every else piece.new_zeros(piece.shape).index_copy_(0, local, grad)
    return out
