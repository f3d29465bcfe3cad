"""The context-parallel (CP) group as an explicit object: who owns which prompt tokens, and what moved.

Every collective and point-to-point call here names `group=` (no hidden global parallel state); ranks are ranks
*within* the CP group. `CPContext` also counts the payload bytes each rank receives, keyed by
(phase, layer, op), so a run can report bytes moved per layer and per replayed token.

It also times, per phase, how long this rank waits inside its blocking exchanges (a collective, a receive, a
send that has not been taken): a phase's busy seconds are its wall time minus those.

Counting convention (logical payload, not wire bytes of a particular algorithm):
  send/recv     the receiver counts the tensor's bytes;
  all_gather    each rank counts (N-1) x the tensor's bytes;
  all_reduce    each rank counts 2 (N-1)/N x the tensor's bytes (a ring all-reduce's receive volume).
"""

import math
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

CAPTURE_MOVES = ("auto", "kv", "q")
CP_LAYOUTS = ("contiguous", "zigzag")


def shard_bounds(length: int, size: int):
    """Contiguous, balanced shards of `length` tokens over `size` ranks: [(lo, hi)] per rank. The first
    length % size ranks get one token more; shards may be empty when length < size."""
    base, extra = divmod(length, size)
    bounds, lo = [], 0
    for rank in range(size):
        hi = lo + base + (1 if rank < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def shard_pieces(length: int, size: int, layout: str = "contiguous"):
    """Per rank, the prompt token ranges it owns: a tuple of (lo, hi), in increasing order.

    contiguous  one range per rank (shard_bounds): under causal attention rank r reads the keys of ranks 0..r, so
                the last rank does (2N-1)/N^2 of the attention and every layer waits for it.
    zigzag      the prompt cut into 2N balanced segments; rank r owns segments r and 2N-1-r (ring attention's
                zigzag), so every rank's causal attention work is equal (to a segment's +-1 token).
    A rank keeps its tokens in this order (its "local" order), which is also their prompt order: the keys of any
    rank that a query sees are always a prefix of that rank's local tokens (`visible_prefix`)."""
    if layout == "contiguous":
        return [((lo, hi),) for lo, hi in shard_bounds(length, size)]
    if layout != "zigzag":
        raise ValueError(f"cp layout must be one of {CP_LAYOUTS}, got {layout!r}")
    segments = shard_bounds(length, 2 * size)
    return [(segments[r], segments[2 * size - 1 - r]) for r in range(size)]


def segments_in_order(pieces):
    """Every rank's pieces in prompt order: [(rank, index within the rank, lo, hi)] (empty pieces first among
    equal starts)."""
    return sorted(((rank, index, lo, hi) for rank, own in enumerate(pieces) for index, (lo, hi) in enumerate(own)),
                  key=lambda segment: (segment[2], segment[3]))


def visible_prefix(pieces, position: int) -> int:
    """How many of a rank's local tokens (its `pieces`, in order) lie before prompt position `position`."""
    return sum(max(0, min(hi, position) - lo) for lo, hi in pieces)


def local_starts(pieces):
    """Each of a rank's pieces' first local token, then the end: [0, n_0, n_0 + n_1, ...]."""
    starts = [0]
    for lo, hi in pieces:
        starts.append(starts[-1] + hi - lo)
    return starts


def local_to_prompt(local, pieces):
    """The prompt positions (int64) of a rank's local token indices `local` (any integer tensor; `pieces` its
    ranges in order). Monotone: local order is prompt order."""
    starts = local_starts(pieces)
    local = local.long()
    shift = torch.tensor([lo - start for (lo, _), start in zip(pieces, starts[:-1], strict=True)], dtype=torch.long,
                         device=local.device)
    which = torch.bucketize(local, torch.tensor(starts[1:-1], dtype=torch.long, device=local.device), right=True)
    return local + shift[which]


def prompt_to_local(positions, valid, pieces):
    """(local indices int64, mine) of prompt `positions` where `valid`: mine marks those among this rank's `pieces`;
    the index is 0 elsewhere."""
    local = torch.zeros_like(positions, dtype=torch.long)
    mine = torch.zeros_like(valid)
    for (lo, hi), start in zip(pieces, local_starts(pieces)[:-1], strict=True):
        inside = valid & (positions >= lo) & (positions < hi)
        local = torch.where(inside, positions - lo + start, local)
        mine |= inside
    return local, mine


def piece_index(pieces, position: int) -> int:
    """The index of the piece of `pieces` that holds prompt position `position`."""
    return next(k for k, (lo, hi) in enumerate(pieces) if lo <= position < hi)


def local_tokens(tokens, pieces):
    """A rank's tokens of the prompt-ordered `tokens` (dim 0), in local order."""
    return torch.cat([tokens[lo:hi] for lo, hi in pieces])


class PromptShards(tuple):
    """Every rank's pieces of one prompt under a CP layout (shard_pieces: per rank a tuple of (lo, hi), in prompt
    order), seen from `rank`: what a rank's shard is (its pieces, their local starts, its token count, the ranks'
    sizes) is asked here instead of re-derived where it is used. Indexing gives a rank's pieces, as the plain list
    of shard_pieces does."""

    rank: int

    def __new__(cls, pieces, rank: int):
        shards = super().__new__(cls, (tuple(own) for own in pieces))
        shards.rank = rank
        return shards

    def __reduce__(self):
        return PromptShards, (tuple(self), self.rank)

    @property
    def mine(self):
        """This rank's pieces."""
        return self[self.rank]

    def size(self, rank: int | None = None) -> int:
        """The tokens a rank owns (default: this one)."""
        return sum(hi - lo for lo, hi in self[self.rank if rank is None else rank])

    @property
    def tokens(self) -> int:
        return self.size()

    @property
    def sizes(self) -> list[int]:
        return [self.size(rank) for rank in range(len(self))]

    @property
    def largest(self) -> int:
        """The largest shard's tokens (every rank decides alike from it)."""
        return max(self.sizes)

    @property
    def starts(self) -> list[int]:
        """This rank's pieces' first local token, then its end (local_starts)."""
        return local_starts(self.mine)

    @property
    def order(self):
        """Every rank's pieces in prompt order (segments_in_order)."""
        return segments_in_order(self)

    def to_local(self, positions, valid):
        """prompt_to_local over this rank's pieces."""
        return prompt_to_local(positions, valid, self.mine)

    def local_tokens(self, tokens):
        """This rank's tokens of the prompt-ordered `tokens`, in local order."""
        return local_tokens(tokens, self.mine)


def contiguous_bounds(pieces):
    """[(lo, hi)] per rank when every rank owns one piece (the contiguous layout), else None."""
    return [own[0] for own in pieces] if all(len(own) == 1 for own in pieces) else None


def local_spans(pieces, chunk: int):
    """A rank's tokens in chunks of at most `chunk` that never straddle two of its pieces: [(a, b, position)] with
    [a, b) in local order and `position` the prompt position of local token a."""
    spans, a = [], 0
    for lo, hi in pieces:
        for start in range(lo, hi, chunk):
            n = min(hi, start + chunk) - start
            spans.append((a, a + n, start))
            a += n
    return spans


class Traffic:
    """Bytes received by this rank, by (phase, layer, op); layer is -1 for traffic not tied to a layer."""

    def __init__(self):
        self.received = defaultdict(int)
        self.messages = defaultdict(int)

    def add(self, phase, layer, op, nbytes):
        self.received[(phase, layer, op)] += int(nbytes)
        self.messages[(phase, layer, op)] += 1

    def total(self, phase=None) -> int:
        return sum(b for (p, _, _), b in self.received.items() if phase is None or p == phase)

    def by_layer(self, phase=None) -> dict:
        return self._by(1, phase)

    def by_op(self, phase=None) -> dict:
        return self._by(2, phase)

    def _by(self, part, phase) -> dict:
        """Bytes received per value of one part of the (phase, layer, op) key, in that part's order."""
        out = defaultdict(int)
        for key, b in self.received.items():
            if phase is None or key[0] == phase:
                out[key[part]] += b
        return dict(sorted(out.items()))

    def reset(self):
        self.received.clear()
        self.messages.clear()


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


class TokenBytes:
    """Tensors that share their token count along `dim`, laid out as one row of bytes per token: rows [T, B] uint8
    (each tensor's elements of a token, tensor after tensor), so that they travel in one collective. unpack(rows)
    takes any [T', B] rows of the same layout back to the tensors (T' tokens each): bit for bit, booleans
    included (they travel as uint8)."""

    def __init__(self, tensors, dim):
        self.dim, self.layouts, columns = dim, [], []
        for tensor in tensors:
            wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
            moved = wire.movedim(dim, 0).contiguous()
            row = moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))
            if row.shape[1] == 0:
                row = row.new_empty(row.shape, dtype=torch.uint8)
            elif moved.element_size() > 1:
                row = row.view(torch.uint8)  # [T, n] -> [T, n * element size]
            columns.append(row)
            self.layouts.append((tensor.dtype, wire.dtype, tuple(moved.shape[1:]), row.shape[1]))
        self.rows = torch.cat(columns, 1) if len(columns) > 1 else columns[0]

    def unpack(self, rows):
        out, at = [], 0
        for dtype, wire_dtype, shape, width in self.layouts:
            # a fresh [T', width] block: a view's row stride stays the whole row's where T' is 0 or 1 (contiguous()
            # then keeps it), which view(dtype) refuses
            piece = rows.new_empty(rows.shape[0], width).copy_(rows[:, at: at + width])
            at += width
            if width == 0:
                piece = piece.new_empty(piece.shape, dtype=wire_dtype)
            elif wire_dtype.itemsize > 1:
                piece = piece.view(wire_dtype)
            piece = piece.reshape(rows.shape[0], *shape).movedim(0, self.dim)
            out.append(piece.bool() if dtype == torch.bool else piece)
        return tuple(out)


class CPContext:
    """A context-parallel process group and its bookkeeping.

    process_group: the torch.distributed process group of the CP ranks (gloo on CPU, nccl on GPUs).
    capture_move: how capture lets queries meet earlier ranks' K/V pages: "kv" (pages travel to the later
        ranks), "q" (queries travel to the page owners and (out, lse) partials come back) or "auto" (whichever
        moves fewer bytes for this prompt and model, by `cp_attention.capture_move_bytes`).
    """

    def __init__(self, process_group, capture_move: str = "auto"):
        if capture_move not in CAPTURE_MOVES:
            raise ValueError(f"capture_move must be one of {CAPTURE_MOVES}, got {capture_move!r}")
        if process_group is None:
            raise ValueError("CPContext needs an explicit process group")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.capture_move = capture_move
        self.traffic = Traffic()
        self.waited = defaultdict(float)  # phase -> seconds inside blocking exchanges
        self.held = defaultdict(int)  # what -> the most bytes a schedule step held at once (the planner's figures)
        self.decisions = {}  # (phase, layer) -> "kv" | "q": what capture moved, per attention layer
        self.phase_name = "idle"
        # How the prompt is laid out over the ranks (CP_LAYOUTS): set at the door of every transaction and generate
        # call (topology.build_topology, from the model's layer specs and the settings), the same on every
        # rank; the engine sets it before it counts a step's chunks.
        self.layout = "contiguous"

    @contextmanager
    def phase(self, name):
        saved, self.phase_name = self.phase_name, name
        try:
            yield
        finally:
            self.phase_name = saved

    @contextmanager
    def waiting(self):
        """Time a blocking exchange (one torch.distributed call) as this phase's waiting."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waited[self.phase_name] += time.perf_counter() - start

    def reset(self):
        """Start this rank's traffic counters, wait timers and capture decisions from zero."""
        self.traffic.reset()
        self.waited.clear()
        self.held.clear()
        self.decisions.clear()

    def note_held(self, what, nbytes):
        """Record that a step of the schedule holds `nbytes` of `what` at once (the largest is kept)."""
        self.held[what] = max(self.held[what], int(nbytes))

    def shards(self, length):
        """Contiguous shards [(lo, hi)] per rank (the "contiguous" layout's pieces)."""
        assert self.layout == "contiguous", "shards() is the contiguous layout's: use pieces()"
        return shard_bounds(length, self.size)

    def pieces(self, length):
        """Per rank, the token ranges it owns under this group's layout (shard_pieces), seen from this rank
        (PromptShards: its own pieces, sizes and local starts)."""
        return PromptShards(shard_pieces(length, self.size, self.layout), self.rank)

    # -- collectives (each counts what this rank receives) ---------------------------------------------------
    def all_gather(self, tensor, layer=-1, op="all_gather"):
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        with self.waiting():
            dist.all_gather(parts, tensor, group=self.process_group)
        self.traffic.add(self.phase_name, layer, op, (self.size - 1) * _nbytes(tensor))
        return parts

    def all_reduce_(self, tensor, layer=-1, op="all_reduce"):
        with self.waiting():
            dist.all_reduce(tensor, group=self.process_group)
        self.traffic.add(self.phase_name, layer, op, 2 * (self.size - 1) * _nbytes(tensor) // self.size)
        return tensor

    def reduce_scatter(self, tensor, layer=-1, op="reduce_scatter"):
        """The sum over ranks of `tensor` [size * n, ...], rank r getting rows [r n, (r + 1) n) of it ([n, ...])."""
        tensor = tensor.contiguous()
        out = tensor.new_empty(tensor.shape[0] // self.size, *tensor.shape[1:])
        with self.waiting():
            dist.reduce_scatter_tensor(out, tensor, group=self.process_group)
        self.traffic.add(self.phase_name, layer, op, (self.size - 1) * _nbytes(out))
        return out

    def gather_tokens(self, tensors, dim=0, layer=-1, op="gather_tokens"):
        """Every rank's `tensors` (each with this rank's own number of tokens along `dim`, the same on all of its
        tensors), concatenated in rank order; returns (tuple of gathered tensors, token counts by rank). The
        tensors travel together as one row of bytes per token (TokenBytes): one all_gather of the counts and one
        of the rows, however many tensors (a replayed block's exchange per layer was one collective per tensor)."""
        count = torch.tensor([tensors[0].shape[dim]], dtype=torch.int64)
        counts = [torch.zeros_like(count) for _ in range(self.size)]
        with self.waiting():
            dist.all_gather(counts, count, group=self.process_group)
        counts = [int(c) for c in counts]
        packed = TokenBytes(tensors, dim)
        rows = torch.nn.functional.pad(packed.rows, (0, 0, 0, max(counts) - counts[self.rank]))
        parts = self.all_gather(rows, layer, op)
        whole = torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])
        return packed.unpack(whole), counts

    def return_tokens(self, tensor, counts, dim=0, layer=-1, op="return_tokens"):
        """The inverse journey of gather_tokens: `tensor` holds every rank's tokens along `dim` (counts by rank, in
        rank order); rank r gets its own tokens' slice from every rank. Returns the slices by source rank."""
        return self.return_tokens_together((tensor,), counts, dim, layer, op)[0]

    def return_tokens_together(self, tensors, counts, dim=0, layer=-1, op="return_tokens"):
        """return_tokens of several tensors with the same tokens along `dim`, in one all_to_all (one row of bytes
        per token): per tensor, its slices by source rank."""
        packed = TokenBytes(tensors, dim)
        width = packed.rows.shape[1]
        mine = counts[self.rank] * width
        recv = torch.empty(self.size * mine, dtype=torch.uint8, device=packed.rows.device)
        with self.waiting():
            dist.all_to_all_single(recv, packed.rows.reshape(-1), [mine] * self.size, [n * width for n in counts],
                                   group=self.process_group)
        self.traffic.add(self.phase_name, layer, op, (self.size - 1) * mine)
        slices = [packed.unpack(piece.view(counts[self.rank], width)) for piece in recv.split(mine)]
        return [list(by_rank) for by_rank in zip(*slices, strict=True)]

    def send(self, tensor, dst):
        with self.waiting():
            dist.send(tensor.contiguous(), group=self.process_group, group_dst=dst)

    def recv(self, shape, dtype, src, layer=-1, op="recv", device=None):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        with self.waiting():
            dist.recv(buffer, group=self.process_group, group_src=src)
        self.traffic.add(self.phase_name, layer, op, _nbytes(buffer))
        return buffer

    def isend(self, tensor, dst):
        """A non-blocking send; returns its work handle (wait() before the tensor is reused)."""
        return dist.isend(tensor.contiguous(), group=self.process_group, group_dst=dst)

    def irecv(self, shape, dtype, src, layer=-1, op="recv", device=None):
        """A receive posted without blocking; returns a Landing whose wait() gives the buffer once it has landed."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        return Landing(buffer, dist.irecv(buffer, group=self.process_group, group_src=src), self,
                       lambda: self.traffic.add(self.phase_name, layer, op, _nbytes(buffer)))

    def barrier(self):
        with self.waiting():
            dist.barrier(group=self.process_group)

    def report(self) -> dict:
        """Plain-data summary of this rank's traffic (for GroupResult.extras): bytes received by phase, by
        phase and layer, by phase and op; capture_moves: phase -> attention layer -> "kv" | "q" | "ulysses"."""
        phases = sorted({p for (p, _, _) in self.traffic.received})
        return {"rank": self.rank, "size": self.size, "waited_seconds": dict(self.waited),
                "held_bytes": dict(self.held),
                "received_bytes": {p: self.traffic.total(p) for p in phases},
                "received_bytes_by_layer": {p: self.traffic.by_layer(p) for p in phases},
                "received_bytes_by_op": {p: self.traffic.by_op(p) for p in phases},
                "capture_moves": {p: {layer: move for (q, layer), move in sorted(self.decisions.items()) if q == p}
                                  for p in sorted({q for q, _ in self.decisions})}}


class Landing:
    """A posted receive: wait() blocks until its buffer has landed, counts its bytes, and returns the buffer."""

    def __init__(self, buffer, work, cp, count):
        self.buffer, self.work, self.cp, self.count = buffer, work, cp, count

    def wait(self):
        with self.cp.waiting():
            self.work.wait()
        self.count()
        return self.buffer


def as_cp_context(cp_group, cp_size: int):
    """Validate the (config cp_size, cp_group) pair at the door; returns a CPContext, or None for one rank."""
    if isinstance(cp_group, CPContext):
        context = cp_group
    elif cp_group is None:
        if cp_size > 1:
            raise ValueError(f"'longstraw.cp_size' = {cp_size} needs cp_group (the process group of the CP ranks)")
        return None
    else:
        if not dist.is_initialized():
            raise ValueError("cp_group was given but torch.distributed is not initialized")
        context = CPContext(cp_group)
    if context.size != cp_size:
        raise ValueError(f"'longstraw.cp_size' = {cp_size} but cp_group has {context.size} ranks")
    return context if context.size > 1 else None
