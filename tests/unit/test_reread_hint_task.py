"""The reread_hint task (ds_longstraw/tasks/reread_hint.py): its layout, its rewards, the warm-up's batches and the
sizes it refuses.

  layout:   prompt(seed, i, ask) == reread.prompt(seed, i) with keys, values and fillers one id higher and the
            query mark of `ask` ("?" 1, "!" 2, "@" 3); the three asks of one index differ only in the mark
  rewards:  reward == 1 exactly when the response begins with the asked field: v after "?", w after "!" and "@"
  warm-up:  HintMix.batch is half "? k" at the sizes' records, a quarter "@ k" and a quarter "! k" at one record,
            the "!" prompts with a random value for a label; warm_checkpoint builds once per recipe (a phase left
            out, another shape) and reuses it while the recipe is the same
  sizes:    sizes that cannot fit are ValueErrors naming this task, the size and its value
The learning test (GRPO from the warm-up rises above chance, exact mode) is tests/launcher/test_reread_grpo.py.
"""

import pytest
import torch

from ds_longstraw.tasks import reread, reread_hint

SIZES = dict(prompt_tokens=23, records=3, keys=5, values=7, fillers=3)  # not the defaults' multiples


def test_prompts_are_reread_prompts_in_their_own_ids():
    first_value, first_filler = reread_hint.FIRST_KEY + 5, reread_hint.FIRST_KEY + 12
    for index in range(40):
        base = reread.prompt(0, index, **SIZES)
        asks = {ask: reread_hint.prompt(0, index, **SIZES, ask=ask) for ask in reread_hint.ASKS}
        for ask, ids in asks.items():
            assert ids.dtype == torch.long and ids.numel() == 23 and int(ids[-2]) == reread_hint.ASKS[ask]
            assert torch.equal(ids[:-2], torch.where(base[:-2] >= reread.FIRST_KEY, base[:-2] + 1, base[:-2]))
            assert int(ids[-1]) == int(base[-1]) + 1
        table = reread_hint.records_of(asks["second"])
        fields = [f for pair in table.values() for f in pair]
        assert len(table) == 3 and len(set(fields)) == 6 and int(asks["second"][-1]) in table
        assert all(reread_hint.FIRST_KEY <= k < first_value for k in table)
        assert all(first_value <= f < first_filler for f in fields)
        body = asks["second"][:-2]
        assert not bool((body == reread_hint.ASK_HINT).any())  # "@" only as the query's mark
        assert int(asks["second"].max()) < reread_hint.vocab_size(5, 7, 3)
    # the defaults and the warm-up's sizes fit the recall task's model (configs/models/recall_qwen3_5.yaml: 26 ids)
    assert reread_hint.vocab_size(4, 6, 3) == 17 and int(reread_hint.prompt(0, 0).max()) < 17
    assert int(reread_hint.prompt(0, 0, **reread_hint.WARMUP_SIZES, ask="hint").max()) < 17


def test_rewards():
    ids = reread_hint.prompt(5, 1, prompt_tokens=40, records=2)
    v, w = reread_hint.records_of(ids)[int(ids[-1])]
    assert reread_hint.answer(ids) == w
    assert reread_hint.reward(ids, [w]) == 1.0 and reread_hint.reward(ids, torch.tensor([w, 0])) == 1.0
    assert reread_hint.reward(ids, [v]) == 0.0 and reread_hint.reward(ids, []) == 0.0
    assert reread_hint.reward(ids, [reread_hint.MARKER, w]) == 0.0  # it must BEGIN with the field
    other = next(pair[1] for key, pair in reread_hint.records_of(ids).items() if key != int(ids[-1]))
    assert reread_hint.reward(ids, [other]) == 0.0  # the other record's second field
    # by hand: filler 22, records 4 -> (12, 13) and 5 -> (14, 15), then each mark asking key 5
    hand = torch.tensor([22, 0, 4, 12, 13, 22, 0, 5, 14, 15, 2, 5])
    assert reread_hint.records_of(hand) == {4: (12, 13), 5: (14, 15)}
    for mark, right in ((reread_hint.ASK_SECOND, 15), (reread_hint.ASK_HINT, 15), (reread_hint.ASK_FIRST, 14)):
        hand[-2] = mark
        assert reread_hint.reward(hand, [right]) == 1.0 and reread_hint.reward(hand, [29 - right]) == 0.0
    with pytest.raises(ValueError, match="not a reread_hint prompt"):
        reread_hint.reward(torch.arange(10) + 4, [1])
    with pytest.raises(ValueError, match="key 9 has no record"):
        reread_hint.answer(torch.tensor([22, 0, 4, 12, 13, 2, 9]))


def test_warmup_mix():
    """HintMix: half "? k" at the sizes' records, a quarter "@ k" and a quarter "! k" at one record, the latter's
    label a value drawn at random (reproducibly), not the prompt's w."""
    sizes = dict(prompt_tokens=20, records=2, keys=4, values=6, fillers=3)
    prompts, answers = reread_hint.HintMix.batch(3, 64, 10, **sizes)
    again, answers_again = reread_hint.HintMix.batch(3, 64, 10, **sizes)
    assert prompts.shape == (10, 20) and torch.equal(prompts, again) and torch.equal(answers, answers_again)
    first_value = reread_hint.FIRST_KEY + 4
    for i in range(10):
        mark, table = int(prompts[i, -2]), reread_hint.records_of(prompts[i])
        if i < 6:  # count - 2 * (count // 4) "? k" at two records: prompts 64 .. 69 of the stream
            assert mark == reread_hint.ASK_FIRST and len(table) == 2
            assert torch.equal(prompts[i], reread_hint.prompt(3, 64 + i, prompt_tokens=20, ask="first"))
            assert int(answers[i]) == table[int(prompts[i, -1])][0]
        elif i < 8:  # "@ k" at one record, prompts 70, 71
            assert mark == reread_hint.ASK_HINT and len(table) == 1
            assert int(answers[i]) == table[int(prompts[i, -1])][1]
        else:  # "! k" at one record, prompts 72, 73, with a random value for a label
            assert mark == reread_hint.ASK_SECOND and len(table) == 1
            assert first_value <= int(answers[i]) < first_value + 6
    # over many prompts the "!" labels are the right w about 1/values of the time, no more: they say nothing
    prompts, answers = reread_hint.HintMix.batch(0, 0, 2400, **sizes)
    asked = prompts[:, -2] == reread_hint.ASK_SECOND
    hits = sum(int(a) == reread_hint.answer(p) for p, a in zip(prompts[asked], answers[asked], strict=True))
    assert int(asked.sum()) == 600 and abs(hits / 600 - 1 / 6) < 4 * (1 / 6 * 5 / 6 / 600) ** 0.5  # 4 sd


@pytest.mark.parametrize("sizes, words", [
    (dict(records=9, keys=8), ["reread_hint:", "records = 9", "keys = 8"]),
    (dict(records=4, values=7), ["reread_hint:", "values = 7", "8 distinct"]),
    (dict(prompt_tokens=17, records=4), ["reread_hint:", "prompt_tokens = 17", ">= 18"]),
    (dict(fillers=0), ["reread_hint:", "fillers", "0"]),
    (dict(ask="third"), ["reread_hint:", "ask", "'third'"]),
], ids=["records-above-keys", "two-fields-above-values", "prompt-too-short", "no-fillers", "ask-unknown"])
def test_bad_sizes_name_the_size(sizes, words):
    with pytest.raises(ValueError) as caught:
        reread_hint.prompt(0, 0, **{**dict(prompt_tokens=40, records=4, keys=8, values=10, fillers=5), **sizes})
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_warm_checkpoint_phases_shape_and_reuse(tmp_path):
    """warm_checkpoint with a phase left out (CI_PHASES' form) builds once, writes its recipe, and is reused while the
    recipe is the same; another shape (GDN_SHAPE, named as in configs/models) is another recipe and is rebuilt. Two
    steps of 4 prompts: this checks the bookkeeping, not the learning (tests/launcher/test_reread_grpo.py)."""
    import json

    torch.set_num_threads(1)
    phases = (None, {"steps": 2, "lr": 1e-3, "batch_size": 4, "seed": 1})
    build = dict(log=lambda line: None, phases=phases, eval_lengths=(23,))
    directory, info = reread_hint.warm_checkpoint(tmp_path / "w", **build)
    recipe = json.loads((directory / "recipe.json").read_text())["recipe"]
    assert recipe["phase_1"] is None and recipe["phase_2"] == phases[1] and recipe["eval_lengths"] == [23]
    assert recipe["shape"] == "recall_qwen3_5.yaml" and set(info["levels"]) == {"first@2", "hint@1", "hint@2",
                                                                                "second@2"}
    assert all(set(by_length) == {"23"} for by_length in info["levels"].values())
    stamp = (directory / "recipe.json").stat().st_mtime_ns
    _, again = reread_hint.warm_checkpoint(tmp_path / "w", **build)  # reused: nothing rewritten
    assert (directory / "recipe.json").stat().st_mtime_ns == stamp and again["levels"] == info["levels"]
    _, other = reread_hint.warm_checkpoint(tmp_path / "w", shape=reread_hint.GDN_SHAPE, **build)
    assert json.loads((directory / "recipe.json").read_text())["recipe"]["shape"] == "recall_qwen3_5_gdn.yaml"
    assert other["recipe"]["shape"] == "recall_qwen3_5_gdn.yaml"
