"""Compute kernels of ds_longstraw, each a fast path beside a plain reference with the same signature.

Installed as ``ds_longstraw.kernels`` (a top-level ``kernels`` package would shadow the real package of that
name that transformers probes for).
"""

from .attention import (
                        attention_with_past,
                        attention_with_past_reference,
                        partial_attention,
                        partial_attention_reference,
)
from .gated_delta import chunk_gated_delta_rule_autograd, recurrent_gated_delta_rule
from .gated_delta_chunked import chunk_gated_delta_rule
from .logprobs import VOCAB_CHUNK, chunked_logprobs, logprobs_reference
from .lse import merge_partials, merge_partials_reference

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
    "logprobs_reference",
    "VOCAB_CHUNK",
]
