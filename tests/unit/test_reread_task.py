"""The reread task (ds_longstraw/tasks/reread.py): its layout, its rewards and the sizes it refuses.

  layout:   prompt(seed, i) is reproducible, exactly prompt_tokens long; its records "# k v w" have distinct keys and
            2 x records distinct field values, never filler; the query is "? k" (ask="first") or "! k"
            (ask="second") for one record's key; the two asks of one index differ only in the query mark
  rewards:  reward == 1 exactly when the response begins with the asked field: v after "?", w after "!"; v is never
            right for "!" (the warm-up's habit scores 0)
  sizes:    sizes that cannot fit are ValueErrors naming the size and its value
GRPO on this task (bench/exact_pays_study.py) left the warm-up's answer but rose no higher than chance in either
mode; the learning test is the variant's (tasks/reread_hint.py, tests/launcher/test_reread_grpo.py).
"""

import pytest
import torch

from ds_longstraw.tasks import reread

SIZES = dict(prompt_tokens=40, records=4, keys=8, values=10, fillers=5)


def test_prompts_are_reproducible_and_well_formed():
    a, b = reread.prompt(3, 7, **SIZES), reread.prompt(3, 7, **SIZES)
    assert torch.equal(a, b) and a.dtype == torch.long and a.numel() == 40
    assert not torch.equal(a, reread.prompt(3, 8, **SIZES)) and not torch.equal(a, reread.prompt(4, 7, **SIZES))
    # sizes that are not the defaults' multiples: 3 records, 7 values (6 used), a 23-token prompt (9 filler tokens)
    sizes = dict(prompt_tokens=23, records=3, keys=5, values=7, fillers=3)
    first_value, first_filler = reread.FIRST_KEY + 5, reread.FIRST_KEY + 12
    for index in range(50):
        second = reread.prompt(0, index, **sizes)
        first = reread.prompt(0, index, **sizes, ask="first")
        assert second.numel() == 23 and int(second[-2]) == reread.ASK_SECOND and int(first[-2]) == reread.ASK_FIRST
        assert torch.equal(first[:-2], second[:-2]) and first[-1] == second[-1]  # only the mark differs
        table = reread.records_of(second)
        fields = [f for pair in table.values() for f in pair]
        assert len(table) == 3 and len(set(fields)) == 6 and int(second[-1]) in table
        assert all(reread.FIRST_KEY <= k < first_value for k in table)
        assert all(first_value <= f < first_filler for f in fields)
        assert int(second.max()) < reread.vocab_size(5, 7, 3)
        body = second[:-2]
        assert int((body == reread.MARKER).sum()) == 3  # a marker starts each record, and only records
        assert int(((body >= reread.FIRST_KEY) & (body < first_filler)).sum()) == 9  # no key or field as filler
        assert not bool(((body == reread.ASK_FIRST) | (body == reread.ASK_SECOND)).any())  # query marks at the end
    # the default sizes and the warm-up's fit the recall task's model (configs/models/recall_qwen3_5.yaml: 26 ids)
    assert reread.vocab_size(4, 6, 3) == 16 and int(reread.prompt(0, 0).max()) < 16
    assert int(reread.prompt(0, 0, **reread.WARMUP_SIZES).max()) < 16


def test_records_fit_exactly_at_the_least_length():
    ids = reread.prompt(1, 2, prompt_tokens=4 * 3 + 2, records=3, keys=3, values=6, fillers=1)
    assert ids[:-2].view(3, 4)[:, 0].tolist() == [reread.MARKER] * 3  # no room for filler: records back to back
    assert len(reread.records_of(ids)) == 3


@pytest.mark.parametrize("sizes, words", [
    (dict(records=9, keys=8), ["records = 9", "keys = 8"]),
    (dict(records=4, values=7), ["values = 7", "8 distinct"]),
    (dict(prompt_tokens=17, records=4), ["prompt_tokens = 17", ">= 18"]),
    (dict(fillers=1.5), ["fillers", "1.5"]),
    (dict(keys=True), ["keys", "True"]),
    (dict(ask="third"), ["ask", "'third'"]),
], ids=["records-above-keys", "two-fields-above-values", "prompt-too-short", "fillers-not-int", "keys-bool",
        "ask-unknown"])
def test_bad_sizes_name_the_size(sizes, words):
    with pytest.raises(ValueError) as caught:
        reread.prompt(0, 0, **{**SIZES, **sizes})
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_rewards():
    ids = reread.prompt(5, 1, **SIZES)
    v, w = reread.records_of(ids)[int(ids[-1])]
    assert reread.answer(ids) == w
    assert reread.reward(ids, [w]) == 1.0 and reread.reward(ids, torch.tensor([w, 0, 0])) == 1.0
    assert reread.reward(ids, [v]) == 0.0 and reread.reward(ids, []) == 0.0  # the first field is wrong for "!"
    assert reread.reward(ids, [reread.MARKER, w]) == 0.0  # it must BEGIN with the field
    other = next(pair[1] for key, pair in reread.records_of(ids).items() if key != int(ids[-1]))
    assert reread.reward(ids, [other]) == 0.0  # another record's second field
    asked_first = torch.cat([ids[:-2], torch.tensor([reread.ASK_FIRST]), ids[-1:]])
    assert reread.answer(asked_first) == v and reread.reward(asked_first, [v]) == 1.0
    assert reread.reward(asked_first, [w]) == 0.0
    # by hand: filler 21, records 3 -> (11, 12) and 4 -> (13, 14), then "! 4" and "? 4"
    hand = torch.tensor([21, 0, 3, 11, 12, 21, 0, 4, 13, 14, 2, 4])
    assert reread.records_of(hand) == {3: (11, 12), 4: (13, 14)}
    assert reread.reward(hand, [14]) == 1.0 and reread.reward(hand, [13]) == 0.0 and reread.reward(hand, [12]) == 0.0
    hand[-2] = reread.ASK_FIRST
    assert reread.reward(hand, [13]) == 1.0 and reread.reward(hand, [14]) == 0.0
    with pytest.raises(ValueError, match="not a reread prompt"):
        reread.reward(torch.arange(10) + 3, [1])
    with pytest.raises(ValueError, match="key 9 has no record"):
        reread.answer(torch.tensor([21, 0, 3, 11, 12, 2, 9]))


def test_batch_answers_are_the_asked_fields():
    prompts, answers = reread.batch(2, 10, 6, **SIZES)
    assert prompts.shape == (6, 40)
    for i in range(6):
        assert torch.equal(prompts[i], reread.prompt(2, 10 + i, **SIZES))
        assert int(answers[i]) == reread.records_of(prompts[i])[int(prompts[i, -1])][1]
