"""Partial softmax attention with its log-sum-exp, over one key set or a block's past plus itself.

    reference.py     the plain torch forms (dense attention, the key-set gradients from delta) every path is held to
    partial.py       `partial_attention` / `attention_with_past`: autograd entries that take the first path that
                     applies: cuDNN or flash (CUDA), the Triton paged kernels (CUDA), the fused CPU kernel, the
                     blockwise loop
    flash.py         torch's flash-attention kernels on CUDA, with the lse and its gradient
    cudnn.py         cuDNN's fused attention on CUDA, the same contract (dispatch.attention_library chooses)
    triton_paged.py  Triton kernels over keys left on their pages, read through a page table (imports triton: the
                     dispatch loads it on first use, on CUDA only)
"""

from .partial import (
    LIBRARY_KEY_BLOCK,
    attention_with_past,
    attention_with_past_reference,
    key_set_grads,
    partial_attention,
    sink_block,
)
from .reference import KEY_BLOCK, attention_delta, blockwise_grads_from_delta, partial_attention_reference

__all__ = [
    "partial_attention",
    "partial_attention_reference",
    "attention_with_past",
    "attention_with_past_reference",
    "attention_delta",
    "blockwise_grads_from_delta",
    "key_set_grads",
    "sink_block",
    "KEY_BLOCK",
    "LIBRARY_KEY_BLOCK",
]
