"""kv: key-value retrieval from a long prompt, a verifiable task for rollouts inside training.

A prompt is filler tokens with `records` key-value records "k = v ;" at random places, then a query for one of
the records' keys: "? k =". The answer is that key's value, one token. Prompts come from a seed and an index
(`prompt`), so a run's prompts are reproducible from its seed and step.

    token ids (the layout every size shares; the model's vocabulary must hold `vocab_size(...)` ids):
      0 "="   1 ";"   2 "?"   keys 3 .. 3+K-1   values 3+K .. 3+K+V-1   filler after them

Rewards are pure functions of (prompt_ids, response_ids), as a `rollout.reward` import path calls them; they read
the query key and the records back from the prompt, so they need no sizes:
  reward          1.0 when the response's first token is the queried key's value, else 0.0
  reward_partial  the same, and 0.25 when the first token is the value of ANOTHER record of the prompt (the
                  policy copied a value from the context, but the wrong one); it gives a sparse-reward start a
                  gradient toward reading the records, and is what the learning test and `--task kv` train on.
What it is not: a language task (no tokenizer), nor hard to guess when `values` is small: with V values a
policy that copies a random record's value scores 1/records on `reward`; chance over the vocabulary is 1/vocab.
"""

import torch

EQUALS, SEPARATOR, QUERY = 0, 1, 2
FIRST_KEY = 3
PARTIAL = 0.25


def vocab_size(keys, values, fillers) -> int:
    """Ids the layout uses for `keys` keys, `values` values and `fillers` filler tokens."""
    return FIRST_KEY + keys + values + fillers


def _check(prompt_tokens, records, keys, values, fillers):
    for name, value, least in (("records", records, 1), ("keys", keys, 1), ("values", values, 1),
                               ("fillers", fillers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"kv: {name} must be an integer >= {least}, got {value!r}")
    if records > keys:
        raise ValueError(f"kv: records = {records} needs as many distinct keys, got keys = {keys}")
    least = 4 * records + 3
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < least:
        raise ValueError(f"kv: prompt_tokens = {prompt_tokens!r} must be an integer >= {least} "
                         f"(4 per record and 3 for the query)")


def prompt(seed, index, *, prompt_tokens=64, records=2, keys=8, values=4, fillers=8) -> torch.Tensor:
    """Prompt `index` of the stream seeded by `seed`: 1-D LongTensor of exactly `prompt_tokens` ids.

    `records` records with distinct keys (drawn from `keys`) and values drawn from `values` (repeats allowed),
    placed in order at random offsets among filler tokens; the query asks for one record's key, drawn uniformly."""
    _check(prompt_tokens, records, keys, values, fillers)
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (2**63))
    chosen = torch.randperm(keys, generator=gen)[:records] + FIRST_KEY
    answers = torch.randint(0, values, (records,), generator=gen) + FIRST_KEY + keys
    body = prompt_tokens - 3
    ids = torch.randint(0, fillers, (body,), generator=gen) + FIRST_KEY + keys + values
    # records at sorted random starts, 4 tokens apart at least: choose the gaps by placing records among slots
    slots = body - 4 * records
    starts = torch.sort(torch.randint(0, slots + 1, (records,), generator=gen)).values + 4 * torch.arange(records)
    for start, key, value in zip(starts.tolist(), chosen.tolist(), answers.tolist(), strict=True):
        ids[start: start + 4] = torch.tensor([key, EQUALS, value, SEPARATOR])
    asked = int(torch.randint(0, records, (), generator=gen))
    return torch.cat([ids, torch.tensor([QUERY, int(chosen[asked]), EQUALS])])


def records_of(prompt_ids) -> dict:
    """key -> value of every record "k = v ;" in the prompt's body (before the query)."""
    ids = torch.as_tensor(prompt_ids).tolist()
    body = ids[:-3]
    out = {}
    for i in range(len(body) - 3):
        if body[i + 1] == EQUALS and body[i + 3] == SEPARATOR:
            out[body[i]] = body[i + 2]
    return out


def answer(prompt_ids) -> int:
    """The value the prompt's query asks for."""
    ids = torch.as_tensor(prompt_ids).tolist()
    if len(ids) < 7 or ids[-3] != QUERY or ids[-1] != EQUALS:
        raise ValueError("kv: not a kv prompt (it must end with '? k =')")
    table = records_of(ids)
    if ids[-2] not in table:
        raise ValueError(f"kv: the query's key {ids[-2]} has no record in the prompt")
    return table[ids[-2]]


def reward(prompt_ids, response_ids) -> float:
    """1.0 when the response begins with the queried key's value, else 0.0."""
    response = torch.as_tensor(response_ids).tolist()
    return 1.0 if response and response[0] == answer(prompt_ids) else 0.0


def reward_partial(prompt_ids, response_ids) -> float:
    """reward, plus 0.25 for beginning with another record's value (module docstring)."""
    response = torch.as_tensor(response_ids).tolist()
    if not response:
        return 0.0
    right = answer(prompt_ids)
    if response[0] == right:
        return 1.0
    return PARTIAL if response[0] in set(records_of(prompt_ids).values()) else 0.0
