"""generate_from_capture with TRL's tool loop (`tools=`, `environment_factory`) against TRL's own trainer.

Chain: LongStrawGRPOTrainer(generate_from_capture=True) decodes every turn from the captured prompt, answering tool
calls through integrations/trl/tools.py (TRL's parse_response, its tool-call rules, its _get_tool_suffix_ids), and
trains the step on the kept capture; TRL's own GRPOTrainer, whose generation only replays those turns
(tests/trl_tools.replaying_trainer: each _generate_single_turn call returns the recorded turn that follows the
prefix it is asked about), runs its own tool loop over them: the same completions, tool masks, messages, tool
metrics, and the same weights after two SGD steps.

How the loop is made to run (tests/trl_tools.py): a word-level tokenizer under Qwen3's chat template (as TRL ships
it) in which each whole tool call is one token, and a tiny qwen3_5 whose LM head carries a unigram bias towards
<|im_end|> (TRL's eos: a turn's end) and those call tokens, sampled at temperature 1 with the trainer's seeds: rows
with no call, with calls on two turns, failing calls (a division by zero, an unknown tool) and results TRL drops
past max_completion_length all occur (asserted).

Tolerance 1e-8 relative on the weights' update, float64 end to end (tests/trl_runs.in_float64), as in
test_trl_trainer.py: the two sum the same float64 terms in another order (measured ~1e-12 here), while a tool
message's token in the loss, or a dropped result kept, moves it by far more than that.
"""

import os

import pytest

from ds_longstraw.integrations.trl import LongStrawGRPOTrainer
from tests import trl_runs, trl_tools

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TOLERANCE = 1e-8
EXACT = {"prefix_grad": "exact"}

CASES = {
    # the environment's `count` beside two standalone tools; no iteration limit; results past 96 tokens dropped
    "tools-and-environment": dict(tools=True, environment=True, max_completion_length=96),
    # max_tool_calling_iterations 1: a second turn's calls are not run (generate's max_turns)
    "one-iteration-tools-only": dict(tools=True, environment=False, max_completion_length=40,
                                     max_tool_calling_iterations=1),
    # two prompts per generation batch (4 x 2 rows): each prompt's samples map to its own rows (and environments);
    # the process holds two prompts, so the step captures again (tools.py is the same either way)
    "two-prompts-per-batch": dict(tools=True, environment=True, max_completion_length=64,
                                  per_device_train_batch_size=4),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trl_tools") / "model")
    trl_tools.save_driven_model(path)
    return path, trl_runs.initial_weights(path)


@pytest.mark.parametrize("name", list(CASES))
def test_tool_loop_from_capture_equals_trl(checkpoint, tmp_path, name):
    path, initial = checkpoint
    # one prompt per generation batch (2 x 2 rows = its 4 generations), so its capture is kept; two steps
    case = dict(loss_type="dapo", max_steps=2, **{"per_device_train_batch_size": 2, **CASES[name]})
    kept = case["per_device_train_batch_size"] == 2
    ours_out, reused, ours_logs = [], [], []
    ours = trl_tools.train(LongStrawGRPOTrainer, path, str(tmp_path / "ours"),
                  trainer_kwargs={"longstraw": EXACT, "generate_from_capture": True},
                  on_trainer=lambda t: trl_tools.recording(t, ours_out, reused), logs=ours_logs, **case)
    # every group trained on the capture its samples decoded from (where the process held one prompt)
    assert reused == [kept] * (2 if kept else 4)
    assert [e["longstraw/capture_reused"] for e in ours_logs if "longstraw/capture_reused" in e] == [float(kept)] * 2

    batches = [(out[0], out[1], out[2]) for out in ours_out]  # prompt ids, completion ids, tool mask per row
    theirs_out, theirs_logs = [], []
    theirs = trl_tools.train(trl_tools.replaying_trainer(batches, theirs_out), path, str(tmp_path / "trl"),
                    logs=theirs_logs, **case)

    # TRL's own loop over the same turns built the same completions, masks and messages
    for (p1, c1, m1, msgs1, *_), (p2, c2, m2, msgs2, *_) in zip(ours_out, theirs_out, strict=True):
        assert (p1, c1, m1) == (p2, c2, m2)
        assert msgs1 == msgs2
    for key in ("tools/call_frequency", "tools/failure_frequency", "completions/mean_length",
                "completions/clipped_ratio"):
        assert [e.get(key) for e in ours_logs] == [e.get(key) for e in theirs_logs], key

    # the cases exercise the loop (module docstring)
    masks = [mask for out in ours_out for mask in out[2]]
    runs = [trl_tools.observation_runs(m) for m in masks]
    messages = [msgs for out in ours_out for msgs in out[3]]
    assert 0 in runs, runs  # a row that called no tool (or whose only result was dropped)
    assert any(r >= 1 for r in runs), runs
    assert any("error" in m["content"] for msgs in messages for m in msgs if m["role"] == "tool")  # a failure
    if "max_tool_calling_iterations" in case:
        assert max(runs) == 1
        # a row whose second turn called a tool that was not run (the iteration limit)
        assert any(len(msgs) >= 3 and msgs[-1].get("tool_calls") for msgs in messages)
    else:
        assert max(runs) >= 2, runs  # a row that called tools on two turns
        # a row whose last turn's calls ran but whose results TRL dropped (past max_completion_length)
        assert any(msgs[-1].get("tool_calls") for msgs in messages)
    if "environment" in name:
        assert any(m["name"] == "count" and "error" not in m["content"] for msgs in messages for m in msgs
                   if m["role"] == "tool")

    difference = trl_runs.update_difference(initial, ours, theirs)
    print(f"{name}: relative update difference {difference:.2e}")
    assert difference < TOLERANCE
