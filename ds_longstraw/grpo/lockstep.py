"""Lockstep: the same module calls on every data-parallel rank, whatever group each rank brings.

Under ZeRO-3 every call of a submodule all-gathers its partitioned weights (forward) and every backward through
it gathers them again: these are collectives over the data-parallel ranks, so every rank must call the same
submodules in the same order. A transaction's calls depend on its group only through how many it makes of
each kind (its *calls*):

    capture chunks c = ceil((len(prompt) - 1) / segment)   (segment: capture_chunk, capped by prefix_block in
                                                            exact mode; also the reference capture, and exact
                                                            mode's prefix pass: one forward + backward per chunk)
    members G, and per member replay blocks b_m = ceil(len(response_m) / replay_block), and whether the member
    runs in steps (member_steps.py: a long tool span)

(one `forward_segment` walks every layer whatever its token count). Ranks agree on the common calls (the
element-wise maximum; `common_calls`) and each pads its own transaction up to it with dummy work of the same
structure, whose results are thrown away and whose gradients are exactly zero:

  - capture: extra no-grad forwards of one token (outputs discarded);
  - replay: a member with fewer blocks is extended past its end with dummy tokens. Causality keeps the real
    tokens' log-probs unchanged, and the dummy log-probs are sliced off before the loss, so their backward
    carries zeros; the graph has the structure of a longer response, so the backward gathers match too;
  - members: dummy members (dummy tokens from the real captured state, loss 0 * sum(log p)) with the common
    block counts, backward like a real member;
  - members in steps: where any rank's member of a slot runs in steps, every rank runs that slot in steps of one
    replay block each over the padded length, every step scored (the same calls: a forward without a graph of
    each block, then each block's forward and backward, last first); the gradient is unchanged (a member's steps
    are its own function differentiated in pieces, whatever the cut). Where some rank's member of the slot holds a
    prefix (GRPOGroup.held_prefixes), every rank also cuts its steps where that prefix ends, and a rank's steps
    inside its own held prefix run their backward with zero gradient;
  - prefix (exact): extra one-token forwards with the same outputs as a chunk and a zero surrogate backward.
Under context parallelism the layer-major capture and prefix pass call each submodule once per chunk of the rank's
shard, layer by layer: every such loop walks `Schedule.chunks(spans)` (ShardChunks), this rank's real chunks and
then the dummy ones (one zero token each) that bring it to the common chunk count. The prefix pass in turns makes,
on every rank, the iterations of `Schedule.prefix_turn` (TurnIterations) in each segment's turn: its owner's real
chunks (mirrored by zero iterations on the other ranks), then dummy ones up to the most chunks that segment has on
any replica.
A rank with fewer groups (grpo_step with lists) runs dummy groups (`dummy_group`) whose loss is scaled by zero.

The padding costs compute (one-token segments) and the weight gathers the other ranks do anyway: ranks would
wait for the slowest one regardless. Not needed (and not used) without ZeRO-3 or with one data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_longstraw.grpo.member_steps import Step, member_steps
from ds_longstraw.grpo.prefix_pass import segment_roots

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from torch.distributed import ProcessGroup

    from ds_longstraw.arch.base import CausalLMAdapter
    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.group import GRPOGroup
    from ds_longstraw.grpo.interfaces import RemoteAttention, RemoteSelection
    from ds_longstraw.parallel.groups import CPContext

PAD_TOKEN = 0


def ceil_div(a: int, b: int) -> int:
    """Pieces of at most b that a items make (a segment count, a block count)."""
    return -(-a // b)


@dataclass(frozen=True)
class GroupCalls:
    chunks: int  # capture chunks
    blocks: tuple  # replay blocks per member
    segments: tuple = ()  # context parallelism: the capture chunks of each CP segment, in prompt order
    stepped: tuple = ()  # per member slot: 1 where the member runs in steps (member_steps.py), else 0 (or absent)
    # per member slot: the held prefixes' lengths (GRPOGroup.held_prefixes) that end a step, sorted (common calls:
    # every rank's); () where no member holds one
    held: tuple = ()

    def encode(self) -> list:
        held = [value for cuts in self.held for value in (len(cuts), *cuts)]
        return [self.chunks, len(self.blocks), *self.blocks, len(self.segments), *self.segments,
                len(self.stepped), *self.stepped, len(self.held), *held]

    @staticmethod
    def decode(code: Sequence[int]) -> GroupCalls:
        values = iter(code[1:])

        def counted() -> tuple:  # a count, then that many values (an absent count: none)
            return tuple(next(values) for _ in range(next(values, 0)))

        blocks, segments, stepped = counted(), counted(), counted()
        return GroupCalls(code[0], blocks, segments, stepped, tuple(counted() for _ in range(next(values, 0))))

    def held_cuts(self, slot: int) -> tuple:
        return self.held[slot] if slot < len(self.held) else ()

    def in_steps(self, slot: int) -> bool:
        return slot < len(self.stepped) and bool(self.stepped[slot])


def replayed_members(group: GRPOGroup, longstraw: LongstrawConfig, cp: CPContext | None = None) -> list:
    """The members this rank replays: all of them, or (context parallelism, "cp_replay" other than "replicated":
    spread, gathered or either by "auto") its share."""
    if cp is not None and longstraw.cp_replay != "replicated":
        return list(range(cp.rank, group.size, cp.size))
    return list(range(group.size))


def capture_chunks(prompt_length: int, longstraw: LongstrawConfig, cp: CPContext | None = None) -> int:
    """The capture chunks of a prompt of `prompt_length` ids (its last id is not captured: replay or decoding feeds
    it). cp: None, or this rank's parallel.CPContext: then the chunks of this rank's shard of the prompt
    (context-parallel capture calls the submodules once per chunk of its own shard, see grpo/cp/capture.py)."""
    tokens = prompt_length - 1
    if cp is None:
        return ceil_div(tokens, longstraw.segment_tokens)
    # chunks never straddle two of a rank's pieces (parallel/groups.local_spans)
    return sum(ceil_div(hi - lo, longstraw.segment_tokens) for lo, hi in cp.pieces(tokens).mine)


def segment_chunks(prompt_length: int, longstraw: LongstrawConfig, cp: CPContext) -> tuple:
    """The capture chunks of every CP segment (each rank's pieces, parallel/groups.shard_pieces) in prompt order:
    the prefix iterations of each turn of exact mode's pass (grpo/cp/prefix_turns.py)."""
    return tuple(ceil_div(hi - lo, longstraw.segment_tokens)
                 for _, _, lo, hi in cp.pieces(prompt_length - 1).order)


def calls_of(group: GRPOGroup, longstraw: LongstrawConfig, cp: CPContext | None = None) -> GroupCalls:
    """cp: None, or this rank's parallel.CPContext: the chunks of this rank's shard (capture_chunks) and of every CP
    segment, and the blocks those of the members it replays (replayed_members), in order: member slots."""
    members = replayed_members(group, longstraw, cp)
    stepped = tuple(int(member_steps(group.mask(m), longstraw.member_span_capture, longstraw.replay_block,
                                     group.held(m)) is not None)
                    for m in members)
    held = tuple((group.held(m),) if group.held(m) else () for m in members)
    return GroupCalls(chunks=capture_chunks(group.prompt_ids.numel(), longstraw, cp),
                      blocks=tuple(ceil_div(group.response_ids[m].numel(), longstraw.replay_block) for m in members),
                      segments=() if cp is None else segment_chunks(group.prompt_ids.numel(), longstraw, cp),
                      stepped=stepped if any(stepped) else (),  # () where no member runs in steps
                      held=held if any(held) else ())


def most_calls(counts: Sequence[GroupCalls]) -> GroupCalls:
    """The element-wise maximum of groups' calls (missing members count as 0 blocks)."""
    members = max(len(s.blocks) for s in counts)
    return GroupCalls(chunks=max(s.chunks for s in counts),
                      blocks=tuple(max(s.blocks[m] if m < len(s.blocks) else 0 for s in counts)
                                   for m in range(members)),
                      segments=tuple(max(column) for column in zip(*(s.segments for s in counts), strict=True)),
                      stepped=tuple(int(any(s.in_steps(m) for s in counts)) for m in range(members))
                      if any(s.stepped for s in counts) else (),
                      held=tuple(tuple(sorted({c for s in counts for c in s.held_cuts(m)})) for m in range(members))
                      if any(s.held for s in counts) else ())


def common_calls(local_calls: Sequence[GroupCalls], process_group: ProcessGroup | None = None) -> list:
    """All-gather every rank's list of groups' calls over `process_group` (the data-parallel ranks) and return,
    per group slot, the common calls (slots: the most groups any rank has)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size(group=process_group)
    dist.all_gather_object(gathered, [s.encode() for s in local_calls], group=process_group)
    slots = max(len(ranks_calls) for ranks_calls in gathered)
    out = []
    for slot in range(slots):
        counts = [GroupCalls.decode(code) for ranks_calls in gathered
                  if slot < len(ranks_calls) for code in [ranks_calls[slot]]]
        out.append(most_calls(counts))
    return out


def padded_to_common(group: GRPOGroup, longstraw: LongstrawConfig, cp: CPContext | None,
                     process_group: ProcessGroup | None, kind: type[Lockstep] | None = None) -> Lockstep:
    """A Lockstep (or `kind`) padding this rank's transaction of `group` to the common calls of the ranks of
    `process_group` (collective over them); cp: this rank's CPContext or None (calls_of)."""
    local = calls_of(group, longstraw, cp)
    return (kind or Lockstep)(local, common_calls([local], process_group)[0], longstraw)


def dummy_group() -> GRPOGroup:
    """A group of minimal size to stand in for a missing group slot (its Lockstep pads it to the slot's calls;
    the engine scales its loss by zero). It carries every per-token input an objective option reads (sampler
    log-probs), so that it runs whatever path the real groups run and no option refuses it on one rank only."""
    from ds_longstraw.group import GRPOGroup

    return GRPOGroup(prompt_ids=torch.full((2,), PAD_TOKEN), response_ids=[torch.full((1,), PAD_TOKEN)],
                     advantages=[0.0], sampling_logprobs=[torch.zeros(1, dtype=torch.float64)])


@dataclass(frozen=True)
class Chunk:
    """One turn of a per-chunk loop of the layer-major CP schedule: a chunk of this rank's shard (local tokens
    [a, b), prompt position `position` at a), or a lockstep dummy (one zero token at position 0: the module calls
    of a chunk, its results discarded)."""

    a: int
    b: int
    position: int
    dummy: bool = False

    def of(self, x_1TC: torch.Tensor) -> torch.Tensor:
        """The chunk's tokens of a [1, T, C] tensor over the shard (a dummy's: one zero token)."""
        return x_1TC.new_zeros(1, 1, x_1TC.shape[-1]) if self.dummy else x_1TC[:, self.a:self.b]


DUMMY_CHUNK = Chunk(0, 1, 0, dummy=True)


class ShardChunks:
    """This rank's chunks of its shard as the per-chunk loops of the layer-major CP schedule walk them (grpo/cp/
    capture.py, prefix_layers.py and a family's scan layers): iterating gives the real ones (`spans`: [(a, b, prompt
    position of a)], local order, groups.local_spans), then the schedule's dummy ones (`dummies()`: under ZeRO-3 as
    many as the most chunks any rank has exceed this rank's, so that every rank calls the same submodules in the
    same order, with the CP exchanges at the same places in between; none otherwise)."""

    def __init__(self, spans: Iterable[tuple[int, int, int]], pad: int = 0) -> None:
        self.spans, self._pad = list(spans), pad

    def __iter__(self) -> Iterator[Chunk]:
        for a, b, position in self.spans:
            yield Chunk(a, b, position)
        yield from self.dummies()

    def dummies(self) -> Iterator[Chunk]:
        """The dummy chunks after the real ones."""
        for _ in range(self._pad):
            yield DUMMY_CHUNK

    @property
    def padded(self) -> bool:
        """Whether the schedule adds any dummy chunk (some rank calls more than this one)."""
        return self._pad > 0


@dataclass(frozen=True)
class TurnIterations:
    """One turn of exact mode's CP prefix pass in turns (grpo/cp/prefix_turns.py) as the lockstep runs it: every rank
    makes the same prefix iterations, the owner's `real` chunks (the owner runs them; every other rank mirrors each
    with a zero iteration, which answers the owner's requests where that rank serves it), then the schedule's dummy
    ones (`dummies()`: a zero iteration on every rank) up to the most chunks that segment has on any replica."""

    real: int
    pad: int = 0

    def dummies(self) -> Iterator[None]:
        """The dummy iterations after the real ones."""
        for _ in range(self.pad):
            yield None


class Schedule:
    """The transaction's schedule as this rank runs it: the plain one, with no padding (one data-parallel rank, or
    no ZeRO-3). `Lockstep` wraps the same points with padding; the transaction and the topologies call these points
    whichever they were given, and never ask which."""

    capture_pad = 0  # extra capture chunks of dummy calls
    idle = False  # decoding: a prompt slot this rank has no prompt for (decode_lockstep.py)
    capture_padded_to = None  # decoding: the chunks every rank's capture of the slot calls (None: not padded)
    pads_calls = False  # whether this schedule pads module calls to other ranks' (a Lockstep does)

    def chunks(self, spans: Iterable[tuple[int, int, int]]) -> ShardChunks:
        """A context-parallel rank's chunks of its shard (spans), padded with capture_pad dummy ones."""
        return ShardChunks(spans, self.capture_pad)

    def prefix_turn(self, segment: int, real: int) -> TurnIterations | None:
        """The turn of CP segment `segment` (prompt order, groups.segments_in_order) in exact mode's prefix pass in
        turns, whose owner has `real` chunks: None, the ranks do not mirror each other's turns (only the owner and
        the ranks whose pages it reads take part)."""
        return None

    def pad_capture(self, adapter: CausalLMAdapter, last_layer_whole: bool = True) -> None:
        """After a one-rank capture: the extra chunks' calls (the last layer run as the capture ran it,
        PrefixState.last_layer_whole)."""

    def pad_prefix(self, adapter: CausalLMAdapter, backward: Callable[[torch.Tensor], object] | None = None,
                   last_layer_whole: bool = True) -> None:
        """After a one-rank prefix pass: the extra iterations (the last layer as the pass ran it)."""

    def pad_member(self, member: int, inputs: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs, targets

    def member_steps(self, member: int, mask: torch.Tensor, span_capture: int | None,
                     block: int, held: int = 0) -> list[Step] | None:
        """The steps a member (slot `member`, training mask `mask`, `held` leading tokens held) runs in, or None
        (replayed whole): its own (member_steps.py) without padding."""
        return member_steps(mask, span_capture, block, held)

    def replay_dummy_members(self, replay: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             backward: Callable[[torch.Tensor], object] | None = None, train: bool = True,
                             in_steps: Callable[[list[Step], torch.Tensor, torch.Tensor], object] | None = None
                             ) -> None:
        """After the group's members: the members other ranks have and this one lacks (replay(inputs, targets):
        a member's log-probs, replay.MemberReplay; in_steps(steps, inputs, targets): a dummy member of a slot
        that runs in steps, whose loss is 0)."""

    # -- decoding (rollout.generate; decode_lockstep.DecodeLockstep pads it) --------------------------------------
    def sample_slots(self, num_samples: int) -> int:
        """How many samples a one-at-a-time decode walks: this rank's own."""
        return num_samples

    def next_step(self, running: bool, captures: int, device: torch.device) -> tuple[bool, int]:
        """After a decode step: (whether to take another, how many observation forwards to make before it), given
        whether this rank still has a sample running and how many observations it captures now
        (rollout/environment.py)."""
        return running, captures


class Lockstep(Schedule):
    """How one rank pads one group's transaction up to the common calls (see the module docstring)."""

    pads_calls = True

    def __init__(self, local: GroupCalls, common: GroupCalls, longstraw: LongstrawConfig) -> None:
        if local.chunks > common.chunks or len(local.blocks) > len(common.blocks) or any(
                b > c for b, c in zip(local.blocks, common.blocks, strict=False)):  # fewer members than common
            raise ValueError(f"lockstep: local calls {local} exceeds the common calls {common}")
        self.local, self.common, self.longstraw = local, common, longstraw

    @property
    def capture_pad(self) -> int:
        return self.common.chunks - self.local.chunks

    def prefix_turn(self, segment: int, real: int) -> TurnIterations:
        """Every rank makes the turn's iterations: the owner's `real` chunks, then dummy ones up to the most chunks
        the segment has on any replica (GroupCalls.segments)."""
        return TurnIterations(real, self.common.segments[segment] - real)

    # -- capture and prefix ------------------------------------------------------------------------------
    def pad_capture(self, adapter: CausalLMAdapter, last_layer_whole: bool = True) -> None:
        """Extra no-grad forwards (the reference capture, the policy capture), the last layer run as the real
        chunks ran it."""
        ids = torch.full((1,), PAD_TOKEN, dtype=torch.long)
        with torch.no_grad():
            for _ in range(self.capture_pad):
                adapter.forward_segment(ids, 0, {}, {}, need_hidden=last_layer_whole)

    def pad_prefix(self, adapter: CausalLMAdapter, backward: Callable[[torch.Tensor], object] | None = None,
                   last_layer_whole: bool = True) -> None:
        """Extra prefix-pass iterations (see zero_prefix_iteration), recomputed and their last layer run as the
        real segments' are."""
        for _ in range(self.capture_pad):
            zero_prefix_iteration(adapter, backward, prefix_recompute=self.longstraw.prefix_recompute_runs,
                                  need_hidden=last_layer_whole)

    # -- replay ------------------------------------------------------------------------------------------
    def _padded_length(self, member: int, length: int) -> int:
        """At least the slot's common blocks, and past every rank's held prefix of the slot (each a step's end)."""
        blocks = self.common.blocks[member]
        return max(length, (blocks - 1) * self.longstraw.replay_block + 1,
                   *(cut + 1 for cut in self.common.held_cuts(member)))

    def pad_member(self, member: int, inputs: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend a member's replay inputs/targets past its end so it has the common number of blocks; the
        caller slices the log-probs back to the real length."""
        extra = self._padded_length(member, inputs.numel()) - inputs.numel()
        if extra == 0:
            return inputs, targets
        pad = torch.full((extra,), PAD_TOKEN, dtype=inputs.dtype, device=inputs.device)
        return torch.cat([inputs, pad]), torch.cat([targets, pad.to(targets.device)])

    def member_steps(self, member: int, mask: torch.Tensor, span_capture: int | None,
                     block: int, held: int = 0) -> list[Step] | None:
        """Where any rank's member of this slot runs in steps, this rank's member does too: one replay block a
        step over its padded length (pad_member), also cut where any rank's held prefix of the slot ends, every
        step scored, so that every rank makes the same calls (this rank's steps inside its own `held` tokens are
        held); elsewhere None (replayed whole, the blocks padded)."""
        if not self.common.in_steps(member):
            return None
        # the same cuts inside every rank's padded length: the common blocks' starts and every rank's held ends
        cuts = sorted({*range(0, self.common.blocks[member] * block, block), *self.common.held_cuts(member)})
        length = self._padded_length(member, mask.numel())
        if held and held not in cuts:
            raise ValueError(f"lockstep: member slot {member}'s held prefix {held} is not among the common cuts {cuts}")
        return [Step(a, b, True, held=b <= held) for a, b in zip(cuts, [*cuts[1:], length], strict=True)]

    def dummy_members(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(member slot, inputs, targets) of the members this rank lacks."""
        for member in range(len(self.local.blocks), len(self.common.blocks)):
            length = self._padded_length(member, 1)
            ids = torch.full((length,), PAD_TOKEN, dtype=torch.long)
            yield member, ids, ids

    def replay_dummy_members(self, replay: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             backward: Callable[[torch.Tensor], object] | None = None, train: bool = True,
                             in_steps: Callable[[list[Step], torch.Tensor, torch.Tensor], object] | None = None
                             ) -> None:
        """Replay the dummy members (replay(inputs, targets): replay.MemberReplay) and, with grad, back-propagate
        0 * sum(log p) like a member's loss share; a slot that runs in steps through in_steps(steps, inputs,
        targets)."""
        for member, inputs, targets in self.dummy_members():
            if train and in_steps is not None and self.common.in_steps(member):
                in_steps(self.member_steps(member, targets, None, self.longstraw.replay_block), inputs, targets)
                continue
            with torch.enable_grad() if train else torch.no_grad():
                logp = replay(inputs, targets)
                if train and logp.requires_grad:
                    zero = logp.sum() * 0.0
                    zero.backward() if backward is None else backward(zero)
            del logp


class ReplayLockstep(Lockstep):
    """Padding of the replay only (member slots and blocks), for ranks whose replays exchange with each other but
    whose capture and prefix pass already pair up (a spread CP replay without ZeRO-3)."""

    capture_pad = 0

    def prefix_turn(self, segment: int, real: int) -> None:
        return None

    def pad_capture(self, adapter: CausalLMAdapter, last_layer_whole: bool = True) -> None:
        pass

    def pad_prefix(self, adapter: CausalLMAdapter, backward: Callable[[torch.Tensor], object] | None = None,
                   last_layer_whole: bool = True) -> None:
        pass


def zero_prefix_iteration(adapter: CausalLMAdapter, backward: Callable[[torch.Tensor], object] | None = None,
                          remote_attention: RemoteAttention | RemoteSelection | None = None,
                          prefix_recompute: bool = False, need_hidden: bool = True) -> None:
    """One prefix-pass iteration of zero gradient: a one-token forward with grad whose chunk outputs (every layer's
    end carry and rows, prefix_pass.segment_roots) are the roots of a zero surrogate, back-propagated like a real
    chunk's. remote_attention: as forward_segment's (a context-parallel rank mirroring another rank's chunk serves
    its requests through it);
    prefix_recompute: each layer recomputed in backward, as the real segments are (longstraw.prefix_recompute_runs);
    need_hidden: False where the real segments run only the last layer's rows (PrefixState.last_layer_whole)."""
    ids = torch.full((1,), PAD_TOKEN, dtype=torch.long)
    with torch.enable_grad():
        out = adapter.forward_segment(ids, 0, {}, {}, remote_attention, prefix_recompute=prefix_recompute,
                                      need_hidden=need_hidden)
        live = [o for o in segment_roots(adapter.specs, out) if o.requires_grad]
        if live:
            surrogate = sum((o * 0.0).sum() for o in live)
            surrogate.backward() if backward is None else backward(surrogate)
