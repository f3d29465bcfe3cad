"""One GRPO group: a shared prompt, G responses, their rewards (or advantages), and which response tokens train."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def as_ids(name: str, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name} must be token ids, got {type(ids).__name__}") from error
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{name} holds a negative token id {int(ids.min())}")
    return ids.long()


def _as_vector(name: str, values: torch.Tensor | Sequence[float], count: int) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    if values.numel() != count:
        raise ValueError(f"{name} has {values.numel()} entries but there are {count} responses")
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} must be finite, got {values.tolist()}")
    return values


def _as_masks(masks: Iterable[torch.Tensor | Sequence[bool]], responses: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One boolean tensor per response, as long as it; True marks a token the policy wrote (it trains)."""
    if isinstance(masks, torch.Tensor):
        raise ValueError("response_masks must be a list of 1-D boolean tensors (one per response), got one tensor")
    masks = list(masks)
    if len(masks) != len(responses):
        raise ValueError(f"response_masks has {len(masks)} entries but there are {len(responses)} responses")
    checked = []
    for i, (mask, response) in enumerate(zip(masks, responses, strict=True)):
        if not isinstance(mask, torch.Tensor):
            try:
                mask = torch.as_tensor(mask)
            except (TypeError, ValueError) as error:
                raise ValueError(f"response_masks[{i}] must be a boolean tensor, got {type(mask).__name__}") from error
        # No silent cast from 0/1 integers: a float or integer tensor here is more often log-probs or token ids
        # passed in the wrong slot than a mask (data.py turns the JSONL 0/1 form into booleans itself).
        if mask.dtype != torch.bool:
            raise ValueError(f"response_masks[{i}] must be boolean (True = the policy's token), got dtype {mask.dtype}")
        if mask.dim() != 1:
            raise ValueError(f"response_masks[{i}] must be 1-D, got shape {tuple(mask.shape)}")
        if mask.numel() != response.numel():
            raise ValueError(f"response_masks[{i}] has {mask.numel()} entries, "
                             f"response_ids[{i}] has {response.numel()} tokens")
        checked.append(mask.cpu())
    return checked


@dataclass
class GRPOGroup:
    """prompt_ids: 1-D LongTensor (at least 2 tokens); response_ids: list of G non-empty 1-D LongTensors;
    rewards [G] (advantages are computed from them) or advantages [G]; old_logprobs: optional list of G 1-D
    tensors, one log-prob per response token, from the policy that sampled the responses (the policy before this
    step's updates); sampling_logprobs: the same from the rollout engine that sampled them, where that engine is not
    this model's (a vLLM server, say): what GRPOObjective's rollout_correction weighs the mismatch with.

    response_masks: optional list of G 1-D boolean tensors, each as long as its response: True where the token is
    the policy's own (it counts in the loss), False where it is context only, e.g. a tool's output in an agent
    trajectory (it still runs through the model: it attends, is attended to and feeds the recurrent state, but
    adds no loss term). None trains every token. A member whose mask is all False contributes no loss. Old
    log-probs at masked-out tokens are ignored (they may be NaN where the sampler wrote none).

    held_prefixes: optional list of G token counts: member m's first held_prefixes[m] response tokens are context
    whose state is held constant, as a prompt's is in detached mode (no gradient reaches the weights through their
    rows or recurrent state; the tokens after them read both). They must be masked out of the loss. A group
    sharing a document under a lockstep opens each member with its question held so (grpo/flat_document.py)."""

    prompt_ids: torch.Tensor
    response_ids: list
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: list | None = None
    response_masks: list | None = None
    sampling_logprobs: list | None = None
    # how many leading prompt tokens are a document that other groups of the step share (grpo_backward_shared
    # captures it once for all of them); None: found from the prompts where the call finds it (grpo/document.py)
    shared_prefix: int | None = None
    held_prefixes: list | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = as_ids("prompt_ids", self.prompt_ids)
        if self.prompt_ids.numel() < 2:
            raise ValueError(f"prompt_ids needs at least 2 tokens, got {self.prompt_ids.numel()}")
        if isinstance(self.response_ids, torch.Tensor) and self.response_ids.dim() == 1:
            raise ValueError("response_ids must be a list of 1-D tensors (one per response), got one tensor")
        if len(self.response_ids) == 0:
            raise ValueError("response_ids is empty: a group needs at least one response")
        self.response_ids = [as_ids(f"response_ids[{i}]", r) for i, r in enumerate(self.response_ids)]
        for i, response in enumerate(self.response_ids):
            if response.numel() == 0:
                raise ValueError(f"response_ids[{i}] is empty")
        if self.rewards is None and self.advantages is None:
            raise ValueError("a group needs rewards or advantages; neither was given")
        if self.rewards is not None and self.advantages is not None:
            raise ValueError("give rewards or advantages, not both")
        if self.rewards is not None:
            self.rewards = _as_vector("rewards", self.rewards, self.size)
        if self.advantages is not None:
            self.advantages = _as_vector("advantages", self.advantages, self.size)
        if self.response_masks is not None:
            self.response_masks = _as_masks(self.response_masks, self.response_ids)
        if self.old_logprobs is not None:
            self.old_logprobs = self._as_logprobs("old_logprobs", self.old_logprobs)
        if self.sampling_logprobs is not None:
            self.sampling_logprobs = self._as_logprobs("sampling_logprobs", self.sampling_logprobs)
        if self.held_prefixes is not None:
            self.held_prefixes = self._as_held(self.held_prefixes)
        if self.shared_prefix is not None and not (
                isinstance(self.shared_prefix, int) and 1 <= self.shared_prefix < self.prompt_ids.numel()):
            raise ValueError(f"shared_prefix must be a token count in [1, {self.prompt_ids.numel() - 1}] (the "
                             f"prompt's last token is replayed), got {self.shared_prefix!r}")

    def _as_logprobs(self, name: str, values: list) -> list:
        """One float64 log-prob per response token and member, finite at every trained token."""
        if len(values) != self.size:
            raise ValueError(f"{name} has {len(values)} entries but there are {self.size} responses")
        checked = []
        for i, (value, response) in enumerate(zip(values, self.response_ids, strict=True)):
            value = torch.as_tensor(value, dtype=torch.float64).flatten()
            if value.numel() != response.numel():
                raise ValueError(f"{name}[{i}] has {value.numel()} entries, "
                                 f"response_ids[{i}] has {response.numel()} tokens")
            if not torch.isfinite(value[self.mask(i)]).all():
                raise ValueError(f"{name}[{i}] holds NaN or inf at a trained token")
            checked.append(value)
        return checked

    @property
    def size(self) -> int:
        return len(self.response_ids)

    @property
    def response_tokens(self) -> int:
        """Tokens replayed (every response token, trained or not)."""
        return sum(r.numel() for r in self.response_ids)

    def _as_held(self, values: list) -> list:
        """One count per member, within its response and masked out of the loss."""
        if len(values) != self.size:
            raise ValueError(f"held_prefixes has {len(values)} entries but there are {self.size} responses")
        out = []
        for i, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= self.response_ids[i].numel():
                raise ValueError(f"held_prefixes[{i}] must be a token count in [0, {self.response_ids[i].numel()}], "
                                 f"got {value!r}")
            if value and self.mask(i)[:value].any():
                raise ValueError(f"held_prefixes[{i}] = {value} covers tokens response_masks[{i}] trains: a held "
                                 "span adds no loss term, so mask it out")
            out.append(value)
        return out

    def held(self, member: int) -> int:
        """How many leading response tokens of member `member` are held constant (0 without held_prefixes)."""
        return 0 if self.held_prefixes is None else self.held_prefixes[member]

    def mask(self, member: int) -> torch.Tensor:
        """Member `member`'s response mask (all True when the group has none)."""
        if self.response_masks is None:
            return torch.ones(self.response_ids[member].numel(), dtype=torch.bool)
        return self.response_masks[member]

    def trained_tokens(self, member: int | None = None) -> int:
        """Masked-in tokens of one member, or of the whole group (member None)."""
        if member is None:
            return sum(self.trained_tokens(i) for i in range(self.size))
        if self.response_masks is None:
            return self.response_ids[member].numel()
        return int(self.response_masks[member].sum())

    def check_vocab(self, vocab_size: int) -> None:
        """Called by the transaction once the model is known: ids must index its embedding."""
        for name, ids in [("prompt_ids", self.prompt_ids)] + [(f"response_ids[{i}]", r)
                                                              for i, r in enumerate(self.response_ids)]:
            if int(ids.max()) >= vocab_size:
                raise ValueError(f"{name} holds token id {int(ids.max())} >= vocab size {vocab_size}")


