"""integrations/trl/tools.py without a model: TRL's tool-loop rules as ToolLoop applies them turn by turn (stand-in
parse and suffix functions, so each rule's count is visible), and generate_from_capture's refusals with tools, each
named (before the model is loaded where it can be known then: the model path does not exist there)."""

import json
import os

import pytest
import torch

from ds_longstraw.integrations.trl import LongStrawGRPOTrainer
from ds_longstraw.integrations.trl.tools import ToolLoop, _Row
from tests import trl_runs, trl_tools

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

MISSING_MODEL = "/nonexistent/model"
STOP = 1  # the end of a turn (TRL's eos)
# stand-in tokens: 10 + k is "call tool k" (k = 0: add(2, 3), 1: divide(1, 0), 2: an unknown tool, 3: a non-function
# call type, 4: returns a list); 2.. 9 are words
CALLS = {10: ("function", "add", {"a": 2, "b": 3}), 11: ("function", "divide", {"a": 1, "b": 0}),
         12: ("function", "search", {"query": 1}), 13: ("retrieval", "lookup", {}),
         14: ("function", "pictures", {})}


def _parse(ids, prefix, tools):
    """parse_response's stand-in: the calls whose tokens the turn holds."""
    calls = [{"type": CALLS[t][0], "name": CALLS[t][1]} if CALLS[t][0] != "function" else
             {"type": "function", "function": {"name": CALLS[t][1], "arguments": CALLS[t][2]}}
             for t in ids if t in CALLS]
    message = {"role": "assistant", "content": " ".join(str(t) for t in ids if t not in CALLS)}
    if calls:
        message["tool_calls"] = calls
    return message


def _suffix(messages):
    """_get_tool_suffix_ids' stand-in: 3 tokens per tool message."""
    return [5, 6, 7] * len(messages)


def _loop(max_turns=None, max_completion_length=20, max_model_len=1000, rows=1):
    tools = {"add": trl_tools.add, "divide": trl_tools.divide, "pictures": lambda: [{"type": "image"}]}
    return ToolLoop([_Row([2, 3, 4], [], tools, {}) for _ in range(rows)], parse=_parse, suffix_ids=_suffix,
                    stop_ids=[STOP], max_turns=max_turns, max_completion_length=max_completion_length,
                    max_model_len=max_model_len)


def test_a_turn_without_a_call_ends_the_sample():
    loop = _loop()
    assert loop.observe(loop.rows[0], [2, 3, STOP]) is None
    assert loop.rows[0].messages == [{"role": "assistant", "content": "2 3 1"}] and loop.calls == 0


def test_calls_run_and_fail_as_trls_loop():
    loop = _loop()
    row = loop.rows[0]
    # one turn with four calls: a success, a division by zero, an unknown tool, another call type
    assert loop.observe(row, [2, 10, 11, 12, 13, STOP]) == [5, 6, 7] * 4
    assert (loop.calls, loop.failures) == (4, 3)
    assert [m["content"] for m in row.messages[1:]] == [
        "5", "{'error': 'division by zero'}", "{'error': 'Tool search not found.'}",
        "{'error': 'Unsupported tool call type: retrieval'}"]
    assert [m["name"] for m in row.messages[1:]] == ["add", "divide", "search", "lookup"]
    # the next turn starts after the tool messages, and is parsed with prompt + completion so far as its prefix
    assert row.turn_start == 6 + 12
    response = [2, 10, 11, 12, 13, STOP] + [5, 6, 7] * 4 + [3, STOP]
    assert loop.observe(row, response) is None
    assert row.messages[-1] == {"role": "assistant", "content": "3 1"}


def test_results_past_the_budget_are_dropped_after_the_calls_ran():
    loop = _loop(max_completion_length=8)
    row = loop.rows[0]
    # 6 tokens + a 3-token result > 8: TRL drops the result and ends the row; the call ran and counted
    assert loop.observe(row, [2, 3, 4, 5, 10, STOP]) is None
    assert (loop.calls, loop.failures, len(row.messages)) == (1, 0, 1)
    # a result that fills the budget exactly is kept (TRL's next turn is cut to nothing)
    loop = _loop(max_completion_length=9)
    assert loop.observe(loop.rows[0], [2, 3, 4, 5, 10, STOP]) == [5, 6, 7]
    # the model's length: prompt + completion + result reaching max_position_embeddings drops it too
    loop = _loop(max_model_len=3 + 6 + 3)
    assert loop.observe(loop.rows[0], [2, 3, 4, 5, 10, STOP]) is None


class _Rollouts:
    def __init__(self, ids, mask):
        self.response_ids, self.response_masks = [torch.tensor(ids)], [torch.tensor(mask, dtype=torch.bool)]


def test_finish_parses_the_last_turn_and_runs_calls_at_the_budget():
    loop = _loop(max_completion_length=10)
    row = loop.rows[0]
    first = [2, 10, STOP]
    assert loop.observe(row, first) == [5, 6, 7]
    # the second turn is cut at the budget holding a call: TRL runs it, then drops its result
    ids = first + [5, 6, 7] + [3, 11, 4, 4]
    loop.finish([0], _Rollouts(ids, [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]))
    assert (loop.calls, loop.failures) == (2, 1)
    assert row.messages[-1]["tool_calls"][0]["function"]["name"] == "divide"
    assert loop.first_turns() == [first]
    mask, messages, completions, logprobs, calls, failures, images = loop.trl_outputs(None)
    assert completions == [ids] and mask == [[1, 1, 1, 0, 0, 0, 1, 1, 1, 1]] and (calls, failures) == (2, 1)
    assert images == [[]] and logprobs is None and messages == [row.messages]


def test_finish_runs_no_call_past_max_turns():
    loop = _loop(max_turns=1)
    row = loop.rows[0]
    assert loop.observe(row, [10, STOP]) == [5, 6, 7]
    # generate asks no observation past max_turns: the second turn's call is parsed, not run (TRL's loop stopped)
    ids = [10, STOP, 5, 6, 7, 11, STOP]
    loop.finish([0], _Rollouts(ids, [1, 1, 0, 0, 0, 1, 1]))
    assert (loop.calls, loop.failures) == (1, 0)
    assert row.messages[-1]["tool_calls"][0]["function"]["name"] == "divide"


def test_finish_after_the_results_filled_the_budget():
    loop = _loop(max_completion_length=5)
    assert loop.observe(loop.rows[0], [10, STOP]) == [5, 6, 7]
    loop.finish([0], _Rollouts([10, STOP, 5, 6, 7], [1, 1, 0, 0, 0]))
    assert len(loop.rows[0].messages) == 2  # no turn after the tool message: TRL appends none


def test_a_tool_returning_a_list_is_refused():
    loop = _loop()
    with pytest.raises(ValueError, match=r"tool 'pictures' returned a list"):
        loop.observe(loop.rows[0], [14, STOP])


def test_the_environment_maps_samples_to_rows():
    loop = _loop(rows=3)
    environment = loop.environment([2, 0])
    assert environment.stop_ids == (STOP,)
    assert environment.observe(0, torch.tensor([10, STOP])) == [5, 6, 7]
    assert loop.rows[2].messages and not loop.rows[0].messages


# -- refusals ----------------------------------------------------------------------------------------------------

async def fetch(url: str) -> str:
    """Fetches a page.

    Args:
        url: The address.
    """
    return url


class AsyncEnvironment:
    def reset(self, **kwargs):
        return None

    async def step(self, action: str) -> str:
        """Acts.

        Args:
            action: What to do.
        """
        return action


def _trainer(tmp_path, model=MISSING_MODEL, config=None, longstraw=None, **kwargs):
    args = trl_runs.grpo_config(str(tmp_path), **(config or {}))
    return LongStrawGRPOTrainer(model=model, reward_funcs=[trl_runs.reward_even_words], args=args,
                                train_dataset=trl_tools.chat_dataset(4), longstraw=longstraw or {},
                                generate_from_capture=True, **kwargs)


def test_async_tools_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"async tools = \['fetch'\]"):
        _trainer(tmp_path, tools=[trl_tools.add, fetch])
    with pytest.raises(ValueError, match=r"async tools = \['AsyncEnvironment.step'\]"):
        _trainer(tmp_path, environment_factory=AsyncEnvironment)


def test_async_methods_of_a_factory_function_are_refused_after_trl_probes_it(tmp_path):
    """A factory that is not a class shows its tools only once TRL has built an instance (the model is loaded, not
    run)."""
    path = trl_tools.save_driven_model(str(tmp_path / "model"))
    with pytest.raises(ValueError, match=r"async tools = \['step'\]"):
        _trainer(tmp_path, model=path, config={"model_init_kwargs": {"dtype": torch.float64}},
                 processing_class=trl_tools.chat_tokenizer(), environment_factory=lambda: AsyncEnvironment())


def test_tools_with_context_parallelism_are_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "longstraw": {"cp_size": 2},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    args = trl_runs.grpo_config(str(tmp_path), deepspeed=str(config))
    with pytest.raises(ValueError, match=r"tools with 'longstraw\.cp_size' = 2"):
        LongStrawGRPOTrainer(model=MISSING_MODEL, reward_funcs=[trl_runs.reward_even_words], args=args,
                             train_dataset=trl_tools.chat_dataset(4), tools=[trl_tools.add],
                             generate_from_capture=True)


def test_a_processor_is_refused(tmp_path):
    from transformers import ProcessorMixin

    class Processor(ProcessorMixin):
        attributes = []

    with pytest.raises(ValueError, match=r"processing_class = 'Processor'"):
        _trainer(tmp_path, processing_class=Processor.__new__(Processor), tools=[trl_tools.add])


def test_vllm_and_a_rollout_func_stay_refused_with_tools(tmp_path):
    with pytest.raises(ValueError, match=r"use_vllm = True.*rollout_func"):
        _trainer(tmp_path, config={"use_vllm": True}, tools=[trl_tools.add],
                 rollout_func=trl_runs.rollout_func(6, 32))
