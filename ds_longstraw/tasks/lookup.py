"""lookup: an agent task whose answer lives outside the prompt, behind a tool (rollout/environment.py).

A prompt is filler tokens (the long context, which says nothing about the answer) then the query "? k". The
records k -> v live in the environment, not the prompt: a policy answers right only by calling the tool (drawing
CALL), reading the observation "= v" the environment appends, and copying v as its next token. The reward is 1.0
when the first action token after the observation is the queried key's value, else 0.0; a response that never
calls the tool scores 0.

    token ids:  0 "?" (query)   1 CALL (the tool call: the environment's stop id)   2 "=" (the observation's marker)
                3 EOS   keys 4 .. 4+K-1   values 4+K .. 4+K+V-1   filler after them

Each prompt's records are drawn from the prompt's own seed (its tokens), so the environment of a prompt and its
reward agree without sharing state, and a value is not guessable from the key alone (another prompt maps the same
key to another value). Levels: chance 1/values (a value token without reading the observation).

What it is not: a language task (no tokenizer), nor a hard one: its point is an agent loop in which the answer is
read from an observation the rollout captured, not from the prompt.
"""

from __future__ import annotations

import torch

QUERY, CALL, RESULT, EOS = 0, 1, 2, 3
FIRST_KEY = 4


class Layout:
    """The ids of `keys` keys, `values` values and `fillers` filler tokens (module docstring)."""

    def __init__(self, keys: int = 16, values: int = 8, fillers: int = 32) -> None:
        for name, value in (("keys", keys), ("values", values), ("fillers", fillers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup: {name} must be an integer >= 1, got {value!r}")
        self.keys, self.values, self.fillers = keys, values, fillers
        self.first_value = FIRST_KEY + keys
        self.first_filler = self.first_value + values
        self.vocab_size = self.first_filler + fillers

    def prompt(self, seed: int, index: int, prompt_tokens: int) -> torch.Tensor:
        """Prompt `index` of stream `seed`: prompt_tokens - 2 fillers, then "? k"."""
        if prompt_tokens < 3:
            raise ValueError(f"lookup: prompt_tokens must be >= 3, got {prompt_tokens}")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        filler = torch.randint(self.first_filler, self.vocab_size, (prompt_tokens - 2,), generator=generator)
        key = torch.randint(FIRST_KEY, self.first_value, (1,), generator=generator)
        return torch.cat([filler, torch.tensor([QUERY]), key])

    def value_of(self, prompt_ids: torch.Tensor) -> int:
        """The queried key's value in this prompt's records (drawn from the prompt's tokens)."""
        seed = int((prompt_ids.long() * torch.arange(1, prompt_ids.numel() + 1)).sum()) % (2 ** 61)
        values = torch.randint(self.first_value, self.first_filler, (self.keys,),
                               generator=torch.Generator().manual_seed(seed))
        return int(values[int(prompt_ids[-1]) - FIRST_KEY])

    def environment(self, prompt_ids: torch.Tensor) -> LookupTool:
        return LookupTool(self.value_of(prompt_ids))

    def reward(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> float:
        """1.0 when the action right after the observation "= v" is v, else 0.0."""
        ids = response_ids.tolist()
        if CALL not in ids:
            return 0.0
        after = ids.index(CALL) + 3  # CALL, "=", v, then the answer
        return float(len(ids) > after and ids[after] == self.value_of(prompt_ids))


class LookupTool:
    """The environment of one prompt's samples: answers CALL with "= v" (v the queried key's value), once per
    sample; a second call ends the sample."""

    stop_ids = (CALL,)

    def __init__(self, value: int) -> None:
        self.value = value

    def observe(self, sample: int, response_ids: torch.Tensor) -> list[int] | None:
        if int((response_ids == CALL).sum()) > 1:
            return None
        return [RESULT, self.value]
