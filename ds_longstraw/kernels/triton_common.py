"""What the project's Triton kernels' host launchers share: tile widths and tl.dot's precision.

Importable without triton (the launchers that call these run only where triton is: kernels.dispatch)."""

import torch

try:
    import triton
except ImportError:
    triton = None


def pow2(n, least=16):
    """The tile width that covers n: a power of two, at least `least` (tl.dot's smallest tile is 16)."""
    return max(least, triton.next_power_of_2(int(n)))


def dot_precision(dtype):
    """tl.dot's input_precision: float32 inputs multiply in full precision (tests compare them to float64);
    bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
