"""Decoding in lockstep: rollouts on ranks that must make the same module calls, whatever each one samples.

Under ZeRO-3 every submodule call all-gathers its weights over the data-parallel ranks, and with sharded experts
every MoE call dispatches over the expert-parallel ranks: both are collectives, so ranks decoding different
prompts must call the same submodules the same number of times. Three things differ between ranks while they
decode: how many prompts each brings, each prompt's length (its capture chunks), and when each rank's samples stop
(eos). A DecodeLockstep pads all three with calls whose results are thrown away:

    prompt slots   the ranks agree on the most prompts any has; a rank short of prompts decodes idle slots: the
                   dummy prompt IDLE_PROMPT captured and stepped like a real one, nothing sampled or kept;
    capture        per slot, the most capture chunks any rank's prompt needs (lockstep.capture_chunks); a rank pads
                   its capture with one-token no-grad forwards (lockstep.Lockstep.pad_capture);
    decode steps   every step each rank makes one forward (its running samples', or a ghost's), then the ranks
                   all-reduce whether any sample still runs anywhere; a rank whose samples have all stopped keeps
                   stepping the ghost (one dummy token decoded from the prompt's state, through the same forward and
                   head) until none runs or max_new_tokens is reached. One-at-a-time decoding (generate's plain
                   reference) walks the most samples any rank has, the extra ones ghosts.
    observations   with an environment (rollout/environment.py) a step's samples that drew a stop id have their
                   observations captured, in segment forwards of capture_chunk tokens; the same all-reduce carries
                   each rank's count of those forwards, and a rank short of the most pads with one-token ghost
                   segment forwards (no head).

What a rank samples is what it would sample alone: padding feeds no real sample's inputs, and every sample draws
from its own generator. Cost: one two-element all-reduce per decode step, and ghost forwards on ranks whose samples
stopped early (they would wait for the slowest rank anyway). Not needed without ZeRO-3 and sharded experts, nor
with one rank.
"""

import torch
import torch.distributed as dist

from ds_longstraw.grpo.lockstep import PAD_TOKEN, GroupCalls, Lockstep, capture_chunks

# An idle slot's prompt: two ids, as lockstep.dummy_group's (one captured, one fed to the first decode step).
IDLE_PROMPT = torch.full((2,), PAD_TOKEN, dtype=torch.long)


class DecodeLockstep(Lockstep):
    """One prompt slot of a rank's rollouts, padded to what every rank of `group` runs (module docstring).
    local_chunks / common_chunks: this rank's and the ranks' largest capture chunks; common_samples: the most samples
    any rank decodes in this slot; idle: the slot has no prompt on this rank (generate decodes IDLE_PROMPT, keeps
    nothing)."""

    def __init__(self, local_chunks, common_chunks, common_samples, longstraw, group, idle=False):
        super().__init__(GroupCalls(local_chunks, ()), GroupCalls(common_chunks, ()), longstraw)
        self.common_samples, self.process_group, self.idle = common_samples, group, idle

    @property
    def capture_padded_to(self) -> int:
        """The capture chunks every rank's capture of this slot calls: a kept capture made under this lockstep
        stands for a training capture padded to the same count (rollout.KeptCapture.check)."""
        return self.common.chunks

    def sample_slots(self, num_samples) -> int:
        return self.common_samples

    def next_step(self, running, captures, device) -> tuple[bool, int]:
        flags = torch.tensor([1 if running else 0, captures], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(flags[0].item()), int(flags[1].item())


def decode_locksteps(prompts, num_samples, longstraw, cp, process_group) -> list:
    """This rank's DecodeLockstep per prompt slot (the most prompts any rank of `process_group` brings): its own
    prompt's, then idle slots (collective over `process_group`: one all-gather of every rank's slot sizes). prompts:
    this rank's 1-D id tensors; settings: the config the prompts are captured under; cp: this rank's CPContext or
    None."""
    mine = [(capture_chunks(p.numel(), longstraw, cp), num_samples) for p in prompts]
    # an idle slot's chunks depend on the rank's CP shard of IDLE_PROMPT: every rank sends its own
    idle_chunks = capture_chunks(IDLE_PROMPT.numel(), longstraw, cp)
    gathered = [None] * dist.get_world_size(group=process_group)
    dist.all_gather_object(gathered, (mine, idle_chunks), group=process_group)
    slots = max(len(theirs) for theirs, _ in gathered)
    out = []
    for slot in range(slots):
        present = [theirs[slot] for theirs, _ in gathered if slot < len(theirs)]
        idle = [chunks for theirs, chunks in gathered if slot >= len(theirs)]  # the ranks idle in this slot
        common_chunks = max([chunks for chunks, _ in present] + idle)
        common_samples = max(samples for _, samples in present)
        local_chunks = mine[slot][0] if slot < len(mine) else idle_chunks
        out.append(DecodeLockstep(local_chunks, common_chunks, common_samples, longstraw, process_group,
                                  idle=slot >= len(mine)))
    return out
