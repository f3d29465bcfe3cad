"""Log-probs of target tokens under the LM head's softmax, never holding a [T, V] logits tensor.

    chunked.py       `chunked_logprobs` (vocabulary chunks: online log-sum-exp forward, recomputing backward) and
                     its plain reference `logprobs_reference`, with the torch per-chunk steps
    triton_fused.py  the whole computation as fused Triton kernels (tested, timed by bench/gpu_check; not
                     dispatched: 2.5-3.3x the chunked path's time on the H200)
    triton_steps.py  each chunk's elementwise steps as one Triton pass, beside cuBLAS matmuls (USE_TRITON_STEPS,
                     taken on CUDA: 0.82-0.86x the torch steps' time on the H200)
    entropy.py       `chunked_logprobs_entropy`: the log-probs and the softmax's entropy per token in one chunked
                     pass (an entropy bonus), and its plain reference `logprobs_entropy_reference`
"""

from .chunked import VOCAB_CHUNK, chunked_logprobs, logprobs_reference
from .entropy import chunked_logprobs_entropy, logprobs_entropy_reference

__all__ = ["chunked_logprobs", "chunked_logprobs_entropy", "logprobs_entropy_reference", "logprobs_reference",
           "VOCAB_CHUNK"]
