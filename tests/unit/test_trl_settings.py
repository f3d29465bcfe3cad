"""Every TRL setting the transaction does not run is refused at construction, naming it and its value, before the
model is loaded (the model path here does not exist: loading it would fail with another error)."""

import json

import pytest

from ds_longstraw.integrations.trl import LongStrawGRPOTrainer, objective_from_trl
from tests import trl_runs

MISSING_MODEL = "/nonexistent/model"

REFUSED = [
    ("entropy_coef", -0.01),
    ("cast_lm_head_to_fp32", True),
]


def _trainer(tmp_path, longstraw=None, **config):
    args = trl_runs.grpo_config(str(tmp_path), **config)
    kwargs = {} if longstraw is None else {"longstraw": longstraw}
    return LongStrawGRPOTrainer(model=MISSING_MODEL, reward_funcs=[trl_runs.reward_even_words], args=args,
                                train_dataset=trl_runs.prompts_dataset(4, 8, 32), **kwargs)


@pytest.mark.parametrize(("name", "value"), REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_unmapped_setting_is_refused(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"{name} = {value!r}"):
        _trainer(tmp_path, longstraw={}, **{name: value})


def test_every_refusal_is_named_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"entropy_coef = -0\.01.*cast_lm_head_to_fp32 = True"):
        _trainer(tmp_path, longstraw={}, entropy_coef=-0.01, cast_lm_head_to_fp32=True)


def test_expert_parallel_needs_deepspeed(tmp_path):
    with pytest.raises(ValueError, match=r"'longstraw\.ep_size' = 2 needs DeepSpeed"):
        _trainer(tmp_path, longstraw={"ep_size": 2})


def test_expert_parallel_refusals_are_named_at_once(tmp_path):
    """What ep_size > 1 does not run through the trainer (integrations/trl/experts.py), before the model loads."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "longstraw": {"ep_size": 2},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                  "gradient_clipping": "auto"}))
    with pytest.raises(ValueError, match=r"'longstraw\.ep_size' = 2 .*world size = 1 .*max_grad_norm or "
                                         r"gradient_clipping\) = 1\.0 .*rollout_func = None .*save_strategy = "
                                         r"'steps' .*top_entropy_quantile = 0\.5"):
        _trainer(tmp_path, deepspeed=str(config), max_grad_norm=1.0, save_strategy="steps", top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match=r"generate_from_capture = True"):
        args = trl_runs.grpo_config(str(tmp_path), deepspeed=str(config))
        LongStrawGRPOTrainer(model=MISSING_MODEL, reward_funcs=[trl_runs.reward_even_words], args=args,
                             train_dataset=trl_runs.prompts_dataset(4, 8, 32), generate_from_capture=True)


def test_context_parallel_needs_deepspeed_and_whole_groups(tmp_path):
    with pytest.raises(ValueError, match=r"'longstraw\.cp_size' = 2 needs DeepSpeed"):
        _trainer(tmp_path, longstraw={"cp_size": 2})
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "longstraw": {"cp_size": 2},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    with pytest.raises(ValueError, match=r"scale_rewards = 'batch'"):
        _trainer(tmp_path, deepspeed=str(config), scale_rewards="batch")


def test_bad_block_key_is_named(tmp_path):
    with pytest.raises(ValueError, match="prefix_gradd"):
        _trainer(tmp_path, longstraw={"prefix_gradd": "exact"})


def test_block_given_twice_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "longstraw": {"prefix_grad": "exact"},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    with pytest.raises(ValueError, match="given twice"):
        _trainer(tmp_path, longstraw={}, deepspeed=str(config))


def test_near_miss_block_name_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "long_straw": {},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    with pytest.raises(ValueError, match="'long_straw'.*did you mean 'longstraw'"):
        _trainer(tmp_path, deepspeed=str(config))


def test_the_mapping(tmp_path):
    """What each loss type becomes (the equivalence tests prove the values; this pins the names)."""
    cases = {"grpo": ("clip", "seq-mean-token-mean", None), "dapo": ("clip", "token-mean", None),
             "dr_grpo": ("clip", "seq-mean-token-sum-norm", 6), "luspo": ("clip", "seq-mean-token-sum-norm", 1),
             "cispo": ("cispo", "token-mean", None), "bnpo": ("clip", "token-mean", None),
             "sapo": ("sapo", "seq-mean-token-mean", None), "vespo": ("vespo", "token-mean", None)}
    for loss_type, (policy_loss, loss_agg, norm_length) in cases.items():
        objective = objective_from_trl(trl_runs.grpo_config(str(tmp_path), loss_type=loss_type, beta=0.1,
                                                            epsilon=0.1, epsilon_high=0.3))
        assert (objective.policy_loss, objective.loss_agg, objective.norm_length) == (policy_loss, loss_agg,
                                                                                      norm_length)
        assert (objective.kl_coef, objective.kl_estimator, objective.clip_low) == (0.1, "k3", 0.1)
        assert objective.clip_high == 0.3 and (loss_type != "cispo" or objective.cispo_ratio_max == 0.3)
        assert objective.temperature == 1.0
    assert objective_from_trl(trl_runs.grpo_config(str(tmp_path), temperature=0.7)).temperature == 0.7
    clipped = objective_from_trl(trl_runs.grpo_config(str(tmp_path), delta=1.5, off_policy_mask_threshold=0.1))
    assert (clipped.two_sided_clip, clipped.off_policy_mask) == (1.5, 0.1)
    # TRL's delta caps the clip loss types' ratio only
    assert objective_from_trl(trl_runs.grpo_config(str(tmp_path), loss_type="cispo", delta=1.5)).two_sided_clip is None


@pytest.mark.parametrize(("name", "value"), [("top_k", 5), ("repetition_penalty", 1.1), ("min_p", 0.1)])
def test_generate_from_capture_refusals(tmp_path, name, value):
    args = trl_runs.grpo_config(str(tmp_path), **{name: value})
    with pytest.raises(ValueError, match=rf"generate_from_capture .*{name} = {value!r}"):
        LongStrawGRPOTrainer(model=MISSING_MODEL, reward_funcs=[trl_runs.reward_even_words], args=args,
                             train_dataset=trl_runs.prompts_dataset(4, 8, 32), longstraw={},
                             generate_from_capture=True)


def test_generate_from_capture_refuses_a_rollout_func(tmp_path):
    args = trl_runs.grpo_config(str(tmp_path))
    with pytest.raises(ValueError, match="rollout_func"):
        LongStrawGRPOTrainer(model=MISSING_MODEL, reward_funcs=[trl_runs.reward_even_words], args=args,
                             train_dataset=trl_runs.prompts_dataset(4, 8, 32), longstraw={},
                             rollout_func=trl_runs.rollout_func(6, 32), generate_from_capture=True)
