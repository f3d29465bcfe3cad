"""grpo_backward_shared: the groups of one step whose prompts share a document, as one tree transaction.

    reference  (kl_coef > 0) capture the document once under the reference policy; per group capture its suffix
               as the document's child and score its members without a graph; then free the document's state
    capture    the document once under the policy (exact mode: with its chunk-boundary checkpoints)
    groups     per group, the transaction (transaction.py) on a child capture of its suffix: replay its members,
               and in exact mode the reverse pass over its suffix, whose d(state at the document's end) is
               summed over the groups and whose d(document rows) land on the document's gradient pages
    prefix     (exact mode) one reverse pass over the document from the summed d(state)
Gradients accumulate into .grad as the groups' separate transactions would; the document's pages and one group's
suffix are alive at a time (docs/trees.md). One rank so far: context parallelism and sharded experts are refused
by name, and it takes no ZeRO-3 lockstep (data-parallel ranks with different documents).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ds_longstraw.arch import adapter_for, expert_parallel
from ds_longstraw.config import parse_config
from ds_longstraw.group import GRPOGroup
from ds_longstraw.grpo.document import SharedDocument, document_tokens
from ds_longstraw.grpo.prefix_pass import ReversePass, prefix_backward
from ds_longstraw.grpo.state import capture_prefix
from ds_longstraw.grpo.transaction import Request, _transaction, grpo_backward, reference_policy, score_reference
from ds_longstraw.kernels.dispatch import kernel_mode
from ds_longstraw.objective import GRPOObjective

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from ds_longstraw.config import LongstrawConfig
    from ds_longstraw.grpo.transaction import GroupResult
    from ds_longstraw.objective import LossScope


def grpo_backward_shared(model: torch.nn.Module, groups: Sequence[GRPOGroup], objective: GRPOObjective | None = None,
                         *, longstraw: LongstrawConfig | dict | None = None, ref_model: torch.nn.Module | None = None,
                         backward: Callable[[torch.Tensor], object] | None = None,
                         loss_scopes: Sequence[LossScope | Sequence[LossScope]] | None = None) -> list[GroupResult]:
    """Every group's transaction (grpo_backward's arguments, one objective for all), the document their prompts
    share captured once (grpo/document.py says where it ends: GRPOGroup.shared_prefix, or the longest common
    prefix of at least longstraw.shared_prefix_min tokens). Without a document each group runs alone, as
    grpo_backward. loss_scopes: per group, as grpo_backward's loss_scope (default: each group's own).

    Returns each group's GroupResult; extras["document"] (the same dict in each) says the document's tokens, its
    capture's and prefix pass's seconds and its retained bytes."""
    longstraw = parse_config(longstraw)
    groups = list(groups)
    objective = objective or GRPOObjective()
    for index, group in enumerate(groups):
        if not isinstance(group, GRPOGroup):
            raise ValueError(f"groups[{index}] must be a GRPOGroup, got {type(group).__name__}")
        objective.check_group(group)
    if loss_scopes is not None and len(loss_scopes) != len(groups):
        raise ValueError(f"loss_scopes has {len(loss_scopes)} entries for {len(groups)} groups")
    scopes = list(loss_scopes) if loss_scopes is not None else [None] * len(groups)
    tokens = document_tokens(groups, longstraw.shared_prefix_min) if groups else None
    if tokens is None:
        return [grpo_backward(model, group, objective, longstraw=longstraw, ref_model=ref_model, backward=backward,
                              loss_scope=scope) for group, scope in zip(groups, scopes, strict=True)]
    if longstraw.cp_size > 1 or expert_parallel(model) is not None:
        raise ValueError(f"a shared document runs on one rank so far: 'longstraw.cp_size' = {longstraw.cp_size}"
                         f"{'' if expert_parallel(model) is None else ', experts sharded'}")
    # what every group's transaction shares (one rank: no process groups; the caller reduces where it backwards)
    common = Request(model, None, objective, longstraw, ref_model, None, None, backward, backward is not None, None)
    with kernel_mode(longstraw.kernels):
        return _shared_step(common, groups, scopes, SharedDocument(tokens))


def _shared_step(common: Request, groups: list[GRPOGroup], scopes: list, document: SharedDocument
                 ) -> list[GroupResult]:
    model, objective, longstraw, backward = common.model, common.objective, common.longstraw, common.backward
    adapter = adapter_for(model)
    for group in groups:
        group.check_vocab(adapter.vocab_size)
    root_ids = groups[0].prompt_ids[:document.tokens + 1]  # capture_prefix takes prompt[:-1]: the document's
    report = {"tokens": document.tokens, "groups": len(groups)}
    try:
        ref_logprobs = [None] * len(groups)
        if objective.needs_reference:
            with reference_policy(model, common.ref_model) as reference:
                document.reference = capture_prefix(adapter_for(reference), root_ids, longstraw, "detached")
                ref_logprobs = [score_reference(reference, group, longstraw, parent=document.reference,
                                                temperature=objective.temperature) for group in groups]
            document.reference.release()
            document.reference = None
        started = time.perf_counter()
        document.policy = capture_prefix(adapter, root_ids, longstraw, longstraw.prefix_grad)
        report["capture_seconds"] = time.perf_counter() - started
        report["retained_bytes"] = document.policy.retained_bytes()
        results = []
        for group, scope, ref in zip(groups, scopes, ref_logprobs, strict=True):
            request = replace(common, group=group, document=document, ref_logprobs=ref)
            results.append(_transaction(request, None, scope))
        if longstraw.prefix_grad == "exact":
            started = time.perf_counter()
            reverse = ReversePass(adapter, document.policy, root_ids[:-1], backward=backward,
                                  prefix_recompute=longstraw.prefix_recompute_runs)
            prefix_backward(reverse, document.d_carry)
            report["prefix_seconds"] = time.perf_counter() - started
    finally:
        document.release()
    for result in results:
        result.extras["document"] = report
    return results
