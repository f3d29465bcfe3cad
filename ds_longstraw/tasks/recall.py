"""recall: a value that must be read from the prompt, the task `bin/main --task recall` trains by GRPO.

A prompt is filler tokens with `records` records "# k v" (a marker, a key, its value) at random places, then the
query "? k" for one of the records' keys. The answer is that key's value, one token, and nothing outside the
prompt says which: a policy scores above 1/records only by finding the queried key among the records and copying
the token after it (an induction-style lookup). Prompts come from a seed and an index (`prompt`), so a run's
prompts and its held-out evaluation prompts (another seed) are reproducible.

    token ids (the layout every size shares; the model's vocabulary must hold `vocab_size(...)` ids):
      0 "#" (record marker)   1 "?" (query)   keys 2 .. 2+K-1   values 2+K .. 2+K+V-1   filler after them

Levels a policy is measured against (exact-match accuracy on the first response token):
  chance          1/values: a value token, drawn uniformly, without reading the prompt
  random record   1/records: the value of one of the prompt's records, not the queried one (the plateau a
                  half-formed lookup reaches); records' values are distinct, so this level is exactly 1/records

Rewards are pure functions of (prompt_ids, response_ids), as a `rollout.reward` import path calls them:
  reward          1.0 when the response's first token is the queried key's value, else 0.0
What it is not: a language task (no tokenizer). The query appears once, at the end, so no earlier answer can be
copied; keys and values never occur as filler.
"""

import torch

MARKER, QUERY = 0, 1
FIRST_KEY = 2


def vocab_size(keys, values, fillers) -> int:
    """Ids the layout uses for `keys` keys, `values` values and `fillers` filler tokens."""
    return FIRST_KEY + keys + values + fillers


def _check(prompt_tokens, records, keys, values, fillers):
    for name, value, least in (("records", records, 1), ("keys", keys, 1), ("values", values, 1),
                               ("fillers", fillers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"recall: {name} must be an integer >= {least}, got {value!r}")
    if records > keys:
        raise ValueError(f"recall: records = {records} needs as many distinct keys, got keys = {keys}")
    if records > values:
        raise ValueError(f"recall: records = {records} needs as many distinct values, got values = {values}")
    least = 3 * records + 2
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < least:
        raise ValueError(f"recall: prompt_tokens = {prompt_tokens!r} must be an integer >= {least} "
                         f"(3 per record and 2 for the query)")


def prompt(seed, index, *, prompt_tokens=32, records=4, keys=8, values=8, fillers=8) -> torch.Tensor:
    """Prompt `index` of the stream seeded by `seed`: 1-D LongTensor of exactly `prompt_tokens` ids.

    `records` records with distinct keys (drawn from `keys`) and distinct values (drawn from `values`), placed in
    order at random offsets among filler tokens; the query asks for one record's key, drawn uniformly."""
    _check(prompt_tokens, records, keys, values, fillers)
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (2**63))
    chosen = torch.randperm(keys, generator=gen)[:records] + FIRST_KEY
    answers = torch.randperm(values, generator=gen)[:records] + FIRST_KEY + keys
    body = prompt_tokens - 2
    ids = torch.randint(0, fillers, (body,), generator=gen) + FIRST_KEY + keys + values
    # records at sorted random starts, 3 tokens apart at least: place them among the body's free slots
    slots = body - 3 * records
    starts = torch.sort(torch.randint(0, slots + 1, (records,), generator=gen)).values + 3 * torch.arange(records)
    for start, key, value in zip(starts.tolist(), chosen.tolist(), answers.tolist(), strict=True):
        ids[start: start + 3] = torch.tensor([MARKER, key, value])
    asked = int(torch.randint(0, records, (), generator=gen))
    return torch.cat([ids, torch.tensor([QUERY, int(chosen[asked])])])


def records_of(prompt_ids) -> dict:
    """key -> value of every record "# k v" in the prompt's body (before the query)."""
    body = torch.as_tensor(prompt_ids).tolist()[:-2]
    return {body[i + 1]: body[i + 2] for i in range(len(body) - 2) if body[i] == MARKER}


def answer(prompt_ids) -> int:
    """The value the prompt's query asks for."""
    ids = torch.as_tensor(prompt_ids).tolist()
    if len(ids) < 5 or ids[-2] != QUERY:
        raise ValueError("recall: not a recall prompt (it must end with '? k')")
    table = records_of(ids)
    if ids[-1] not in table:
        raise ValueError(f"recall: the query's key {ids[-1]} has no record in the prompt")
    return table[ids[-1]]


def reward(prompt_ids, response_ids) -> float:
    """1.0 when the response begins with the queried key's value, else 0.0."""
    return first_token_reward(answer, prompt_ids, response_ids)


def batch(seed, first, count, **sizes):
    """(prompts [count, prompt_tokens], answers [count]) of prompts first .. first+count-1 of stream `seed`."""
    return batch_of(prompt, answer, seed, first, count, **sizes)


# -- shared by the tasks whose answer is one token (reread.py) ------------------------------------------------------
def first_token_reward(answer_of, prompt_ids, response_ids) -> float:
    """1.0 when the response begins with answer_of(prompt_ids), else 0.0."""
    response = torch.as_tensor(response_ids).tolist()
    return 1.0 if response and response[0] == answer_of(prompt_ids) else 0.0


def batch_of(prompt_of, answer_of, seed, first, count, **sizes):
    """(prompts [count, prompt_tokens], answers [count]): prompt_of(seed, index, **sizes) for the indices first ..
    first+count-1, and answer_of each."""
    prompts = torch.stack([prompt_of(seed, first + i, **sizes) for i in range(count)])
    return prompts, torch.tensor([answer_of(p) for p in prompts])


@torch.no_grad()
def accuracy(model, prompts, answers, chunk=256) -> float:
    """Greedy exact-match accuracy: the share of prompts whose most likely next token is the answer."""
    hits = 0
    for start in range(0, len(prompts), chunk):
        logits = model(input_ids=prompts[start: start + chunk]).logits[:, -1]
        hits += int((logits.argmax(-1) == answers[start: start + chunk]).sum())
    return hits / len(prompts)
