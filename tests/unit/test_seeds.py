"""The seed mixer against SplitMix64's published outputs, and the two rollout seeds built from it.

splitmix64(state) is SplitMix64's next() from `state`: the reference generator (Vigna's splitmix64.c, seeded 0)
advances its state by the golden-ratio constant before mixing, so its k-th output is splitmix64((k - 1) * golden).
A change here changes every rollout's samples, hence the pinned values.
"""

import pytest

from ds_longstraw.rollout.generate import _generator
from ds_longstraw.rollout.step import sample_seed
from ds_longstraw.seeds import MASK64, splitmix64

GOLDEN = 0x9E3779B97F4A7C15
# The first outputs of splitmix64.c seeded 0
REFERENCE = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@pytest.mark.parametrize("k", range(len(REFERENCE)), ids=lambda k: f"output{k}")
def test_splitmix64_matches_the_reference(k):
    assert splitmix64((k * GOLDEN) & MASK64) == REFERENCE[k]


def test_inputs_wrap_modulo_2_64():
    assert splitmix64(-1) == splitmix64(MASK64) and splitmix64(1 << 64) == splitmix64(0)
    assert all(0 <= splitmix64(v) <= MASK64 for v in (0, 1, MASK64, 12345678901234567890))


def test_rollout_seeds_use_the_one_mixer():
    """rollout_step.sample_seed and rollout's per-sample generator both chain this mixer."""
    assert sample_seed(7, 3, 5) == splitmix64(splitmix64(splitmix64(7) ^ 3) ^ 5) & ((1 << 62) - 1)
    assert _generator(7, 2).initial_seed() == splitmix64(splitmix64(7) ^ 2) >> 1
