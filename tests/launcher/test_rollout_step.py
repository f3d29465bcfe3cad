"""Rollouts inside training (ds_longstraw.rollout.step): the `rollout:` block, its reward import path, and the
engine path that samples, rewards and trains in one grpo_step.

  config:   every bad block fails in parse_rollout (and so at engine.grpo_step and load_run_config, before any
            work) with a ValueError naming the key: unknown source or key, a reward path that does not import or
            names no callable, num_samples < 2, max_new_tokens < 1, temperature < 0, top_p outside (0, 1]
  reward:   the import path resolves; the function is called once per sample with (the prompt's ids, that
            sample's response ids), and a non-number it returns is an error naming rollout.reward
  groups:   rollout_groups(prompts) == generate(prompt, seed=sample_seed(seed, step, index)) + Rollouts.group of
            those rewards (responses, rewards and old log-probs equal); another step samples other responses
  engine:   one-rank ZeRO-3 engine.grpo_step(prompts, rollout=block), SGD, in a fresh process == single-process
            rollout_groups at step 0 (the same samples and rewards) + grpo_backward + the same SGD step: the
            parameter update to relative 1e-5 in float32 (the tolerance of tests/launcher/test_engine.py: only summation
            order differs), and extras' mean reward equals the reference's; with two prompts each is captured again
            for training, with one the step trains on the rollout's capture (no capture phase)
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import tiny_qwen3_5
from rewards import mod3_reward  # noqa: F401 (named as f'{__name__}:mod3_reward')

from ds_longstraw import generate
from ds_longstraw.engine.run_config import load_run_config
from ds_longstraw.rollout.step import (
    load_callable,
    parse_rollout,
    rollout_groups,
    sample_seed,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALLS = []


def recording_reward(prompt_ids, response_ids):
    CALLS.append((prompt_ids.clone(), response_ids.clone()))
    return float(response_ids[0] % 3)


def not_a_number_reward(prompt_ids, response_ids):
    return "high"


NOT_CALLABLE = 3
GOOD = {"source": "internal", "num_samples": 3, "max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9,
        "reward": f"{__name__}:recording_reward", "seed": 5}

BAD = {
    "unknown-source": (dict(GOOD, source="jsonl"), ["rollout.source", "jsonl"]),
    "no-source": ({k: v for k, v in GOOD.items() if k != "source"}, ["rollout.source", "required"]),
    "unknown-key": (dict(GOOD, samples=4), ["rollout.samples"]),
    "one-sample": (dict(GOOD, num_samples=1), ["rollout.num_samples", "1"]),
    "no-new-tokens": (dict(GOOD, max_new_tokens=0), ["rollout.max_new_tokens"]),
    "negative-temperature": (dict(GOOD, temperature=-0.5), ["rollout.temperature"]),
    "top-p-zero": (dict(GOOD, top_p=0.0), ["rollout.top_p"]),
    "reward-module-missing": (dict(GOOD, reward="no_such_package.rewards:score"),
                              ["rollout.reward", "no_such_package.rewards", "does not import"]),
    "reward-attribute-missing": (dict(GOOD, reward="ds_longstraw.tasks.recall:no_such_reward"),
                                 ["rollout.reward", "no_such_reward"]),
    "reward-not-callable": (dict(GOOD, reward=f"{__name__}:NOT_CALLABLE"), ["rollout.reward", "not callable"]),
    "reward-no-colon": (dict(GOOD, reward="ds_longstraw.tasks.recall.reward"), ["rollout.reward", "package.module"]),
    "no-reward": ({k: v for k, v in GOOD.items() if k != "reward"}, ["rollout.reward", "required"]),
    "prompts-missing": (dict(GOOD, prompts="ds_longstraw.tasks.recall:nothing"), ["rollout.prompts", "nothing"]),
    "negative-eos": (dict(GOOD, eos_token_id=-1), ["rollout.eos_token_id"]),
    "unknown-weights": (dict(GOOD, zero3_weights="half"), ["rollout.zero3_weights", "half"]),
    "budget-above-one": (dict(GOOD, zero3_whole_budget=1.5), ["rollout.zero3_whole_budget"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_block_names_the_key(name):
    block, words = BAD[name]
    with pytest.raises(ValueError) as error:
        parse_rollout(block)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_block_must_be_a_dict():
    with pytest.raises(ValueError, match="'rollout' block must be a dict"):
        parse_rollout("internal")


def test_reward_path_resolves():
    assert load_callable("ds_longstraw.tasks.recall:reward").__name__ == "reward"
    assert parse_rollout(GOOD).reward_function() is recording_reward


def test_sample_seeds_differ_by_step_and_index():
    seeds = {sample_seed(0, step, index) for step in range(20) for index in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**62 for s in seeds)
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0) and sample_seed(3, 4, 5) == sample_seed(3, 4, 5)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5(torch.float32)


CONFIG = {"capture_chunk": 5, "page_tokens": 4, "replay_block": 3}


def test_groups_equal_generate_and_the_reward_sees_each_sample(model):
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 7)]
    CALLS.clear()
    groups = rollout_groups(model, prompts, GOOD, step=4, first_index=6, longstraw=CONFIG)
    assert len(groups) == 2 and len(CALLS) == 2 * 3
    for j, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        want = generate(model, prompt, 3, 4, temperature=1.0, top_p=0.9, seed=sample_seed(5, 4, 6 + j),
                        longstraw=CONFIG)
        assert torch.equal(group.prompt_ids, prompt)
        for g in range(3):
            assert torch.equal(group.response_ids[g], want.response_ids[g])
            torch.testing.assert_close(group.old_logprobs[g], want.logprobs[g], rtol=0, atol=0)
            called_prompt, called_response = CALLS[3 * j + g]
            assert torch.equal(called_prompt, prompt) and torch.equal(called_response, want.response_ids[g])
        assert group.rewards.tolist() == [float(r[0] % 3) for r in want.response_ids]
    later = rollout_groups(model, prompts[:1], GOOD, step=5, first_index=6, longstraw=CONFIG)
    assert any(not torch.equal(a, b) for a, b in zip(later[0].response_ids, groups[0].response_ids, strict=True))


def test_a_reward_that_is_not_a_number_names_the_key(model):
    with pytest.raises(ValueError, match=r"'rollout.reward' = .*not_a_number_reward.* returned 'high'"):
        rollout_groups(model, torch.arange(1, 9), dict(GOOD, reward=f"{__name__}:not_a_number_reward"), step=0,
                       longstraw=CONFIG)


def test_bad_prompts_fail_naming_the_prompt(model):
    with pytest.raises(ValueError, match=r"prompts\[1\] must be 1-D"):
        rollout_groups(model, [torch.arange(1, 9), torch.ones(2, 3, dtype=torch.long)], GOOD, step=0, longstraw=CONFIG)


def test_run_config_validates_the_block_at_load():
    base = ["deepspeed_config=x.json", "model.shape=s.yaml"]
    task = [f"rollout.{k}={v}" for k, v in dict(GOOD, reward="ds_longstraw.tasks.recall:reward",
                                             prompts="ds_longstraw.tasks.recall:prompt").items()]
    run = load_run_config(None, base + task)
    assert run.rollout.num_samples == 3 and run.data.path is None
    with pytest.raises(ValueError, match="rollout.num_samples"):
        load_run_config(None, base + task + ["rollout.num_samples=1"])
    with pytest.raises(ValueError, match="rollout.reward"):
        load_run_config(None, base + task + ["rollout.reward=nowhere:fn"])
    with pytest.raises(ValueError, match="data.path"):  # prompts from neither place
        load_run_config(None, base + [item for item in task if not item.startswith("rollout.prompts")])
    with pytest.raises(ValueError, match="rollout.prompts and data.path"):
        load_run_config(None, base + task + ["data.path=g.jsonl"])
    with pytest.raises(ValueError, match="train.samples"):  # nothing is sampled without a rollout block
        load_run_config(None, ["deepspeed_config=x.json", "model.shape=s.yaml", "data.path=g.jsonl",
                               "train.samples=s.jsonl"])


ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    out, port = sys.argv[1], sys.argv[2]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    sys.path.insert(0, os.path.join(sys.argv[3], "tests"))
    import deepspeed
    import ds_longstraw
    from ds_longstraw import GRPOObjective, grpo_backward
    from ds_longstraw.rollout.step import rollout_groups
    from models import tiny_qwen3_5

    block = {"enabled": True, "capture_chunk": 5, "page_tokens": 4, "replay_block": 3}
    rollout = {"source": "internal", "num_samples": 4, "max_new_tokens": 3, "temperature": 1.0,
               "reward": "rewards:mod3_reward", "seed": 11}
    prompts = [torch.tensor([9, 3, 0, 12, 1, 9, 4, 0, 13, 1, 2, 4, 0]), torch.tensor([5, 0, 20, 1, 7, 2, 5, 0])]
    lr = 0.05
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "longstraw": block}


    def step_against_reference(prompts):
        reference = tiny_qwen3_5(torch.float32)
        model = tiny_qwen3_5(torch.float32)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                             config=config)
        result = engine.grpo_step(prompts, GRPOObjective(loss_scope="group"), rollout=rollout)
        groups = rollout_groups(reference, prompts, rollout, step=0, longstraw=block)
        reference.zero_grad()
        losses = [grpo_backward(reference, g, GRPOObjective(), longstraw=block).loss for g in groups]
        num = den = 0.0
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                got = param.detach() - before[name]
            want = -lr * dict(reference.named_parameters())[name].grad / len(groups)
            num += float((got - want).pow(2).sum())
            den += float(want.pow(2).sum())
        rewards = [g.rewards.tolist() for g in groups]
        same_groups = [[a.tolist() for a in g.response_ids] == [b.tolist() for b in r.response_ids]
                       and torch.equal(g.old_logprobs[0], r.old_logprobs[0])
                       for g, r in zip(result.extras["groups"], groups)]
        return {"rel": (num / den) ** 0.5, "same_groups": same_groups, "finished": result.extras["finished"],
                "norm": den ** 0.5, "rewards": result.extras["rewards"],
                "ref_rewards": rewards, "mean_reward": result.extras["mean_reward"],
                "ref_mean_reward": sum(map(sum, rewards)) / sum(map(len, rewards)),
                "loss": result.loss, "ref_loss": sum(losses) / len(losses), "global_step": result.global_step,
                "capture_reused": [g.extras["capture_reused"] for g in result.groups],
                "capture_phases": ["capture" in g.phases for g in result.groups]}


    # two prompts: each captured again for training; one prompt: the step trains on the rollout's capture
    with open(out, "w") as handle:
        json.dump({"two": step_against_reference(prompts), "one": step_against_reference(prompts[:1])}, handle)
    torch.distributed.destroy_process_group()
""")


def test_engine_step_with_rollout_equals_single_process(tmp_path):
    from dist_scripts.launching import free_port, launcher_env

    script = tmp_path / "engine_rollout.py"
    script.write_text(ENGINE_SCRIPT)
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(script), str(out), str(free_port()), REPO], cwd=REPO,
                         env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    for result in results.values():
        assert result["rewards"] == result["ref_rewards"] and result["global_step"] == 1
        # the step's sampled groups come back in extras: responses and old log-probs as one process samples them
        assert result["same_groups"] and all(result["same_groups"]), result
        assert [len(f) for f in result["finished"]] == [4] * len(result["same_groups"])
        assert result["mean_reward"] == pytest.approx(result["ref_mean_reward"], rel=1e-12)
        assert result["norm"] > 0 and result["rel"] < 1e-5, result
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6, abs=1e-9)
    assert results["two"]["capture_reused"] == [False, False] and results["two"]["capture_phases"] == [True, True]
    assert results["one"]["capture_reused"] == [True] and results["one"]["capture_phases"] == [False]


def _train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_for_rollouts", os.path.join(REPO, "launch", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_prompts_per_step_from_the_generator_and_from_jsonl(tmp_path):
    """launch/train.py's step prompts: generator index (step W + r) k + j, or data.path's prompts in for_step's
    order; a JSONL record without a prompt fails at start naming its line."""
    from ds_longstraw.tasks import recall

    train = _train_module()
    sizes = {"prompt_tokens": 20, "records": 2}
    run = load_run_config(None, ["deepspeed_config=x.json", "model.shape=s.yaml", "rollout.source=internal",
                                 "rollout.max_new_tokens=1", "rollout.reward=ds_longstraw.tasks.recall:reward",
                                 "rollout.seed=4", "rollout.prompts=ds_longstraw.tasks.recall:prompt",
                                 *[f"rollout.prompt_args.{k}={v}" for k, v in sizes.items()]])
    source = train._source(run, None)
    got = source.for_step(3, 1, 2, 2)
    assert [p.tolist() for p in got] == [recall.prompt(4, i, **sizes).tolist() for i in (14, 15)]
    assert source.rollout.num_samples == 8
    with pytest.raises(ValueError, match=r"'rollout.prompt_args' = .*'rows': 3.*rows"):
        train._source(load_run_config(None, ["deepspeed_config=x.json", "model.shape=s.yaml",
                                             "rollout.source=internal", "rollout.max_new_tokens=1",
                                             "rollout.reward=ds_longstraw.tasks.recall:reward",
                                             "rollout.prompts=ds_longstraw.tasks.recall:prompt",
                                             "rollout.prompt_args.rows=3"]), None)

    lines = [{"prompt_ids": [1, 2, i], "response_ids": [[3]], "rewards": [0.0]} for i in range(5)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = load_run_config(None, ["deepspeed_config=x.json", "model.shape=s.yaml", f"data.path={tmp_path}/g.jsonl",
                                 "rollout.source=internal", "rollout.max_new_tokens=1",
                                 "rollout.reward=ds_longstraw.tasks.recall:reward"])
    source = train._source(run, None)
    assert [p.tolist() for p in source.for_step(1, 0, 2, 2)] == [[1, 2, 4], [1, 2, 0]]  # indices 4, 5 -> 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"response_ids": [[3]], "rewards": [0.0]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: needs 'prompt_ids'"):
        train._source(load_run_config(None, ["deepspeed_config=x.json", "model.shape=s.yaml",
                                             f"data.path={tmp_path}/bad.jsonl", "rollout.source=internal",
                                             "rollout.max_new_tokens=1",
                                             "rollout.reward=ds_longstraw.tasks.recall:reward"]), None)


# The recall task's run config from its model's random weights (not the warm-up checkpoint it names), at a short length
RECALL_RUN = os.path.join(REPO, "configs", "run", "recall_task.yaml")
RECALL_SHAPE = os.path.join(REPO, "configs", "models", "recall_qwen3_5.yaml")
RECALL_TOKENS = 32
RECALL_BLOCK = {"enabled": True, "prefix_grad": "detached", "capture_chunk": 16, "replay_block": 4, "page_tokens": 8}
# eps 1: Adam would turn float32 rounding in near-zero gradients into full-size steps (as test_launcher.py)
RECALL_OPTIM = {"lr": 3e-3, "eps": 1.0, "weight_decay": 0.01}


@pytest.mark.slow
def test_launcher_rollouts_train_on_the_rollout_capture_in_lockstep(tmp_path):
    """2 ranks under the `deepspeed` launcher, ZeRO-3, one recall prompt per rank per step: every rank trains on its
    rollout's capture (no second prefill; the ZeRO-3 lockstep needs no capture padding, all prompts being one
    length), and 2 steps land on the weights of a single-process reference (per step, both replicas' rollout groups
    at that step's seeds, their mean gradient, AdamW) to relative 1e-5 in float32."""
    from dist_scripts.launching import finish, free_port, start

    from ds_longstraw.models.modeling import build_model
    from ds_longstraw.tasks import recall

    with open(os.path.join(REPO, "configs", "deepspeed", "zero3_cpu.json")) as handle:
        ds = json.load(handle)
    ds.update(gradient_clipping=0.0, longstraw=RECALL_BLOCK)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    overrides = [f"deepspeed_config={tmp_path / 'ds.json'}", "train.max_steps=2", "data.groups_per_rank=1",
                 "objective.loss_scope=group",  # the reference weighs each replica's group alike
                 "model.pretrained=null", f"model.shape={RECALL_SHAPE}",
                 f"rollout.prompt_args.prompt_tokens={RECALL_TOKENS}",
                 f"train.metrics={tmp_path / 'metrics.jsonl'}", f"train.dump_params={tmp_path / 'final.pt'}",
                 f"train.samples={tmp_path / 'samples.jsonl'}",
                 *[f"optim.{k}={v}" for k, v in RECALL_OPTIM.items()]]
    log = str(tmp_path / "train.log")
    job = start(["--num_gpus", "2", "--master_port", str(free_port())],
                [os.path.join(REPO, "launch", "train.py"), "--config", RECALL_RUN, *overrides], log)
    finish([job], timeout=600, logs=[log])
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["capture_reused_rank0"] for m in metrics)
    assert all(m["zero3_weights_rank0"] == "whole" for m in metrics)  # "auto" finds room for the tiny model
    assert all("capture" not in m["phase_seconds_rank0"] for m in metrics)

    import yaml

    from ds_longstraw import GRPOObjective, grpo_backward

    with open(RECALL_RUN) as handle:
        run = yaml.safe_load(handle)
    rollout = run["rollout"]
    args = {**rollout["prompt_args"], "prompt_tokens": RECALL_TOKENS}
    objective = GRPOObjective(**{**run["objective"], "loss_scope": "group"})
    torch.set_num_threads(1)
    model = build_model(shape=RECALL_SHAPE, dtype="float32", seed=0)
    start_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), **RECALL_OPTIM)
    recorded = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group"]) for r in recorded] == [(1, 0), (2, 0)]  # rank 0's one group per step
    for step in range(2):
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for replica in range(2):  # launch/train.py's prompt index (step W + r) k + j; the seed's index r k + j
            model.zero_grad(set_to_none=True)
            prompts = [recall.prompt(rollout["seed"], step * 2 + replica, **args)]
            # old log-probs at the objective's temperature (1), as engine.grpo_step takes them; the block samples at 2
            for group in rollout_groups(model, prompts, rollout, step=step, first_index=replica,
                                        longstraw=RECALL_BLOCK, score_temperature=objective.temperature):
                if replica == 0:  # what train.samples recorded: rank 0's samples, before the step's update
                    assert recorded[step]["response_ids"] == [ids.tolist() for ids in group.response_ids]
                    assert recorded[step]["rewards"] == group.rewards.tolist()
                    assert recorded[step]["prompt_tokens"] == prompts[0].numel()
                grpo_backward(model, group, objective, longstraw=RECALL_BLOCK)
            for name, p in model.named_parameters():
                if p.grad is not None:
                    total[name] += p.grad / 2
        for name, p in model.named_parameters():
            p.grad = total[name]
        optimizer.step()
    got = torch.load(tmp_path / "final.pt")
    want = {n: p.detach() for n, p in model.named_parameters()}
    num = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want)
    den = sum(float(((want[n] - start_weights[n]) ** 2).sum()) for n in want)
    assert den > 0 and (num / den) ** 0.5 < 1e-5


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_auto_weights_count_what_decoding_keeps_as_the_planner_does(tier):
    """rollout_step.decoding_bytes (what "auto" sets beside the whole weights) == the planner's figures for the same
    prompt and rollout: the prompt's pages (tier none; else two staged layers of the largest), the samples' carry and
    rows, a step's logits; the planner's samples figure is checked against a real generate in test_planner.py."""
    from ds_longstraw import parse_config
    from ds_longstraw.arch import adapter_for
    from ds_longstraw.models.model_shape import shape_from_config
    from ds_longstraw.offload.plan import Cluster, make_plan, retained_per_rank, rollout_figures
    from ds_longstraw.rollout.step import decoding_bytes

    model = tiny_qwen3_5()
    prompts = [torch.zeros(40, dtype=torch.long), torch.zeros(57, dtype=torch.long)]
    rollout = parse_rollout(dict(GOOD, num_samples=3, max_new_tokens=9))
    longstraw = parse_config({"offload": {"tier": tier, "nvme_path": None}} if tier == "cpu" else {})
    shape = shape_from_config("tiny", model.config.to_dict(), 8)
    plan = make_plan(shape, 57, 3, "detached", Cluster())
    figures = rollout_figures(plan, 9)
    pages = sum(v for k, v in retained_per_rank(shape, 57, 1, "detached", 4096).items() if k.endswith("_pages"))
    if tier == "cpu":
        pages = 2 * shape.staged_layer_bytes_per_token * 56
    assert decoding_bytes(adapter_for(model), prompts, rollout, longstraw) == pages + figures["samples"] + figures[
        "logits"] > 0
