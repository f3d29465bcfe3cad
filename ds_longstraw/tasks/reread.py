"""reread: a field of the prompt's records that the warm-up never asked for, the task of the exact-or-detached study.

A prompt is filler tokens with `records` records "# k v w" (a marker, a key, and two fields) at random places, then
a query for one record's key: "? k" asks for the key's first field v (the token after the key), "! k" for its second
field w (the token two after the key). The supervised warm-up (recall_warmup.warm_up with ask="first") only ever
asks "? k"; GRPO asks "! k" (ask="second"). The warm-up's lookup finds the record whose key matches at the position
AFTER the key; nothing it learned makes the position two after the key say which key it follows, and the causal mask
keeps w out of v's position. So the reward needs something the prompt's positions were not taught to hold: the
second field's position must come to carry "the key two back" (or the lookup must take a second hop), a change in
how the prompt is represented, not only in how it is read.

Why detached mode can still learn it, in principle: its gradient reaches only the query's own positions (for a
one-token answer, the last prompt position's forward over the prompt's keys, values and recurrent state as
constants). The shared weights still move, and the next step's capture sees them, so the prompt's positions change
as a side effect of what helps the query; and the query can learn to read whatever the positions already hold (the
Gated DeltaNet layers' short convolution mixes each position with the three before it). Exact mode also sends each
record's positions the gradient of how they are matched. Which matters, and how much, is what the study measures.

    token ids (the model's vocabulary must hold `vocab_size(...)` ids; recall's model has 26, the defaults use 16):
      0 "#" (record marker)   1 "?" (ask v)   2 "!" (ask w)   keys 3 .. 3+K-1   values 3+K .. 3+K+V-1   fillers after

Levels a policy is measured against (exact-match accuracy on the first response token, "!" prompts):
  chance          1/values: a value token drawn uniformly, without reading the prompt
  random record   1/records: the second field of one of the prompt's records, not the queried one
  first field     the warm-up's habit, answering v for "! k", scores 0: every record's v and w are distinct values

Rewards are pure functions of (prompt_ids, response_ids), as a `rollout.reward` import path calls them:
  reward          1.0 when the response's first token is the field the query asks for (v for "?", w for "!")
What it is not: a language task (no tokenizer). Keys and values never occur as filler; the query appears once, at
the end.
"""

import torch

# accuracy: greedy exact match on the last position, shared
from ds_longstraw.tasks.recall import accuracy, batch_of, first_token_reward  # noqa: F401

MARKER, ASK_FIRST, ASK_SECOND = 0, 1, 2
FIRST_KEY = 3
ASKS = {"first": ASK_FIRST, "second": ASK_SECOND}
RECORD = 4  # tokens per record: "#", k, v, w

# The supervised warm-up (recall_warmup.warm_up on recall's model, configs/models/recall_qwen3_5.yaml): "? k" only, at
# 20-token prompts of 2 records, 400 AdamW steps of 64 prompts (exact match 1.0 at 20 tokens from step ~100). With 120
# or 200 steps (the cosine decay starting sooner) the lookup had not formed: 0.5, one of the two records' v.
WARMUP_SIZES = {"prompt_tokens": 20, "records": 2, "keys": 4, "values": 6, "fillers": 3, "ask": "first"}
WARMUP = {"steps": 400, "lr": 2e-3, "batch_size": 64, "seed": 0}
WARMUP_EVAL_LENGTHS = (20, 40, 160)  # its own length, the GRPO run config's, and the study's longer one


def vocab_size(keys, values, fillers) -> int:
    """Ids the layout uses for `keys` keys, `values` values and `fillers` filler tokens."""
    return FIRST_KEY + keys + values + fillers


def _check(prompt_tokens, records, keys, values, fillers, ask):
    for name, value, least in (("records", records, 1), ("keys", keys, 1), ("values", values, 2),
                               ("fillers", fillers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"reread: {name} must be an integer >= {least}, got {value!r}")
    if records > keys:
        raise ValueError(f"reread: records = {records} needs as many distinct keys, got keys = {keys}")
    if 2 * records > values:
        raise ValueError(f"reread: records = {records} needs {2 * records} distinct values (two fields each), "
                         f"got values = {values}")
    least = RECORD * records + 2
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < least:
        raise ValueError(f"reread: prompt_tokens = {prompt_tokens!r} must be an integer >= {least} "
                         f"({RECORD} per record and 2 for the query)")
    if ask not in ASKS:
        raise ValueError(f"reread: ask must be one of {sorted(ASKS)}, got {ask!r}")


def prompt(seed, index, *, prompt_tokens=40, records=2, keys=4, values=6, fillers=3, ask="second") -> torch.Tensor:
    """Prompt `index` of the stream seeded by `seed`: 1-D LongTensor of exactly `prompt_tokens` ids.

    `records` records with distinct keys (drawn from `keys`) and 2 x records distinct field values (drawn from
    `values`), placed in order at random offsets among filler tokens; the query ("?" for ask="first", "!" for
    ask="second") names one record's key, drawn uniformly. The records and the key asked depend on (seed, index)
    only, not on `ask`: the same index asked both ways is the same prompt but for its query mark."""
    _check(prompt_tokens, records, keys, values, fillers, ask)
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (2**63))
    chosen = torch.randperm(keys, generator=gen)[:records] + FIRST_KEY
    fields = (torch.randperm(values, generator=gen)[:2 * records] + FIRST_KEY + keys).view(records, 2)
    body = prompt_tokens - 2
    ids = torch.randint(0, fillers, (body,), generator=gen) + FIRST_KEY + keys + values
    # records at sorted random starts, RECORD tokens apart at least: place them among the body's free slots
    slots = body - RECORD * records
    starts = torch.sort(torch.randint(0, slots + 1, (records,), generator=gen)).values + RECORD * torch.arange(records)
    for start, key, (first, second) in zip(starts.tolist(), chosen.tolist(), fields.tolist(), strict=True):
        ids[start: start + RECORD] = torch.tensor([MARKER, key, first, second])
    asked = int(torch.randint(0, records, (), generator=gen))
    return torch.cat([ids, torch.tensor([ASKS[ask], int(chosen[asked])])])


def records_of(prompt_ids) -> dict:
    """key -> (v, w) of every record "# k v w" in the prompt's body (before the query)."""
    body = torch.as_tensor(prompt_ids).tolist()[:-2]
    return {body[i + 1]: (body[i + 2], body[i + 3]) for i in range(len(body) - 3) if body[i] == MARKER}


def answer(prompt_ids) -> int:
    """The field the prompt's query asks for: the key's v after "?", its w after "!"."""
    ids = torch.as_tensor(prompt_ids).tolist()
    if len(ids) < RECORD + 2 or ids[-2] not in (ASK_FIRST, ASK_SECOND):
        raise ValueError("reread: not a reread prompt (it must end with '? k' or '! k')")
    table = records_of(ids)
    if ids[-1] not in table:
        raise ValueError(f"reread: the query's key {ids[-1]} has no record in the prompt")
    return table[ids[-1]][0 if ids[-2] == ASK_FIRST else 1]


def reward(prompt_ids, response_ids) -> float:
    """1.0 when the response begins with the field the query asks for, else 0.0."""
    return first_token_reward(answer, prompt_ids, response_ids)


def batch(seed, first, count, **sizes):
    """(prompts [count, prompt_tokens], answers [count]) of prompts first .. first+count-1 of stream `seed`."""
    return batch_of(prompt, answer, seed, first, count, **sizes)
