"""A document shared by several groups of one step: the root of a tree transaction (docs/trees.md).

Long-context RL data asks several questions of one long document, each question its own GRPO group whose prompt
is the document followed by the question. The document is captured once (per policy: once for the policy, once
for the reference where a KL term needs it), each group captures only its own suffix as a child of that capture
(grpo/state.capture_prefix with `parent`), and exact mode runs one reverse pass over the document with the groups'
d(state at its end) summed (the sum is exact: the document's state feeds every group's suffix alike, and the
step's loss is the sum of the groups' losses).

  document_tokens  where the document ends: said on the groups (GRPOGroup.shared_prefix) or found (the longest
                   common token prefix of the step's prompts, at least longstraw.shared_prefix_min tokens), at
                   most the shortest prompt's length - 1 (a prompt's last token is the first replayed one)
  SharedDocument   the captured roots and the running sum of the groups' d(root carry)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ds_longstraw.group import GRPOGroup
    from ds_longstraw.grpo.state import PrefixState


def common_prefix(prompts: Sequence[torch.Tensor]) -> int:
    """The length of the longest token prefix every prompt starts with."""
    shortest = min(prompt.numel() for prompt in prompts)
    first = prompts[0][:shortest]
    same = torch.ones(shortest, dtype=torch.bool)
    for prompt in prompts[1:]:
        same &= prompt[:shortest] == first
    differ = (~same).nonzero()
    return shortest if differ.numel() == 0 else int(differ[0])


def document_tokens(groups: Sequence[GRPOGroup], minimum: int | None) -> int | None:
    """How many leading prompt tokens the groups share as one document, or None (no tree: each group alone).

    Said on the groups (shared_prefix): every group must say the same and their prompts must agree there
    (ValueError naming the group otherwise). Not said: the longest common prefix where it reaches `minimum`
    (None: only where said). Either way at most the shortest prompt's length - 1."""
    said = {group.shared_prefix for group in groups}
    if said != {None}:
        if None in said or len(said) > 1:
            raise ValueError("shared_prefix must be given on every group alike or on none, got "
                             f"{sorted(said, key=str)}")
        tokens = said.pop()
        for index, group in enumerate(groups):
            if not torch.equal(group.prompt_ids[:tokens], groups[0].prompt_ids[:tokens]):
                raise ValueError(f"groups[{index}].prompt_ids differ from groups[0]'s within shared_prefix = {tokens}")
    elif minimum is None or len(groups) < 2:
        return None
    else:
        tokens = common_prefix([group.prompt_ids for group in groups])
        if tokens < minimum:
            return None
    return min(tokens, min(group.prompt_ids.numel() for group in groups) - 1)


@dataclass
class SharedDocument:
    """The captured document of a step's groups: `tokens` long; `policy` (and `reference`, where the objective
    scores a reference policy) its captured state, the parent of each group's suffix capture; `d_carry` (exact
    mode) layer -> d(loss)/d(the policy's carry at the document's end), summed over the groups as each group's
    reverse pass over its suffix returns it."""

    tokens: int
    policy: PrefixState | None = None
    reference: PrefixState | None = None
    d_carry: dict = field(default_factory=dict)

    def add_carry_grads(self, d_carry: dict) -> None:
        for layer, parts in d_carry.items():
            held = self.d_carry.get(layer)
            self.d_carry[layer] = tuple(parts) if held is None else tuple(
                total + part for total, part in zip(held, parts, strict=True))

    def release(self) -> None:
        for state in (self.policy, self.reference):
            if state is not None:
                state.release()
        self.policy = self.reference = None
