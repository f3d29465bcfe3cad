"""The gated delta rule (Qwen3.5's linear attention): a token loop, its chunked form, and flash-linear-attention's.

    reference.py   the plain references: the token-by-token recurrence, and the chunked form under plain autograd
    chunked.py     `chunk_gated_delta_rule`, the path the layers run: the chunked form with a hand-derived backward
                   that keeps only its inputs (fla's kernel on CUDA where it applies), and PreparedDeltaRule
    fla_bridge.py  the call into fla's chunk kernel on CUDA, and when it applies
    fla_dqkwg.py   a torch build of the one step of fla's backward that fla refuses on Hopper with Triton >= 3.4
                   and < 3.7.1, registered with fla's backend registry
"""

from .chunked import PreparedDeltaRule, chunk_gated_delta_rule
from .reference import chunk_gated_delta_rule_autograd, recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_autograd",
    "recurrent_gated_delta_rule",
    "PreparedDeltaRule",
]
