"""grpo_backward: one GRPO group as a transaction.

    capture-ref  (kl_coef > 0) capture the reference policy's prompt state without autograd
    score-ref    reference log-probs of every member without a graph; then free that state
    capture      the policy's prompt state without autograd (exact mode: plus chunk-boundary checkpoints)
    replay       for each member: replay [prompt[-1], response[:-1]] with autograd, backward its loss share,
                 drop the graph (exact mode: d(state) accumulates on gradient pages)
    prefix       (exact mode) reverse pass over the capture chunks
Gradients ACCUMULATE into the parameters' .grad; no optimizer step is taken here.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from .arch import adapter_for
from .config import parse_config
from .group import GRPOGroup
from .memory import PhaseMeter
from .objective import GRPOObjective
from .parallel.groups import as_cp_context
from .parallel.transaction import cp_grpo_backward
from .prefix_pass import prefix_backward
from .replay import final_carry_grads, prefix_leaves, replay_group, score_group
from .state import capture_prefix


@dataclass
class GroupResult:
    loss: float
    logprobs: list  # per member, detached, float64 on CPU
    ref_logprobs: list | None
    advantages: torch.Tensor
    phases: dict  # name -> PhaseStats(seconds, peak_bytes)
    retained_bytes: dict  # by layer type
    grad_page_bytes: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())


@contextmanager
def _reference_policy(model, ref_model):
    """The reference: a separate model, or the same peft model with its adapters disabled (no weight copy)."""
    if ref_model is not None:
        yield ref_model
    elif hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        raise ValueError("kl_coef > 0 needs ref_model, or a peft policy whose adapters can be disabled")


def _progress_bar(enabled, total, desc):
    if not enabled:
        return nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, leave=False)


def _capture(adapter, group, settings, keep_boundaries, desc, lockstep=None):
    with _progress_bar(settings.progress, group.prompt_ids.numel() - 1, desc) as bar:
        state = capture_prefix(adapter, group.prompt_ids, settings, keep_boundaries,
                               progress=None if bar is None else bar.update)
    if lockstep is not None:  # ZeRO-3 data parallel: as many module calls as the other ranks (lockstep.py)
        lockstep.pad_capture(adapter)
    return state


def score_reference(ref_model, group, settings, lockstep=None):
    """Reference log-probs of every member, without a graph; the reference state is freed before returning."""
    adapter = adapter_for(ref_model)
    state = _capture(adapter, group, settings, False, "capture (reference)", lockstep)
    try:
        leaves = prefix_leaves(adapter, state, requires_grad=False)
        scores = score_group(adapter, leaves, state.length, group, settings.replay_block, lockstep=lockstep)
        leaves.release()
    finally:
        state.release()  # page files of a host/NVMe tier go on error as on success
    return scores


def grpo_backward(model, group, objective=None, *, config=None, ref_model=None, cp_group=None,
                  backward=None, lockstep=None) -> GroupResult:
    """Run the GRPO transaction for one group and accumulate the gradient of the group loss into `.grad`.

    config: the "longstraw" block (dict or LongstrawConfig); prefix_grad "detached" (the captured prompt state is
    a constant) or "exact" (gradients equal full-sequence autograd over prompt + response for every member).
    backward: callable run on every scalar that is back-propagated (each member's loss share; in exact mode the
    prefix pass's surrogate sum(output * injected grad), whose gradient is exactly the injected one). Default
    `loss.backward()`; the DeepSpeed engine passes its own engine.backward so ZeRO sees every backward.
    lockstep: None, or a lockstep.Lockstep that pads this rank's module calls to those of the other data-parallel
    ranks (ZeRO-3 gathers weights with collectives; the DeepSpeed engine sets it). Results are unchanged.
    """
    settings = parse_config(config)
    objective = objective or GRPOObjective()
    if not isinstance(group, GRPOGroup):
        raise ValueError(f"group must be a GRPOGroup, got {type(group).__name__}")
    adapter = adapter_for(model)
    group.check_vocab(adapter.vocab_size)
    cp = as_cp_context(cp_group, settings.cp_size)  # None for one rank; ValueError on a size mismatch
    if objective.kl_coef > 0 and ref_model is None and not hasattr(model, "disable_adapter"):
        raise ValueError("kl_coef > 0 needs ref_model, or a peft policy whose adapters can be disabled")
    if cp is not None:  # the prompt sharded over a context-parallel group (parallel/transaction.py)
        return cp_grpo_backward(model, group, objective, settings=settings, ref_model=ref_model, cp=cp,
                                backward=backward, lockstep=lockstep)
    exact = settings.prefix_grad == "exact"
    meter = PhaseMeter(adapter.device)
    advantages = objective.advantages(group)

    ref_logprobs = None
    prefix_seconds = {}  # exact mode: the prefix pass's forward and backward seconds
    if objective.kl_coef > 0:
        with meter.phase("reference"), _reference_policy(model, ref_model) as reference:
            ref_logprobs = score_reference(reference, group, settings, lockstep)

    with meter.phase("capture"):
        state = _capture(adapter, group, settings, exact, "capture", lockstep)
    try:
        retained = state.retained_bytes()

        with meter.phase("replay"):
            leaves = prefix_leaves(adapter, state, requires_grad=exact)
            loss, logprobs = replay_group(adapter, leaves, state.length, group, objective, advantages, ref_logprobs,
                                          settings.replay_block, backward=backward, lockstep=lockstep)
            leaves.release()  # staged pages of the replay are not needed by the prefix pass

        grad_page_bytes = state.pool.grad_bytes()
        if exact:
            with meter.phase("prefix"):
                d_final = final_carry_grads(leaves)
                with _progress_bar(settings.progress, state.length, "prefix pass") as bar:
                    prefix_backward(adapter, state, group.prompt_ids[:-1], d_final,
                                    progress=None if bar is None else bar.update, backward=backward,
                                    recompute=settings.recompute_layers, timings=prefix_seconds)
                if lockstep is not None:
                    lockstep.pad_prefix(adapter, backward)
            grad_page_bytes = state.pool.grad_bytes()
    finally:
        state.release()  # page files of a host/NVMe tier go on error as on success
    return GroupResult(loss=loss, logprobs=logprobs, ref_logprobs=ref_logprobs, advantages=advantages,
                       phases=meter.phases, retained_bytes=retained, grad_page_bytes=grad_page_bytes,
                       extras={f"prefix_{name}_seconds": value for name, value in prefix_seconds.items()})
