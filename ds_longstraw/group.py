"""One GRPO group: a shared prompt, G responses, and their rewards (or advantages)."""

from dataclasses import dataclass

import torch


def _as_ids(name, ids):
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


def _as_vector(name, values, count):
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    if values.numel() != count:
        raise ValueError(f"{name} has {values.numel()} entries but there are {count} responses")
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} must be finite, got {values.tolist()}")
    return values


@dataclass
class GRPOGroup:
    """prompt_ids: 1-D LongTensor (at least 2 tokens); response_ids: list of G non-empty 1-D LongTensors;
    rewards [G] (advantages are computed from them) or advantages [G]; old_logprobs: optional list of G 1-D
    tensors, one log-prob per response token, from the policy that sampled the responses."""

    prompt_ids: torch.Tensor
    response_ids: list
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: list | None = None

    def __post_init__(self):
        self.prompt_ids = _as_ids("prompt_ids", self.prompt_ids)
        if self.prompt_ids.numel() < 2:
            raise ValueError(f"prompt_ids needs at least 2 tokens, got {self.prompt_ids.numel()}")
        if isinstance(self.response_ids, torch.Tensor) and self.response_ids.dim() == 1:
            raise ValueError("response_ids must be a list of 1-D tensors (one per response), got one tensor")
        if len(self.response_ids) == 0:
            raise ValueError("response_ids is empty: a group needs at least one response")
        self.response_ids = [_as_ids(f"response_ids[{i}]", r) for i, r in enumerate(self.response_ids)]
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
        if self.old_logprobs is not None:
            if len(self.old_logprobs) != self.size:
                raise ValueError(f"old_logprobs has {len(self.old_logprobs)} entries "
                                 f"but there are {self.size} responses")
            checked = []
            for i, (old, response) in enumerate(zip(self.old_logprobs, self.response_ids)):
                old = torch.as_tensor(old, dtype=torch.float64).flatten()
                if old.numel() != response.numel():
                    raise ValueError(f"old_logprobs[{i}] has {old.numel()} entries, "
                                     f"response_ids[{i}] has {response.numel()} tokens")
                if not torch.isfinite(old).all():
                    raise ValueError(f"old_logprobs[{i}] holds NaN or inf")
                checked.append(old)
            self.old_logprobs = checked

    @property
    def size(self) -> int:
        return len(self.response_ids)

    @property
    def response_tokens(self) -> int:
        return sum(r.numel() for r in self.response_ids)

    def check_vocab(self, vocab_size: int):
        """Called by the transaction once the model is known: ids must index its embedding."""
        for name, ids in [("prompt_ids", self.prompt_ids)] + [(f"response_ids[{i}]", r)
                                                              for i, r in enumerate(self.response_ids)]:
            if int(ids.max()) >= vocab_size:
                raise ValueError(f"{name} holds token id {int(ids.max())} >= vocab size {vocab_size}")


