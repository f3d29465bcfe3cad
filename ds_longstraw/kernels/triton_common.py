"""What the project's Triton kernels share: tile widths and tl.dot's precision (host launchers), and the online
softmax that the forward kernels of paged attention (attention/triton_paged.py) and sparse MLA
(sparse_mla/triton_attention.py) walk their key blocks with (@triton.jit functions their kernels call).

Importable without triton (the launchers that call these run only where triton is: kernels.dispatch); the jit
functions exist only where triton does."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def pow2(n, least=16):
    """The tile width that covers n: a power of two, at least `least` (tl.dot's smallest tile is 16)."""
    return max(least, triton.next_power_of_2(int(n)))


def dot_precision(dtype):
    """tl.dot's input_precision: float32 inputs multiply in full precision (tests compare them to float64);
    bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- online softmax (inside kernels): start, one key block at a time, finish ------------------------------------
# Per query row: run_max the largest score so far, run_sum the sum of exp(score - run_max), acc [rows, BLOCK_D] the
# sum of exp(score - run_max) * value, all float32. A row that has seen no key yet keeps run_max = -inf and
# run_sum = acc = 0 (its exponents are taken against 0, not -inf, so nothing becomes nan).
if triton is not None:

    @triton.jit
    def online_softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """(run_max, run_sum, acc) of BLOCK_M rows that have seen no key."""
        return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, BLOCK_D], tl.float32))

    @triton.jit
    def online_softmax_step(s, values, run_max, run_sum, acc, PRECISION: tl.constexpr):
        """(run_max, run_sum, acc) after one key block: s [BLOCK_M, BLOCK_N] float32 scaled scores (-inf where a
        row does not see the key), values [BLOCK_N, BLOCK_D] (p enters the dot in the values' dtype)."""
        new_max = tl.maximum(run_max, tl.max(s, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(run_max - safe_max)
        p = tl.exp(s - safe_max[:, None])
        run_sum = run_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        return new_max, run_sum, acc

    @triton.jit
    def online_softmax_finish(run_max, run_sum, acc):
        """(out [BLOCK_M, BLOCK_D], lse [BLOCK_M]) float32: acc / run_sum and run_max + log(run_sum); (0, -inf) for
        a row that saw no key."""
        seen = run_sum > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, run_sum, 1.0)[:, None], 0.0)
        lse = tl.where(seen, run_max + tl.log(tl.where(seen, run_sum, 1.0)), float("-inf"))
        return out, lse
