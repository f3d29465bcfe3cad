"""A shared document where the tree transaction does not run: one group over the document, each member opening
with its group's question as an untrained span.

grpo_backward_shared (shared.py) captures a document once and each group's question as its child, on one rank's
own calls. Where ranks pad their module calls to each other's (ZeRO-3 with data parallelism, sharded experts) or
shard the prompt (context parallelism), the engine runs the groups through this form instead:

  flatten   the groups as ONE group whose prompt is the document and whose member m of group k is question k
            followed by its response, the question masked out of the loss (response_masks False), its advantage
            group k's own (the objective's, from group k's rewards), its LossScope group k's; old and sampling
            log-probs padded over the question (masked, never read)
  split     the merged result back into one GroupResult per group: each member's log-probs without the question,
            each group's loss its members' shares

Every member's loss is the same function of the same token sequence's log-probs, so the step's gradient is the
groups' separate transactions' sum (tests/equivalence/test_shared_document.py, float64). The document is captured
once per rank, sharded under context parallelism as any prompt; each question is replayed with each of its group's
members (or in steps without a graph where it reaches longstraw.member_span_capture tokens) instead of captured
once per group: G question forwards per group, with graph, for a question that is short beside its document.
In detached mode a group's question belongs to its prompt, whose state is a constant, while a member's own context
is differentiated: there each member holds its question (GRPOGroup.held_prefixes), so the question's rows and
recurrent state are constants to its response, as the prompt's are, and the member runs in steps (member_steps.py):
the question forward without a graph, then the response with one. An objective with an entropy term keeps the
groups apart (their losses are not recomputed from log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ds_longstraw.group import GRPOGroup
from ds_longstraw.objective import LossScope

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ds_longstraw.grpo.transaction import GroupResult
    from ds_longstraw.objective import GRPOObjective


@dataclass(frozen=True)
class FlatDocument:
    """The merged group, each merged member's LossScope, and where each came from: (group, member, question
    tokens) per merged member."""

    group: GRPOGroup
    scopes: list[LossScope]
    origin: list[tuple[int, int, int]]
    tokens: int  # the document's


def can_flatten(objective: GRPOObjective) -> bool:
    """Whether the flat form is the groups' own step: no entropy term (`split` recovers each group's loss from
    log-probs alone)."""
    return not objective.needs_entropy


def flatten(groups: Sequence[GRPOGroup], tokens: int, objective: GRPOObjective,
            scopes: Sequence[LossScope | Sequence[LossScope]], prefix_grad: str = "exact") -> FlatDocument:
    """The groups (whose prompts share their first `tokens` tokens: grpo/document.document_tokens) as one group over
    the document; scopes: each group's LossScope, or one per member; prefix_grad "detached": each member holds its
    question (module docstring)."""
    responses, masks, advantages, member_scopes, origin = [], [], [], [], []
    old, sampling = [], []
    for k, group in enumerate(groups):
        question = group.prompt_ids[tokens:]
        q = question.numel()
        group_advantages = objective.advantages(group)
        for m in range(group.size):
            responses.append(torch.cat([question, group.response_ids[m]]))
            masks.append(torch.cat([torch.zeros(q, dtype=torch.bool), group.mask(m)]))
            advantages.append(float(group_advantages[m]))
            scope = scopes[k]
            member_scopes.append(scope if isinstance(scope, LossScope) else scope[m])
            origin.append((k, m, q))
            pad = torch.zeros(q, dtype=torch.float64)
            old.append(None if group.old_logprobs is None else torch.cat([pad, group.old_logprobs[m]]))
            sampling.append(None if group.sampling_logprobs is None else torch.cat([pad, group.sampling_logprobs[m]]))
    held = [q for _, _, q in origin] if prefix_grad == "detached" else None
    merged = GRPOGroup(groups[0].prompt_ids[:tokens], responses, advantages=advantages, response_masks=masks,
                       old_logprobs=_all_or_none(old, "old_logprobs"),
                       sampling_logprobs=_all_or_none(sampling, "sampling_logprobs"), held_prefixes=held)
    return FlatDocument(merged, member_scopes, origin, tokens)


def _all_or_none(values: list, name: str) -> list | None:
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"groups sharing a document must all give {name} or none do")
    return values


def split(flat: FlatDocument, result: GroupResult, groups: Sequence[GRPOGroup],
          objective: GRPOObjective) -> list[GroupResult]:
    """One GroupResult per group from the merged group's: members' log-probs (and reference log-probs) without
    the question, each group's loss its members' shares (objective.member_loss on the merged members, the same
    values the transaction summed), its advantages; phases and bytes are the step's, shared."""
    merged = flat.group
    advantages = objective.advantages(merged)
    losses = [0.0] * len(groups)
    logprobs = [[None] * g.size for g in groups]
    ref_logprobs = None if result.ref_logprobs is None else [[None] * g.size for g in groups]
    entropies = None if result.entropies is None else [[None] * g.size for g in groups]
    for i, (k, m, q) in enumerate(flat.origin):
        ref = None if result.ref_logprobs is None else result.ref_logprobs[i]
        with torch.no_grad():
            share = objective.member_loss(merged, i, result.logprobs[i], advantages, ref, None, flat.scopes[i])
        losses[k] += float(share)
        logprobs[k][m] = result.logprobs[i][q:]
        if ref_logprobs is not None:
            ref_logprobs[k][m] = ref[q:]
        if entropies is not None:
            entropies[k][m] = result.entropies[i][q:]
    questions = "held by each member" if merged.held_prefixes is not None else "replayed with each member"
    report = {"tokens": flat.tokens, "groups": len(groups), "questions": questions}
    return [replace(result, loss=losses[k], logprobs=logprobs[k],
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[k],
                    entropies=None if entropies is None else entropies[k],
                    advantages=torch.stack([advantages[i] for i, (g, _, _) in enumerate(flat.origin) if g == k]),
                    extras={**result.extras, "document": report}) for k in range(len(groups))]
