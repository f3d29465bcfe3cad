"""The job's parallelism: its dimensions and this rank's place in them, built once and asked by every caller.
("Layout" in this package means one thing only: how a prompt is sharded over a CP group, the "cp_layout" setting.)

Ranks are laid out with context parallelism innermost: consecutive ranks [k N, (k+1) N) form context-parallel
group k, which is data-parallel replica k (N = cp_size; every rank of a CP group holds the same group of the
batch). Expert parallelism over E ranks groups consecutive ranks [j E, (j+1) E) the same way, and is the CP group
itself under context parallelism; the ranks holding the same expert slice (r mod E alike) form its expert-data-
parallel group. `build_parallelism` makes every group (torch.distributed.new_group is collective: every rank
calls it alike); the engine keeps the result at engine.longstraw_parallelism, and the launcher and the rollout
step read a replica's index from it instead of working it out again.
"""

from dataclasses import dataclass

import torch.distributed as dist

from ds_longstraw.parallel.groups import CPContext


@dataclass(frozen=True)
class Parallelism:
    """world ranks, this rank; cp_size ranks per context-parallel group (cp: this rank's CPContext, None when
    cp_size is 1); ep_size ranks per expert-parallel group (ep_group, expert_dp_group: this rank's, None when
    ep_size is 1)."""

    world: int
    rank: int
    cp_size: int = 1
    ep_size: int = 1
    cp: CPContext | None = None
    ep_group: object = None
    expert_dp_group: object = None

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica: the index of its CP group."""
        return self.rank // self.cp_size

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas (CP groups) the job has."""
        return self.world // self.cp_size

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's CP process group, or None without context parallelism."""
        return None if self.cp is None else self.cp.process_group


def check_sizes(world: int, cp_size: int, ep_size: int) -> None:
    """ValueError naming the key when a size does not divide the world (before any group is made)."""
    for key, size in (("cp_size", cp_size), ("ep_size", ep_size)):
        if size < 1 or world % size:
            raise ValueError(f"'longstraw.{key}' = {size} does not divide the world size {world}")


def build_parallelism(cp_size: int = 1, ep_size: int = 1) -> Parallelism:
    """This rank's Parallelism over the initialised default process group (module docstring)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_sizes(world, cp_size, ep_size)
    cp = None
    if cp_size > 1:
        for start in range(0, world, cp_size):
            group = dist.new_group(list(range(start, start + cp_size)))
            if start <= rank < start + cp_size:
                cp = CPContext(group)
    ep_group = expert_dp = None
    if ep_size > 1:
        ep_group = None if cp is None else cp.process_group
        for start in range(0, world, ep_size):
            group = dist.new_group(list(range(start, start + ep_size)))
            if cp is None and start <= rank < start + ep_size:
                ep_group = group
        for offset in range(ep_size):
            group = dist.new_group(list(range(offset, world, ep_size)))
            if rank % ep_size == offset:
                expert_dp = group
    return Parallelism(world, rank, cp_size, ep_size, cp, ep_group, expert_dp)
