"""ds_longstraw: long-context GRPO as a transaction on DeepSpeed.

Capture a shared prompt once without autograd, keep only the state each architecture needs on owned pages,
score reference log-probs without a graph, replay one response at a time with autograd, accumulate gradients,
and take one reduction and one optimizer step.
"""

from ds_longstraw.accelerator import settle as _settle_accelerator

_settle_accelerator()  # before deepspeed is imported below: where no device is visible, say "cpu" (no guess message)

from ds_longstraw.arch import shard_experts  # noqa: E402
from ds_longstraw.config import LongstrawConfig, parse_config  # noqa: E402
from ds_longstraw.engine.engine import StepResult, initialize  # noqa: E402
from ds_longstraw.group import GRPOGroup  # noqa: E402
from ds_longstraw.grpo.shared import grpo_backward_shared  # noqa: E402
from ds_longstraw.grpo.transaction import GroupResult, grpo_backward  # noqa: E402
from ds_longstraw.objective import GRPOObjective  # noqa: E402
from ds_longstraw.rollout.environment import Environment  # noqa: E402
from ds_longstraw.rollout.generate import Rollouts, generate  # noqa: E402

__all__ = ["Environment", "GRPOGroup", "GRPOObjective", "GroupResult", "LongstrawConfig", "Rollouts", "StepResult",
           "generate", "grpo_backward", "grpo_backward_shared", "initialize", "parse_config", "shard_experts"]
