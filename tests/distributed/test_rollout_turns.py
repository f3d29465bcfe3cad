"""generate with an environment: multi-turn rollouts decoded from one capture, against transformers turn by turn.

Equivalence chains (float64 tiny models; qwen3_5 under float64_model(), glm_moe_dsa under glm_reference()):
  generate(temperature=0, environment=env) == transformers' model.generate(do_sample=False) run turn by turn, the
      same observations appended (tests/turn_envs.py): token for token, the response masks too
  generate(...).logprobs at the actions == full-sequence log-softmax of prompt + response; 0 at observations
  generate(batched) == generate(batched=False) (samples at different positions in one batch == each alone)
  generate(seed=s) twice: the same samples; grpo_backward on rollouts.group(rewards): the actions' log-probs are
      the sampler's, the observations out of the loss
Tolerances: relative 1e-8 on log-probs (as tests/distributed/test_rollout.py: both sides float64, differing only in
the order of their sums; measured ~1e-15). Token ids exactly. Response-row buffers are poisoned (NaN): rows a
sample does not have share the batched buffer with rows it has, and must never reach its output.
"""

import time

import pytest
import torch
from cp_scripts.rollout_ranks import case_rollouts, run_rollouts
from models import float64_model, full_sequence_logprobs
from rollout_families import FAMILIES, family_prompt, poison_rows
from turn_envs import ToolTable, transformers_turns

from ds_longstraw import GRPOObjective, generate, grpo_backward

TOL = 1e-8
# a fifth of the vocabulary ends an action: the tiny random models draw one every few tokens
STOPS = tuple(range(2, 97, 5))


@pytest.fixture(autouse=True)
def poisoned_rows(monkeypatch):
    poison_rows(monkeypatch)


@pytest.fixture(scope="module")
def models():
    return {name: family["build"]() for name, family in FAMILIES.items()}


_prompt = family_prompt


def _assert_action_logprobs(model, family, prompt, result):
    with FAMILIES[family]["reference"](), torch.no_grad():
        reference = full_sequence_logprobs(model, prompt, result.response_ids)
    for sample, (got, want, mask) in enumerate(zip(result.logprobs, reference, result.response_masks, strict=True)):
        assert got.dtype == torch.float64 and got.shape == want.shape
        error = float(((got - want).abs() / want.abs())[mask].max())
        assert error <= TOL, f"sample {sample}: relative error {error:.3e}"
        assert (got[~mask] == 0).all()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "each"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_turns_match_transformers_turn_by_turn(models, family, batched):
    """G = 4 greedy samples (the same until their first observations differ), up to 40 tokens: observations of 3,
    0, 6, 1, 9 and 2 tokens; sample 3's environment ends it at its second call; max_turns 3. glm_moe_dsa's
    reference takes each token from transformers' forward of the whole sequence instead of its generate: there,
    generate's second step after a 62-token context picks another token (64, with or without its cache) than the
    model's own forward of the same 63 tokens (58, by 0.04 in the logits; 64 is not in its top 3), measured on
    sample 2; ours follows the forward, as every other glm_moe_dsa test's reference does."""
    model, prompt = models[family], _prompt(family)
    with FAMILIES[family]["reference"]():
        ours = generate(model, prompt, 4, 40, temperature=0, longstraw=FAMILIES[family]["longstraw"],
                        environment=ToolTable(STOPS, end_at={3: 1}), max_turns=3, batched=batched)
        reference_env = ToolTable(STOPS, end_at={3: 1})
        want = [transformers_turns(model, prompt, reference_env, g, 40, max_turns=3,
                                   use_generate=family == "qwen3_5")
                for g in range(4)]
    for g, (ids, mask) in enumerate(want):
        assert torch.equal(ours.response_ids[g], ids), (g, ours.response_ids[g].tolist(), ids.tolist())
        assert torch.equal(ours.response_masks[g], mask), g
    assert ours.turns == [sum(1 for s, _ in reference_env.calls if s == g) for g in range(4)]
    assert max(ours.turns) >= 2 and len({ids.numel() for ids in ours.response_ids}) > 1  # the case is exercised
    assert ours.finished[3]  # its environment ended it
    _assert_action_logprobs(model, family, prompt, ours)


@pytest.mark.parametrize("tier", ["none", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_turns_equal_one_sample_at_a_time(models, family, tier):
    """Sampled (temperature 0.9, top-p 0.95, seed 3), G = 5, 30 tokens, eos ids among the draws: samples leave the
    batch at different steps and wait on observations of different lengths; the batched decode (one forward per
    step, each sample at its own position) == each sample alone through the segment forward: the same tokens and
    masks, log-probs within 1e-10 (float64; only the order of the attention's partial merges differs)."""
    model, prompt = models[family], _prompt(family, seed=4)
    config = dict(FAMILIES[family]["longstraw"], offload={"tier": tier})
    sampling = dict(temperature=0.9, top_p=0.95, seed=3, eos_token_id=[0, 45, 90])
    with FAMILIES[family]["reference"]():
        batched = generate(model, prompt, 5, 30, longstraw=config, environment=ToolTable(STOPS), **sampling)
        each = generate(model, prompt, 5, 30, longstraw=config, environment=ToolTable(STOPS), batched=False,
                        **sampling)
        again = generate(model, prompt, 5, 30, longstraw=config, environment=ToolTable(STOPS), **sampling)
    assert batched.finished == each.finished and batched.turns == each.turns and max(batched.turns) >= 2
    for a, b, c in zip(batched.response_ids, each.response_ids, again.response_ids, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), (a.tolist(), b.tolist())
    for a, b in zip(batched.response_masks, each.response_masks, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(batched.logprobs, each.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    _assert_decode_steps(batched, prompt)
    assert each.decode_steps == []  # one sample at a time takes no batched steps


def _assert_decode_steps(result, prompt):
    """Rollouts.decode_steps: one record per batched step; each step decodes one action token of every sample it
    counts (observations are captured, not decoded), samples only leave the batch, and the longest context of any
    step is the prompt and a response up to its last action token (that token's forward attends to all of them)."""
    steps = result.decode_steps
    samples = [step.samples for step in steps]
    assert sum(samples) == sum(int(mask.sum()) for mask in result.response_masks)
    assert samples[0] == result.size and samples == sorted(samples, reverse=True) and samples[-1] < samples[0]
    assert steps[0].context == prompt.numel()
    last_action = max(int(mask.nonzero().max()) for mask in result.response_masks)
    assert max(step.context for step in steps) == prompt.numel() + last_action
    assert all(step.seconds > 0 and step.cpu_seconds > 0 for step in steps)
    decoding = result.phases["decode"].seconds - result.phases["observations"].seconds
    assert sum(step.seconds for step in steps) <= decoding


class _SlowTable(ToolTable):
    """A ToolTable whose every answer burns BURN seconds of CPU (a tool's run)."""

    BURN = 0.2

    def observe(self, sample, response_ids):
        began = time.process_time()
        while time.process_time() - began < self.BURN:
            pass
        return super().observe(sample, response_ids)


def test_decode_steps_leave_out_the_environment(models):
    """A tool's run is not decoding: with an environment that burns 0.2 s of CPU per answer, no decode step counts
    it (a tiny model's step takes a few ms of CPU) and the "observations" phase does (with the observations'
    forwards), so that the decode phase less the observations still holds every step (_assert_decode_steps)."""
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    env = _SlowTable(STOPS)
    with float64_model():
        result = generate(model, prompt, 3, 24, temperature=0.9, seed=5, environment=env, max_turns=2,
                          longstraw=FAMILIES["qwen3_5"]["longstraw"])
    asked = len(env.calls)
    assert asked >= 2  # the case is exercised
    assert max(step.cpu_seconds for step in result.decode_steps) < _SlowTable.BURN
    assert result.phases["observations"].seconds >= asked * _SlowTable.BURN
    _assert_decode_steps(result, prompt)


def test_the_budget_cuts_an_observation(models):
    """max_new_tokens caps actions and observations together: an observation longer than the room left is cut to
    it and ends the sample, unfinished; without room for the observation's first token none is asked for."""
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    with float64_model():
        free = generate(model, prompt, 1, 12, temperature=0, longstraw=FAMILIES["qwen3_5"]["longstraw"])
        first = int(free.response_ids[0][0])
        env = ToolTable([first], lengths=(50,))
        cut = generate(model, prompt, 1, 12, temperature=0, environment=env,
                       longstraw=FAMILIES["qwen3_5"]["longstraw"])
    assert cut.response_ids[0].numel() == 12 and cut.turns == [1] and cut.finished == [False]
    assert cut.response_masks[0].tolist() == [True] + [False] * 11
    assert cut.response_ids[0][1:].tolist() == ToolTable([first], lengths=(50,)).observe(0, torch.tensor([first]))[:11]


class _Returns:
    stop_ids = (4,)

    def __init__(self, value):
        self.value = value

    def observe(self, sample, response_ids):
        return self.value


@pytest.mark.parametrize("arguments,message", [
    (dict(environment=object()), "stop_ids"),
    (dict(environment=ToolTable([97])), "stop_ids"),
    (dict(environment=ToolTable([])), "stop_ids"),
    (dict(environment=ToolTable([3]), eos_token_id=3), "both eos_token_id and environment.stop_ids"),
    (dict(max_turns=2), "max_turns is given without an environment"),
    (dict(environment=ToolTable([3]), max_turns=-1), "max_turns"),
], ids=["no-protocol", "stop-outside-vocab", "no-stops", "stop-is-eos", "turns-without-env", "negative-turns"])
def test_bad_environment_arguments_are_refused_by_name(models, arguments, message):
    with pytest.raises(ValueError, match=message):
        generate(models["qwen3_5"], [1, 2, 3], 1, 4, **arguments)


@pytest.mark.parametrize("value,message", [([1, 200], "token id 200"), ("abc", "expected token ids"),
                                           (torch.ones(2), "expected 1-D token ids")])
def test_a_bad_observation_is_refused_naming_the_sample(models, value, message):
    """Every token drawn is a stop id (the whole vocabulary but 0 and 1 stops), so sample 0 asks at once."""
    env = _Returns(value)
    env.stop_ids = tuple(range(2, 97))
    with float64_model(), pytest.raises(ValueError, match=rf"observe\(sample=0\).*{message}"):
        generate(models["qwen3_5"], _prompt("qwen3_5"), 1, 6, temperature=0, environment=env)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_group_trains_on_the_actions(models, family):
    """rollouts.group(rewards) carries the response masks; the transaction's log-probs at the actions equal the
    sampler's (1e-8), so the group's old log-probs give ratios of 1 on the actions."""
    model, prompt = models[family], _prompt(family, seed=6)
    config = FAMILIES[family]["longstraw"]
    with FAMILIES[family]["reference"]():
        result = generate(model, prompt, 3, 24, seed=2, longstraw=config, environment=ToolTable(STOPS))
        group = result.group([1.0, 0.0, 0.5])
        model.zero_grad(set_to_none=True)
        trained = grpo_backward(model, group, GRPOObjective(), longstraw=config)
        model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(group.response_masks, result.response_masks, strict=True))
    assert not all(bool(mask.all()) for mask in group.response_masks)  # observations were masked out
    for got, want, mask in zip(trained.logprobs, result.logprobs, result.response_masks, strict=True):
        assert float(((got - want).abs() / want.abs())[mask].max()) <= TOL


# CP 2: prompts of 22 and 44 tokens over two ranks (11/11, 22/22), the observations captured on every rank against
# both ranks' prompt pages; only rank 0 asks the environment (its answers reach rank 1)
CP_CASES = [
    dict(name="qwen-turns", family="qwen3_5", prompt_len=23, samples=3, max_new=24, seed=1,
         longstraw={"capture_chunk": 5, "page_tokens": 4}, environment=dict(stop_ids=STOPS),
         sampling=dict(temperature=0.9, seed=4, max_turns=3)),
    dict(name="glm-turns", family="glm_moe_dsa", prompt_len=45, samples=2, max_new=20, seed=2,
         longstraw={"capture_chunk": 7, "page_tokens": 4}, environment=dict(stop_ids=STOPS, end_at={1: 1}),
         sampling=dict(temperature=0)),
]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_rollouts(CP_CASES, str(tmp_path_factory.mktemp("cp_turns")))


@pytest.mark.parametrize("case", CP_CASES, ids=[case["name"] for case in CP_CASES])
def test_cp2_turns_equal_one_rank(cp_results, case):
    """Every rank of CP 2 gets the single process's multi-turn samples: tokens, masks and turns exactly,
    log-probs within 1e-8 (the CP side merges attention partials by LSE)."""
    reference = case_rollouts(case)
    assert max(reference.turns) >= 1
    for rank, result in enumerate(cp_results[case["name"]]):
        assert result["turns"] == reference.turns and result["finished"] == reference.finished, rank
        for got, want in zip(result["response_ids"], reference.response_ids, strict=True):
            assert torch.equal(got, want), (rank, got.tolist(), want.tolist())
        for got, want in zip(result["response_masks"], reference.response_masks, strict=True):
            assert torch.equal(got, want), rank
        for got, want, mask in zip(result["logprobs"], reference.logprobs, reference.response_masks, strict=True):
            assert float(((got - want).abs() / want.abs())[mask].max()) <= TOL, rank


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_kept_capture_trains_multi_turn_samples(models, family, mode):
    """generate(keep_capture=True, environment=) then grpo_backward(capture=rollouts) == the same step capturing the
    prompt again: gradients within relative L2 1e-8 (float64; the same function of the same inputs, only the
    capture's calls differ), and the transaction captured nothing. member_span_capture 4: observations of 6 and 9
    tokens run in steps (the tree transaction's captured spans), shorter ones inside their action's step."""
    from grads import relative_l2

    model, prompt = models[family], _prompt(family, seed=7)
    config = dict(FAMILIES[family]["longstraw"], prefix_grad=mode, member_span_capture=4)
    rewards = [1.0, 0.0, 0.5]
    with FAMILIES[family]["reference"]():
        result = generate(model, prompt, 3, 30, seed=5, longstraw=config, environment=ToolTable(STOPS),
                          keep_capture=True)
        assert any(int((~mask).sum()) >= 4 for mask in result.response_masks)  # a span long enough to step
        model.zero_grad(set_to_none=True)
        reused = grpo_backward(model, result.group(rewards), GRPOObjective(), longstraw=config, capture=result)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        again = grpo_backward(model, result.group(rewards), GRPOObjective(), longstraw=config)
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    assert reused.extras["capture_reused"] and not again.extras["capture_reused"]
    assert "capture" not in reused.phases and "capture" in again.phases
    error = relative_l2(got, want)
    assert error <= 1e-8, f"relative L2 {error:.3e}"


def test_the_rollout_block_runs_an_environment(models):
    """The `rollout:` block's environment ("package.module:function", one environment per prompt) and max_turns reach
    generate: rollout_groups' groups are generate's with that environment at the block's seeds, observations
    masked; max_turns without an environment, and an environment that does not import, are refused by key."""
    from turn_envs import tool_table

    from ds_longstraw.rollout.step import parse_rollout, rollout_groups, sample_seed

    block = dict(source="internal", num_samples=3, max_new_tokens=24, reward="rewards:mod3_reward",
                 environment="turn_envs:tool_table", max_turns=2, seed=9)
    model, prompts = models["qwen3_5"], [_prompt("qwen3_5", seed=s) for s in (1, 2)]
    config = FAMILIES["qwen3_5"]["longstraw"]
    with float64_model():
        groups = rollout_groups(model, prompts, block, step=3, longstraw=config)
        for j, (group, prompt) in enumerate(zip(groups, prompts, strict=True)):
            want = generate(model, prompt, 3, 24, seed=sample_seed(9, 3, j), longstraw=config,
                            environment=tool_table(prompt), max_turns=2)
            assert all(torch.equal(a, b) for a, b in zip(group.response_ids, want.response_ids, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(group.response_masks, want.response_masks, strict=True))
            assert max(want.turns) <= 2
    assert any(not bool(m.all()) for group in groups for m in group.response_masks)
    with pytest.raises(ValueError, match="rollout.max_turns"):
        parse_rollout({k: v for k, v in block.items() if k != "environment"})
    with pytest.raises(ValueError, match="rollout.environment"):
        parse_rollout(dict(block, environment="turn_envs:no_such_factory"))


@pytest.mark.parametrize("family,mode", [("qwen3_5", "exact"), ("glm_moe_dsa", "detached")])
def test_the_kept_observations_are_not_forwarded_again(models, family, mode, monkeypatch):
    """With generate's kept capture, the training step's forwards without autograd cover only the actions' steps of
    the members that run in steps: their observations (captured spans) come from the rollout, not a second forward;
    with autograd every response token runs once (pass 2, the backward's recompute; exact mode's prefix pass adds
    the prompt's). Counted by wrapping the adapter's segment forward; the step that captures again forwards the
    prompt and every observation without autograd besides."""
    from ds_longstraw.arch import adapter_for
    from ds_longstraw.grpo.member_steps import member_steps

    model, prompt = models[family], _prompt(family, seed=7)
    config = dict(FAMILIES[family]["longstraw"], prefix_grad=mode, member_span_capture=4)
    adapter_class = type(adapter_for(model))
    counts = {True: 0, False: 0}
    real = adapter_class.forward_segment

    def counted(self, ids, *args, **kwargs):
        counts[torch.is_grad_enabled()] += ids.numel()
        return real(self, ids, *args, **kwargs)

    with FAMILIES[family]["reference"]():
        result = generate(model, prompt, 3, 30, seed=5, longstraw=config, environment=ToolTable(STOPS),
                          keep_capture=True)
        group = result.group([1.0, 0.0, 0.5])
        monkeypatch.setattr(adapter_class, "forward_segment", counted)
        grpo_backward(model, group, GRPOObjective(), longstraw=config, capture=result)
        kept = dict(counts)
        counts.update({True: 0, False: 0})
        grpo_backward(model, group, GRPOObjective(), longstraw=config)
        model.zero_grad(set_to_none=True)
    steps = [member_steps(group.mask(m), 4, config["replay_block"]) for m in range(group.size)]
    assert any(s is not None for s in steps)
    scored = sum(step.end - step.start for member in steps if member for step in member if step.scored)
    captured = sum(step.end - step.start for member in steps if member for step in member if not step.scored)
    assert captured > 0
    tokens = sum(ids.numel() for ids in group.response_ids) + (prompt.numel() - 1 if mode == "exact" else 0)
    assert kept == {False: scored, True: tokens}, (kept, scored, tokens)
    # capturing again: the prompt's capture (prompt[:-1]) and the observations run without autograd too
    assert counts[False] == kept[False] + captured + prompt.numel() - 1 and counts[True] == tokens
