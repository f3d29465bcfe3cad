"""The one seed mixer: SplitMix64's finaliser (Steele, Lea and Flood, 2014), as java.util.SplittableRandom has it.

Rollouts derive every seed from a run's seed and an index (a step, a prompt, a sample) by chaining this function
over the parts XORed in: neighbouring inputs give unrelated outputs, so seeds s and s + 1 share no stream. It mixes;
it is not a generator (torch.Generator draws the numbers) and not a cryptographic hash.
"""

MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """SplitMix64 of a Python int, taken modulo 2**64: an int in [0, 2**64)."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)
