"""reread_hint: reread's second field, with a warm-up that has read second fields, but never bound one to its key.

The reread task (tasks/reread.py) asks GRPO for a record's second field w, which no warm-up prompt asked for; from
its warm-up (which answers v) both modes sat at chance for 50 steps (BENCHMARKS.md, "When exact mode pays"): a
one-bit reward did not find a readout the model had never formed. This variant gives the search a start without
teaching the thing the reward is after. The prompts are reread's (the same records for the same seed and index) with
one more query mark, "@", and the warm-up has two phases:

  1. "? k" -> v at `records` records (reread's warm-up): the lookup that binds a key to the token after it.
  2. the same mixed with "@ k" -> w at ONE record: a readout of "the record's second field" that needs no binding
     (one record, one second field), so it forms in ~150 steps; asked at two records it answers one of them
     (1/records); and "! k" at one record labelled with a random value, so "!" learns that its answer is a value
     and nothing about where it is (without these, the untrained mark's random embedding decided where GRPO
     started: 0.28 at 40 tokens in one build, 0.10 in another).
GRPO then asks "! k" -> w at `records` records and a longer prompt. To score, the policy must (a) read second fields
for "!" (the "@" readout is there to be reused: a start, not the answer), and beyond 1/records (b) match the key at
the second field's position, two tokens after it: nothing in the warm-up made that position hold its key ("?" bound
the first field's position, "@" and "!" never needed a key), and the causal mask keeps w out of v's position. (b) is
the change in how the prompt is represented; (a) alone lifts the policy from chance towards 1/records.

    token ids (recall's model has 26; the defaults use 17):
      0 "#" (record marker)   1 "?" (ask v)   2 "!" (ask w)   3 "@" (ask w, the warm-up's)   keys 4 .. 4+K-1
      values 4+K .. 4+K+V-1   fillers after

Levels a policy is measured against (exact-match accuracy on the first response token, "!" prompts):
  chance          1/values: a value token drawn uniformly, without reading the prompt
  random record   1/records: the second field of one of the prompt's records; a policy that reads second fields but
                  has not bound them to their keys lands here ("@" at two records after the warm-up: 0.50)
  above that      only by the binding (b)

Rewards are pure functions of (prompt_ids, response_ids), as a `rollout.reward` import path calls them:
  reward          1.0 when the response's first token is the field the query asks for (v for "?", w for "!", "@")
What it is not: a language task (no tokenizer).
"""

import json
import sys
import time
from pathlib import Path

import torch

from ds_longstraw.tasks import reread
from ds_longstraw.tasks.recall import accuracy, batch_of, first_token_reward  # noqa: F401 -- accuracy: shared

MARKER, ASK_FIRST, ASK_SECOND, ASK_HINT = 0, 1, 2, 3
FIRST_KEY = 4
ASKS = {"first": ASK_FIRST, "second": ASK_SECOND, "hint": ASK_HINT}
SHIFT = FIRST_KEY - reread.FIRST_KEY  # reread's ids of keys, values and fillers, one higher here

# The warm-up (`warm_checkpoint`, on recall's model configs/models/recall_qwen3_5.yaml), at 20-token prompts:
#   phase 1  reread's: "? k" only, 2 records, 400 AdamW steps of 64 prompts, lr 2e-3 (cosine)
#   phase 2  150 steps of 64 prompts at lr 1e-3 (cosine), each batch half "? k" at 2 records, a quarter "@ k" and a
#            quarter "! k" (random labels) at 1 record (HintMix)
# Measured (held-out, 256 prompts, at 20 / 40 tokens): "? k" 1.000 / 1.000; "@ k" at one record 1.000 / 0.965; "@ k" at
# two records 0.512 / 0.496 (one of the two second fields: no binding); "! k" at two records 0.199 / 0.231 (chance
# 0.167: 0.231 is 2.7 binomial sd above it, "!" leaning a little on "@"'s readout). Built in 95 s of one thread at a
# load of ~4, 205 s at a load of 6.
WARMUP_SIZES = {"prompt_tokens": 20, "records": 2, "keys": 4, "values": 6, "fillers": 3}
WARMUP = {"steps": 400, "lr": 2e-3, "batch_size": 64, "seed": 0}
HINT_PHASE = {"steps": 150, "lr": 1e-3, "batch_size": 64, "seed": 1}
WARMUP_EVAL_LENGTHS = (20, 40)
# The CI's warm-up (tests/launcher/test_reread_grpo.py, built from nothing on every run): phase 2 alone, HintMix from
# random weights (seed 1), 150 steps of 32 prompts at lr 2e-3, on recall's model. It forms the "@" readout at one
# record without phase 1's "? k" lookup (that stays near 1/records). Measured (held-out, 256 prompts, at 40 tokens):
# "@ k" at one record 0.980, at two 0.457; "? k" 0.488; "! k" at two records 0.219 (the study's warm-up: 0.965, 0.496,
# 1.000, 0.231): the start GRPO needs, in 150 of the study's 550 steps, at half the batch.
CI_PHASES = (None, {"steps": 150, "lr": 2e-3, "batch_size": 32, "seed": 1})
# The GDN-heavy model (three Gated DeltaNet layers, then one attention layer), in configs/models: warm_checkpoint's
# shape for the study's reread_hint_gdn variant. The same recipe on it (a probe at a load of ~4, 177 s): "? k" 1.000 /
# 1.000; "@ k" at one record 1.000 / 1.000, at two 0.590 / 0.563; "! k" at two records 0.168 / 0.258.
GDN_SHAPE = "recall_qwen3_5_gdn.yaml"
MIX = "half '? k' at the sizes' records, a quarter '@ k' and a quarter '! k' (random labels) at one record"  # HintMix


def vocab_size(keys, values, fillers) -> int:
    """Ids the layout uses for `keys` keys, `values` values and `fillers` filler tokens."""
    return FIRST_KEY + keys + values + fillers


def prompt(seed, index, *, prompt_tokens=40, records=2, keys=4, values=6, fillers=3, ask="second") -> torch.Tensor:
    """Prompt `index` of the stream seeded by `seed`: reread.prompt's records and query key (the same for the same
    seed and index, whatever `ask`), in this layout's ids, with the query mark of `ask` ("?", "!" or "@")."""
    if ask not in ASKS:
        raise ValueError(f"reread_hint: ask must be one of {sorted(ASKS)}, got {ask!r}")
    try:
        ids = reread.prompt(seed, index, prompt_tokens=prompt_tokens, records=records, keys=keys, values=values,
                            fillers=fillers)
    except ValueError as error:  # the same sizes are refused for the same reasons: name this task
        raise ValueError(str(error).replace("reread:", "reread_hint:", 1)) from None
    ids = torch.where(ids >= reread.FIRST_KEY, ids + SHIFT, ids)
    ids[-2] = ASKS[ask]
    return ids


def records_of(prompt_ids) -> dict:
    """key -> (v, w) of every record "# k v w" in the prompt's body (before the query)."""
    body = torch.as_tensor(prompt_ids).tolist()[:-2]
    return {body[i + 1]: (body[i + 2], body[i + 3]) for i in range(len(body) - 3) if body[i] == MARKER}


def answer(prompt_ids) -> int:
    """The field the prompt's query asks for: the key's v after "?", its w after "!" or "@"."""
    ids = torch.as_tensor(prompt_ids).tolist()
    if len(ids) < reread.RECORD + 2 or ids[-2] not in (ASK_FIRST, ASK_SECOND, ASK_HINT):
        raise ValueError("reread_hint: not a reread_hint prompt (it must end with '? k', '! k' or '@ k')")
    table = records_of(ids)
    if ids[-1] not in table:
        raise ValueError(f"reread_hint: the query's key {ids[-1]} has no record in the prompt")
    return table[ids[-1]][0 if ids[-2] == ASK_FIRST else 1]


def reward(prompt_ids, response_ids) -> float:
    """1.0 when the response begins with the field the query asks for, else 0.0."""
    return first_token_reward(answer, prompt_ids, response_ids)


def batch(seed, first, count, **sizes):
    """(prompts [count, prompt_tokens], answers [count]) of prompts first .. first+count-1 of stream `seed`."""
    return batch_of(prompt, answer, seed, first, count, **sizes)


class HintMix:
    """The warm-up's phase 2 as a recall_warmup task: batch(seed, first, count, **sizes) is half "? k" at the sizes'
    records (prompts first ..), then a quarter "@ k" and a quarter "! k" at one record, the "!" prompts labelled with a
    value drawn uniformly at random (reproducibly, from seed and first): a label that says nothing about the prompt,
    so "!" learns that its answer is a value, and no readout."""

    @staticmethod
    def batch(seed, first, count, **sizes):
        sizes = {k: v for k, v in sizes.items() if k != "ask"}
        hint = second = count // 4
        head = count - hint - second
        p1, a1 = batch(seed, first, head, **sizes, ask="first")
        p2, a2 = batch(seed, first + head, hint, **{**sizes, "records": 1}, ask="hint")
        p3, _ = batch(seed, first + head + hint, second, **{**sizes, "records": 1}, ask="second")
        gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(first)) % (2**63))
        a3 = FIRST_KEY + sizes["keys"] + torch.randint(0, sizes["values"], (second,), generator=gen)
        return torch.cat([p1, p2, p3]), torch.cat([a1, a2, a3])


def warmup_levels(model, lengths=WARMUP_EVAL_LENGTHS, count=256) -> dict:
    """{"<ask>@<records>": {length: held-out accuracy}} of the asks the warm-up and GRPO use (recall_warmup's
    held-out stream)."""
    from ds_longstraw.tasks import recall_warmup

    out = {}
    for ask, records in (("first", 2), ("hint", 1), ("hint", 2), ("second", 2)):
        sets = recall_warmup.held_out({**WARMUP_SIZES, "records": records, "ask": ask}, lengths, count,
                                      task=sys.modules[__name__])
        out[f"{ask}@{records}"] = {str(n): round(a, 4) for n, a in recall_warmup.evaluate(model, sets).items()}
    return out


def warm_checkpoint(directory, log=print, shape=None, phases=(WARMUP, HINT_PHASE), eval_lengths=WARMUP_EVAL_LENGTHS):
    """(path, info) of the two-phase warm-up checkpoint (module docstring), built into `directory` on first use
    (save_pretrained, with recipe.json) and reused while the recipe is the same; info: the levels of
    `warmup_levels`, the seconds it took to build (0 when reused) and the recipe. shape: the model's shape config
    (default recall_warmup.SHAPE; GDN_SHAPE names the GDN-heavy variant, a file in configs/models). phases: the two
    phases' warm_up arguments (steps, lr, batch_size, seed); a phase of None is left out (CI_PHASES: phase 2 only).
    eval_lengths: the prompt lengths the levels are measured at."""
    from ds_longstraw.tasks import recall_warmup

    directory = Path(directory)
    shape = recall_warmup.SHAPE if shape is None else Path(shape)
    if not shape.is_absolute():
        shape = recall_warmup.SHAPE.parent / shape
    first, second = phases
    recipe = {"shape": shape.name, "shape_text": shape.read_text(), "sizes": WARMUP_SIZES,
              "phase_1": first, "phase_2": second, "phase_2_mix": MIX, "layout": "reread_hint"}
    if tuple(eval_lengths) != WARMUP_EVAL_LENGTHS:  # the default's recipe predates the argument: it stays as it was
        recipe["eval_lengths"] = list(eval_lengths)
    stamp = directory / "recipe.json"
    start = time.perf_counter()
    if not (stamp.exists() and json.loads(stamp.read_text()).get("recipe") == recipe):
        model = None
        if first is not None:
            model, _ = recall_warmup.warm_up(shape, {**WARMUP_SIZES, "ask": "first"}, **first,
                                             task=sys.modules[__name__], log=log)
            model.train()
        model, _ = recall_warmup.warm_up(shape if model is None else None, WARMUP_SIZES, **second, task=HintMix,
                                         init=model, log=log)
        levels = warmup_levels(model, lengths=eval_lengths)
        directory.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(directory)
        stamp.write_text(json.dumps({"recipe": recipe, "levels": levels}, indent=1))
        log(f"[warm-up] reread_hint levels {levels}")
    levels = json.loads(stamp.read_text())["levels"]
    return directory, {"levels": levels, "build_seconds": round(time.perf_counter() - start, 1),
                       "short_length": WARMUP_SIZES["prompt_tokens"],
                       "accuracy_short": levels["first@2"].get(str(WARMUP_SIZES["prompt_tokens"])),
                       "recipe": {k: v for k, v in recipe.items() if k != "shape_text"}}
