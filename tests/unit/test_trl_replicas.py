"""The replica sampler: under context parallelism a CP group's processes receive copies of one replica's batch."""

from trl.trainer.utils import RepeatSampler

from ds_longstraw.integrations.trl.replicas import replica_sampler


def _shard(indices, per_process, processes):
    """accelerate's round-robin of DataLoader batches: batch j to process j mod processes."""
    batches = [indices[i:i + per_process] for i in range(0, len(indices), per_process)]
    return [[b for j, b in enumerate(batches) if j % processes == p] for p in range(processes)]


def test_cp_groups_get_copies_and_replicas_get_what_trl_gives_their_processes():
    prompts, generations, per_process, cp_size, replicas = list(range(24)), 2, 4, 2, 2
    processes = cp_size * replicas
    trl_for_all = RepeatSampler(prompts, mini_repeat_count=generations,
                                batch_size=per_process * processes // generations, repeat_count=3, shuffle=True,
                                seed=7)
    ours = _shard(list(replica_sampler(trl_for_all, cp_size=cp_size, per_process=per_process)), per_process,
                  processes)
    trl_for_replicas = _shard(list(RepeatSampler(prompts, mini_repeat_count=generations,
                                                 batch_size=per_process * replicas // generations, repeat_count=3,
                                                 shuffle=True, seed=7)), per_process, replicas)
    for process in range(processes):
        assert ours[process] == trl_for_replicas[process // cp_size]
    assert ours[0] != ours[cp_size]  # two replicas, two different batches
    assert len(replica_sampler(trl_for_all, cp_size=cp_size, per_process=per_process)) == \
        cp_size * len(RepeatSampler(prompts, generations, per_process * replicas // generations, 3, True, 7))
