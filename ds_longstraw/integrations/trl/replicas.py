"""TRL's sampler under context parallelism: a CP group's processes receive copies of one replica's batch.

accelerate hands a DataLoader's batches (of per_device_train_batch_size x steps_per_generation indices) to the
processes in turn: batch j to process j mod P. With P = D x N processes in D CP groups of N consecutive ranks, the
replica sampler draws D batches per generation from TRL's RepeatSampler (built for D processes) and yields each N
times in a row, so that processes k N .. k N + N - 1 all receive replica k's batch. TRL then gathers every process's
rewards (each group N times, which leaves each group's mean and std as they are: its rows sit together), and its
num_items_in_batch counts every copy, which the dapo normaliser's process count (N times D) cancels (scopes.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler


class ReplicaSampler(Sampler):
    """Each run of `per_process` indices of `inner`, `copies` times in a row."""

    def __init__(self, inner: Any, per_process: int, copies: int) -> None:
        self.inner, self.per_process, self.copies = inner, per_process, copies

    def __iter__(self) -> Iterator[int]:
        batch = []
        for index in self.inner:
            batch.append(index)
            if len(batch) == self.per_process:
                for _ in range(self.copies):
                    yield from batch
                batch = []
        for _ in range(self.copies if batch else 0):
            yield from batch

    def __len__(self) -> int:
        return len(self.inner) * self.copies


def replica_sampler(sampler: Any, *, cp_size: int, per_process: int) -> ReplicaSampler:
    """TRL's RepeatSampler `sampler` rebuilt for the data-parallel replicas (its generation batch over cp_size),
    each replica's batch copied to its CP group's cp_size processes."""
    from trl.trainer.utils import RepeatSampler

    inner = RepeatSampler(data_source=sampler.data_source, mini_repeat_count=sampler.mini_repeat_count,
                          batch_size=sampler.batch_size // cp_size, repeat_count=sampler.repeat_count,
                          shuffle=sampler.shuffle, seed=sampler.seed)
    return ReplicaSampler(inner, per_process, cp_size)
