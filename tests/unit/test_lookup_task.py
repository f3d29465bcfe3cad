"""The lookup task (ds_longstraw/tasks/lookup.py) and its worked example (examples/agent_lookup.py).

The task's pieces are checked against their definitions, and the example's GRPO step against what it must do (the
tool called, the observation masked, the weights trained). Its learning curve is a recorded run, not a test: from
chance (0.5 with two values) to copying the observed value, which it can only learn through the tool (the records
are a function of the prompt's tokens that no policy can compute from them).
"""

import os
import sys

import pytest
import torch

from ds_longstraw.tasks.lookup import CALL, EOS, FIRST_KEY, QUERY, RESULT, Layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prompts_records_and_rewards():
    layout = Layout(keys=5, values=3, fillers=7)
    assert layout.vocab_size == FIRST_KEY + 5 + 3 + 7
    prompt = layout.prompt(3, 4, 20)
    assert torch.equal(prompt, layout.prompt(3, 4, 20)) and not torch.equal(prompt, layout.prompt(3, 5, 20))
    assert prompt.numel() == 20 and int(prompt[-2]) == QUERY and FIRST_KEY <= int(prompt[-1]) < layout.first_value
    assert all(layout.first_filler <= int(t) < layout.vocab_size for t in prompt[:-2])
    value = layout.value_of(prompt)
    assert layout.first_value <= value < layout.first_filler
    # the same key maps to other values in other prompts: the record is not a function of the key alone
    values = {layout.value_of(torch.cat([layout.prompt(9, i, 20)[:-1], prompt[-1:]])) for i in range(40)}
    assert len(values) == 3
    tool = layout.environment(prompt)
    assert tool.stop_ids == (CALL,) and tool.observe(0, torch.tensor([CALL])) == [RESULT, value]
    assert tool.observe(0, torch.tensor([CALL, RESULT, value, CALL])) is None  # a second call ends the sample
    wrong = layout.first_value + (value - layout.first_value + 1) % 3
    assert layout.reward(prompt, torch.tensor([CALL, RESULT, value, value, EOS])) == 1.0
    assert layout.reward(prompt, torch.tensor([CALL, RESULT, value, wrong, EOS])) == 0.0
    assert layout.reward(prompt, torch.tensor([value, EOS])) == 0.0  # no call: the answer is a guess
    assert layout.reward(prompt, torch.tensor([CALL, RESULT, value])) == 0.0  # no answer
    with pytest.raises(ValueError, match="values"):
        Layout(values=0)


def test_the_examples_step_calls_the_tool_and_trains():
    """The example's pieces on a short prompt: after its format warm-up every sample calls the tool first, the
    observation "= v" follows it in the response and is masked out of the loss, the rewards are the task's, and one
    GRPO step changes the weights. (Its learning curve is a recorded run: bench/results/agent_lookup.json.)"""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import agent_lookup
    finally:
        sys.path.pop(0)
    from ds_longstraw import generate

    args = agent_lookup.argparse.Namespace(prompt_tokens=32, samples=4, prompts=2, warmup_steps=20, warmup_lr=3e-3,
                                           lr=1e-3, seed=0)
    layout = Layout(values=2)
    model = agent_lookup.build_named("small", vocab_size=layout.vocab_size, seed=0)
    agent_lookup.teach_the_format(model, layout, args)
    prompt = layout.prompt(0, 0, 32)
    rollouts = generate(model, prompt, 4, 6, eos_token_id=EOS, seed=1, longstraw=agent_lookup.LONGSTRAW,
                        environment=layout.environment(prompt), max_turns=1)
    value = layout.value_of(prompt)
    for ids, mask in zip(rollouts.response_ids, rollouts.response_masks, strict=True):
        assert ids[:3].tolist() == [CALL, RESULT, value] and mask[:3].tolist() == [True, False, False]
    assert rollouts.turns == [1] * 4
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    reward, actions, seconds = agent_lookup.grpo_step(model, optimizer, layout, agent_lookup.GRPOObjective(), 0,
                                                      args)
    assert 0.0 <= reward <= 1.0 and actions >= 2 * 4 * 2 and seconds > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
