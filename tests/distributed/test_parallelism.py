"""parallel/parallelism.py: the job's groups as every caller reads them, on 4 real gloo ranks.

Consecutive ranks form CP groups (replica = rank // cp_size); expert parallelism groups consecutive ranks alike and
is the CP group under CP; the ranks holding the same expert slice (rank mod ep_size) form its expert-data-parallel
group. Sizes that do not divide the world are refused before any group is made, naming the key.
"""

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_scripts.launching import free_port

from ds_longstraw.parallel.parallelism import Parallelism, build_parallelism, check_sizes

WORLD = 4
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1)]  # (cp_size, ep_size)


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    seen = []
    for cp_size, ep_size in LAYOUTS:  # every rank builds every layout alike (new_group is collective)
        parallelism = build_parallelism(cp_size, ep_size)
        seen.append((parallelism.replica, parallelism.replicas, _ranks(parallelism.cp_group),
                     _ranks(parallelism.ep_group), _ranks(parallelism.expert_dp_group)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(seen, handle)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("layout"))
    context = mp.get_context("fork")
    port = free_port()
    procs = [context.Process(target=_worker, args=(rank, port, out)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0] * WORLD
    results = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"rank{rank}.json")) as handle:
            results.append(json.load(handle))
    return results


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"cp{c}-ep{e}" for c, e in LAYOUTS])
def test_groups_follow_the_rank_order(layouts, index):
    cp_size, ep_size = LAYOUTS[index]
    for rank in range(WORLD):
        replica, replicas, cp, ep, expert_dp = layouts[rank][index]
        first = rank - rank % cp_size
        assert (replica, replicas) == (rank // cp_size, WORLD // cp_size)
        assert cp == (list(range(first, first + cp_size)) if cp_size > 1 else None)
        if ep_size == 1:
            assert ep is None and expert_dp is None
            continue
        start = rank - rank % ep_size
        assert ep == (cp if cp_size > 1 else list(range(start, start + ep_size)))
        assert expert_dp == list(range(rank % ep_size, WORLD, ep_size))


def test_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ValueError, match="'longstraw.cp_size' = 3 does not divide the world size 4"):
        check_sizes(4, 3, 1)
    with pytest.raises(ValueError, match="'longstraw.ep_size' = 3 does not divide the world size 8"):
        check_sizes(8, 2, 3)


def test_one_rank_layout_without_groups():
    parallelism = Parallelism(world=8, rank=5, cp_size=2)
    assert (parallelism.replica, parallelism.replicas, parallelism.cp_group) == (2, 4, None)
