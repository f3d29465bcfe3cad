"""Compute kernels of ds_longstraw, each a fast path beside a plain reference with the same signature.

Installed as ``ds_longstraw.kernels`` (a top-level ``kernels`` package would shadow the real package of that
name that transformers probes for). One folder per op, its plain torch reference beside its fast paths:

    attention/     partial softmax attention with its log-sum-exp (flash on CUDA, Triton over paged keys)
    gated_delta/   the gated delta rule (the chunked torch kernel; flash-linear-attention's on CUDA)
    logprobs/      log-probs under the LM head without [T, V] logits (Triton fused kernels and steps)
    dsa/           DSA selection, GLM's indexer top-k (Triton scores)
    sparse_mla/    sparse absorbed MLA over the selected latent rows, GLM's attention (Triton)
    lse.py         the log-sum-exp merge of partial attentions
    dispatch.py    which path a kernel takes (mode "auto" / "reference") and which paths ran
    triton_common.py  what the Triton launchers share
"""

from .attention import (
    attention_with_past,
    attention_with_past_reference,
    partial_attention,
    partial_attention_reference,
)
from .dsa import dsa_select, dsa_select_reference
from .gated_delta import chunk_gated_delta_rule, chunk_gated_delta_rule_autograd, recurrent_gated_delta_rule
from .logprobs import (
    VOCAB_CHUNK,
    chunked_logprobs,
    chunked_logprobs_entropy,
    logprobs_entropy_reference,
    logprobs_reference,
)
from .lse import merge_partials, merge_partials_reference
from .sparse_mla import sparse_latent_attention, sparse_latent_attention_reference

__all__ = [
    "partial_attention",
    "partial_attention_reference",
    "attention_with_past",
    "attention_with_past_reference",
    "merge_partials",
    "merge_partials_reference",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_autograd",
    "recurrent_gated_delta_rule",
    "chunked_logprobs",
    "chunked_logprobs_entropy",
    "logprobs_entropy_reference",
    "logprobs_reference",
    "VOCAB_CHUNK",
    "dsa_select",
    "dsa_select_reference",
    "sparse_latent_attention",
    "sparse_latent_attention_reference",
]
