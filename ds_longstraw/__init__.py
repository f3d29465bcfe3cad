"""ds_longstraw: long-context GRPO as a transaction on DeepSpeed.

Capture a shared prompt once without autograd, keep only the state each architecture needs on owned pages,
score reference log-probs without a graph, replay one response at a time with autograd, accumulate gradients,
and take one reduction and one optimizer step.
"""

from .arch import shard_experts
from .config import LongstrawConfig, parse_config
from .engine import StepResult, initialize
from .group import GRPOGroup
from .objective import GRPOObjective
from .rollout import Rollouts, generate
from .transaction import GroupResult, grpo_backward

__all__ = ["GRPOGroup", "GRPOObjective", "GroupResult", "LongstrawConfig", "Rollouts", "StepResult", "generate",
           "grpo_backward", "initialize", "parse_config", "shard_experts"]
