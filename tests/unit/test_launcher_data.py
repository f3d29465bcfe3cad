"""launch/train.py's pieces that need no launcher: JSONL groups (token ids and text), the per-step order over
data-parallel ranks (resumable from the step number alone), and the command line."""

import importlib.util
import json
import os

import pytest
import torch

from ds_longstraw.tools.data import GroupSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(tmp_path, records):
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class _CharTokenizer:
    """Stands in for a transformers tokenizer: one id per character."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) % 97 for c in text]}


def test_token_ids_and_text_records(tmp_path):
    path = _write(tmp_path, [
        {"prompt_ids": [1, 2, 3], "response_ids": [[4], [5, 6]], "rewards": [1.0, 0.0]},
        {"prompt": "abc", "responses": ["d", "ef"], "advantages": [0.5, -0.5],
         "old_logprobs": [[-1.0], [-2.0, -3.0]]},
    ])
    source = GroupSource(path, tokenizer=_CharTokenizer())
    first, second = source.group(0), source.group(1)
    assert first.prompt_ids.tolist() == [1, 2, 3] and [r.tolist() for r in first.response_ids] == [[4], [5, 6]]
    assert second.prompt_ids.tolist() == [ord(c) % 97 for c in "abc"]
    assert second.advantages.tolist() == [0.5, -0.5] and second.old_logprobs[1].tolist() == [-2.0, -3.0]


@pytest.mark.parametrize("record, words", [
    ({"prompt": "abc", "responses": ["d"], "rewards": [1.0]}, ["groups.jsonl:1", "no tokenizer"]),
    ({"prompt_ids": [1, 2], "response_ids": [[3]], "reward": [1.0]}, ["groups.jsonl:1", "unknown keys", "reward"]),
    ({"prompt_ids": [1, 2], "response_ids": [[3], [4]], "rewards": [1.0]}, ["groups.jsonl:1", "rewards has 1"]),
    ({"response_ids": [[3]], "rewards": [1.0]}, ["groups.jsonl:1", "prompt_ids"]),
])
def test_bad_records_name_the_line(tmp_path, record, words):
    source = GroupSource(_write(tmp_path, [record]))
    with pytest.raises(ValueError) as error:
        source.group(0)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_step_order_over_ranks_wraps_and_shuffles_per_epoch(tmp_path):
    path = _write(tmp_path, [{"prompt_ids": [i, i + 1], "response_ids": [[i]], "rewards": [0.0]} for i in range(5)])
    plain = GroupSource(path)
    # step s, rank r of 2, 2 groups per rank: flat positions (s*2 + r)*2 + j, wrapping every 5
    assert [plain.indices_for_step(s, r, 2, 2) for s in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 0],
                                                                                        [1, 2]]
    shuffled = GroupSource(path, shuffle_seed=3)
    epoch0 = [shuffled.indices_for_step(0, 0, 1, 1)[0]] + [shuffled.indices_for_step(s, 0, 1, 1)[0] for s in
                                                           range(1, 5)]
    assert sorted(epoch0) == list(range(5))
    assert shuffled.order(0) == GroupSource(path, shuffle_seed=3).order(0)  # a resumed run sees the same order
    assert shuffled.order(0) != shuffled.order(1) or shuffled.order(1) != shuffled.order(2)


def test_toy_groups_script_and_train_command_line(tmp_path):
    spec = importlib.util.spec_from_file_location("make_toy_groups", os.path.join(REPO, "launch", "make_toy_groups.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(tmp_path / "g.jsonl"), "--groups", "3", "--vocab", "50"])
    source = GroupSource(tmp_path / "g.jsonl")
    assert len(source) == 3 and all(int(source.group(i).prompt_ids.max()) < 50 for i in range(3))

    spec = importlib.util.spec_from_file_location("train", os.path.join(REPO, "launch", "train.py"))
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = train.parse_args(["--local_rank=1", "--config", "c.yaml", "train.max_steps=2"])
    assert args.config == "c.yaml" and args.overrides == ["train.max_steps=2"] and args.local_rank == 1
    with pytest.raises(SystemExit):
        train.parse_args(["--config", "c.yaml", "max_steps"])
    assert torch.is_tensor(source.group(0).prompt_ids)
