"""LongStrawGRPOTrainer against TRL's own GRPOTrainer: the same weights after one and two optimizer steps.

Both trainers get the same model checkpoint, dataset, seeds and completions (tests/trl_runs.py: a seeded
rollout_func), run in float64 end to end (trl_runs.in_float64), with SGD so that the weights' update is the
gradient itself (Adam's first step is lr * sign(g), where float noise on a near-zero component can flip a sign).
The measure is || our update - TRL's || / || TRL's ||; 1e-8 because the two sum the same float64 terms in another
order (measured: ~5e-11), while a missing normaliser, a member in the wrong micro-batch's scope or a dropped
KL term moves it by 1e-3 or more. Exact mode only: TRL back-propagates through the prompt, as exact mode does;
detached mode (the block's default) holds the prompt's state constant, and test_detached_mode_differs shows it.
"""

import pytest
import torch
from trl import GRPOTrainer

from ds_longstraw.integrations.trl import LongStrawGRPOTrainer
from tests import trl_runs

EXACT = {"prefix_grad": "exact"}
TOLERANCE = 1e-8

CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dapo": dict(loss_type="dapo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.5),
    "luspo": dict(loss_type="luspo"),
    "grpo-beta-two-steps": dict(loss_type="grpo", beta=0.3, max_steps=2),
    "dapo-beta-bias-corrected-kl": dict(loss_type="dapo", beta=0.3, use_bias_correction_kl=True, max_steps=2,
                                        num_iterations=2),
    "gspo-sequence-ratio": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2,
                                max_steps=2),
    "dapo-two-iterations": dict(loss_type="dapo", num_iterations=2, max_steps=2, epsilon=0.05),
    "bnpo-two-steps-beta": dict(loss_type="bnpo", beta=0.3, max_steps=2),
    "dapo-tools": dict(loss_type="dapo", tool_masks=True),
    "grpo-tools-two-iterations": dict(loss_type="grpo", tool_masks=True, num_iterations=2, max_steps=2),
    "dr_grpo-masked-truncation": dict(loss_type="dr_grpo", mask_truncated_completions=True),
    # peft LoRA: only the adapters train; the reference is the model with its adapters disabled, in both trainers
    "dapo-lora-beta": dict(loss_type="dapo", beta=0.3, max_steps=2, lora=True),
    # TRL scores every log-prob at its sampling temperature (logits / 0.7): the policy's, the reference's (beta) and
    # the old ones (two iterations), over two steps; 1.3 on the other side of 1
    "dapo-temperature-0.7-beta-two-iterations": dict(loss_type="dapo", temperature=0.7, beta=0.3, num_iterations=2,
                                                     max_steps=2),
    "grpo-temperature-1.3-bias-corrected-kl": dict(loss_type="grpo", temperature=1.3, beta=0.3,
                                                   use_bias_correction_kl=True),
    # the second iteration's ratios (one SGD step away) pass delta 1.002 on some tokens: the cap bites
    "dapo-delta-two-iterations": dict(loss_type="dapo", delta=1.002, epsilon=0.05, num_iterations=2, max_steps=2),
    # SAPO's gate temperatures exact in float32 (tests/objective_cases.py says why)
    "sapo-two-iterations": dict(loss_type="sapo", sapo_temperature_pos=0.75, sapo_temperature_neg=1.25,
                                num_iterations=2, max_steps=2),
    "vespo-two-iterations-beta": dict(loss_type="vespo", vespo_k_pos=1.5, num_iterations=2, max_steps=2, beta=0.3),
    # threshold 0: a negative-advantage member whose log-probs rose since the first iteration is dropped
    "grpo-off-policy-mask": dict(loss_type="grpo", off_policy_mask_threshold=0.0, num_iterations=2, max_steps=2),
    # steps_per_generation: one generation batch (4 micro-batches) over two optimizer steps: the second step's
    # members are off-policy, their old log-probs the generation's weights' (clipped at epsilon 0.01)
    "dapo-steps-per-generation-4": dict(loss_type="dapo", steps_per_generation=4, epsilon=0.01, max_steps=2,
                                        beta=0.3),
    "grpo-steps-per-generation-4-two-iterations": dict(loss_type="grpo", steps_per_generation=4, epsilon=0.01,
                                                       num_iterations=2, max_steps=4),
    # 3 micro-batches for steps of 2: the second step trains the first generation's last micro-batch (old log-probs
    # of the first step's weights) and the next generation's first (made in that step: ratio 1)
    "bnpo-steps-per-generation-3": dict(loss_type="bnpo", steps_per_generation=3, epsilon=0.01, max_steps=3),
    # a generation per micro-step, two in each optimizer step (no old log-probs, as TRL's)
    "dapo-steps-per-generation-1": dict(loss_type="dapo", steps_per_generation=1, max_steps=2, beta=0.3),
    # TRL's entropy bonus: a per-micro-batch token mean over the trained tokens whatever the loss type
    "dapo-entropy-coef": dict(loss_type="dapo", entropy_coef=0.05, max_steps=2),
    "grpo-entropy-coef-tools-two-iterations": dict(loss_type="grpo", entropy_coef=0.05, tool_masks=True,
                                                   num_iterations=2, max_steps=2),
    # the adaptive controller: off in the first step (no entropy measured yet), then on and growing (target 10
    # nats: above this model's entropy), over three steps
    "bnpo-adaptive-entropy": dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.05,
                                  entropy_coef_delta=0.02, entropy_target=10.0, max_steps=3),
    # TRL's top_entropy_quantile: the policy term only on the micro-batch's highest-entropy tokens (an entropy pass
    # before the transactions); with the entropy bonus over the same tokens, and with beta (its KL keeps every token)
    "dapo-top-entropy-quantile": dict(loss_type="dapo", top_entropy_quantile=0.4, max_steps=2, beta=0.3),
    "grpo-top-entropy-quantile-bonus-tools": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.05,
                                                  tool_masks=True, num_iterations=2, max_steps=2),
    "bnpo-top-entropy-quantile-steps-per-generation": dict(loss_type="bnpo", top_entropy_quantile=0.3,
                                                           steps_per_generation=4, epsilon=0.01, max_steps=2),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trl") / "model")
    trl_runs.save_tiny_model(path)
    return path, trl_runs.initial_weights(path)


def _both(checkpoint, tmp_path, longstraw=EXACT, **case):
    path, initial = checkpoint
    torch.manual_seed(0)
    theirs = trl_runs.train(GRPOTrainer, path, str(tmp_path / "trl"), **case)
    ours = trl_runs.train(LongStrawGRPOTrainer, path, str(tmp_path / "ours"), longstraw=longstraw, **case)
    if case.get("lora"):  # the adapters' update from their own initial values (seeded alike in both trainers)
        initial = {n: theirs.pop(f"initial/{n}") for n in list(theirs) if not n.startswith("initial/")}
        assert all(torch.equal(ours.pop(f"initial/{n}"), w) for n, w in initial.items())
    return trl_runs.update_difference(initial, ours, theirs)


@pytest.mark.parametrize("name", list(CASES))
def test_same_weights_as_trl(checkpoint, tmp_path, name):
    assert _both(checkpoint, tmp_path, **CASES[name]) < TOLERANCE


def test_tool_outputs_in_steps(checkpoint, tmp_path, monkeypatch):
    """TRL's tool masks with spans past the longstraw block's member_span_capture: those completions take the
    captured path (grpo/member_steps.py) with nothing else changed in the script, and the weights still equal TRL's
    own trainer's (which keeps every tool token's graph)."""
    from ds_longstraw.grpo import replay as replay_module

    stepped, original = [], replay_module.replay_in_steps

    def counted(*args, **kwargs):
        stepped.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(replay_module, "replay_in_steps", counted)
    longstraw = {**EXACT, "member_span_capture": 2}
    assert _both(checkpoint, tmp_path, longstraw=longstraw, loss_type="grpo", tool_masks=True, max_steps=2,
                 max_completion_length=12) < TOLERANCE
    assert stepped


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_prompts_sharing_a_document(checkpoint, tmp_path, monkeypatch, mode):
    """Prompts that open with the same 16-word document and ask their own 8-word question: a generation batch's
    groups capture the document once (grpo/shared.py) without any change to the script, and the weights equal TRL's
    own trainer's (exact mode; with beta, so the reference follows the tree too). Detached mode holds the document's
    state constant, as it holds a prompt's: its update equals the same trainer's without the sharing."""
    from ds_longstraw.grpo import shared

    documents, original = [], shared._shared_step

    def counted(common, groups, scopes, document):
        documents.append((len(groups), document.tokens))
        return original(common, groups, scopes, document)

    monkeypatch.setattr(shared, "_shared_step", counted)
    case = dict(loss_type="dapo", beta=0.3, max_steps=2, document=16, prompt_len=24)
    if mode == "exact":
        assert _both(checkpoint, tmp_path, longstraw={**EXACT, "shared_prefix_min": 8}, **case) < TOLERANCE
    else:
        path, initial = checkpoint
        detached = {"prefix_grad": "detached"}
        alone = trl_runs.train(LongStrawGRPOTrainer, path, str(tmp_path / "alone"),
                               longstraw={**detached, "shared_prefix_min": None}, **case)
        assert documents == []
        torch.manual_seed(0)
        together = trl_runs.train(LongStrawGRPOTrainer, path, str(tmp_path / "shared"),
                                  longstraw={**detached, "shared_prefix_min": 8}, **case)
        assert trl_runs.update_difference(initial, together, alone) < TOLERANCE
    # every step's groups shared the 16-word document (the longest common prefix: one word more where the
    # questions happen to open alike)
    assert documents and all(groups >= 2 and tokens >= 16 for groups, tokens in documents)


# TRL's per-micro-batch metrics, averaged over each logged step's micro-batches by TRL's log()
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
           "clip_ratio/high_max", "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss",
           "entropy_coef")
METRIC_CASES = {
    # epsilon 0.01: the second iteration's ratios (one SGD step away) leave [0.99, 1.01] on some tokens
    "dapo-temperature-beta-two-iterations": dict(loss_type="dapo", temperature=0.7, beta=0.3, num_iterations=2,
                                                 max_steps=2, epsilon=0.01),
    "gspo-bias-corrected-kl-tools": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.3,
                                         use_bias_correction_kl=True, tool_masks=True, num_iterations=2, max_steps=2,
                                         epsilon=0.002),
    "cispo-two-iterations": dict(loss_type="cispo", epsilon_high=1.0, num_iterations=2, max_steps=2),
    "dapo-delta-two-iterations": dict(loss_type="dapo", delta=1.002, epsilon=0.001, num_iterations=2, max_steps=2),
    "vespo-two-iterations": dict(loss_type="vespo", num_iterations=2, max_steps=2),
    # the entropy bonus logs policy_loss per micro-batch and the (adaptive) coefficient per step
    "grpo-adaptive-entropy-steps-per-generation": dict(loss_type="grpo", use_adaptive_entropy=True,
                                                       entropy_coef=0.05, entropy_coef_delta=0.02,
                                                       entropy_target=10.0, max_steps=2, steps_per_generation=4,
                                                       epsilon=0.01),
    "dapo-top-entropy-quantile-bonus": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.05,
                                            num_iterations=2, max_steps=2, epsilon=0.01),
    "dapo-entropy-coef-beta": dict(loss_type="dapo", entropy_coef=0.05, beta=0.3, max_steps=2, num_iterations=2,
                                   epsilon=0.01),
}


@pytest.mark.parametrize("name", list(METRIC_CASES))
def test_logged_metrics_equal_trls(checkpoint, tmp_path, name):
    """The metrics TRL's own trainer logs at each step (kl, entropy, the clip ratios) are logged alike, by TRL's
    definitions, from the transactions' log-probs and entropies (float64: the same terms summed in another order,
    1e-10 relative; a clip share is a count over a count, which TRL takes in float32). The clips bite in the second
    iteration (checked), so a wrong weight or bound shows; the transaction's own metrics are logged beside them."""
    path, _ = checkpoint
    case = METRIC_CASES[name]
    theirs, ours = [], []
    torch.manual_seed(0)
    trl_runs.train(GRPOTrainer, path, str(tmp_path / "trl"), logs=theirs, **case)
    trl_runs.train(LongStrawGRPOTrainer, path, str(tmp_path / "ours"), longstraw=EXACT, logs=ours, **case)
    theirs, ours = [e for e in theirs if "entropy" in e], [e for e in ours if "entropy" in e]
    assert len(theirs) == len(ours) == case["max_steps"]
    compared = set()
    for step, (want, got) in enumerate(zip(theirs, ours, strict=True)):
        for key in METRICS:
            if key not in want:
                assert key not in got, (step, key)
                continue
            compared.add(key)
            # TRL takes the clip shares of .float() indicators: float32 sums and quotient of small counts, within
            # 2 float32 roundings (6e-8 each) of the exact share computed here
            rel = 2e-7 if "clip" in key else 1e-10
            assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-12), (step, key, got[key], want[key])
        assert got["longstraw/capture_seconds"] > 0 and got["longstraw/pages_bytes"] > 0
        assert got["longstraw/capture_reused"] == 0.0
    assert "entropy" in compared and ("kl" in compared) == ("beta" in case)
    bonus = "entropy_coef" in case or "use_adaptive_entropy" in case
    assert ({"policy_loss", "entropy_coef"} <= compared) == bonus
    if case.get("use_adaptive_entropy"):  # the controller moved the coefficient
        assert theirs[-1]["entropy_coef"] != case["entropy_coef"]
    if case["loss_type"] == "vespo":  # the weight moved off phi(1) = 1 in the second iteration
        assert theirs[-1]["vespo/phi_seq_mean"] != 1.0
        return
    clip_keys = [k for k in compared if "clip" in k and not k.endswith("_min")]
    assert any(theirs[-1][k] > 0 for k in clip_keys), {k: theirs[-1][k] for k in clip_keys}


def test_steps_per_generation_old_logprobs_matter(checkpoint, tmp_path, monkeypatch):
    """The check can fail: with steps_per_generation 4 the second optimizer step trains members generated before the
    first step; scored with the current weights as their old log-probs (ratio 1, no clip) instead of the
    generation's, the update is another."""
    from ds_longstraw.integrations.trl import trainer as trainer_module

    original = trainer_module.prompt_groups
    monkeypatch.setattr(trainer_module, "prompt_groups",
                        lambda *args, **kwargs: original(*args, **{**kwargs, "old_logprobs": {}}))
    assert _both(checkpoint, tmp_path, **CASES["dapo-steps-per-generation-4"]) > 1e-4


def test_entropy_bonus_normalisation_matters(checkpoint, tmp_path, monkeypatch):
    """The check can fail: the entropy bonus normalised as the dapo loss (the objective's entropy_agg "loss") in
    place of TRL's per-micro-batch token mean takes another step."""
    import dataclasses

    from ds_longstraw.integrations.trl import trainer as trainer_module

    original = trainer_module.objective_from_trl
    monkeypatch.setattr(trainer_module, "objective_from_trl",
                        lambda *a, **k: dataclasses.replace(original(*a, **k), entropy_agg="loss"))
    assert _both(checkpoint, tmp_path, **CASES["dapo-entropy-coef"]) > 1e-4


def test_top_entropy_quantile_mask_matters(checkpoint, tmp_path, monkeypatch):
    """The check can fail: without the entropy pass's mask (every trained token in the policy term) the update is
    another."""
    from ds_longstraw.integrations.trl.trainer import LongStrawGRPOTrainer as Trainer

    monkeypatch.setattr(Trainer, "_entropy_masks", lambda self, *args: None)
    assert _both(checkpoint, tmp_path, **CASES["dapo-top-entropy-quantile"]) > 1e-4


def test_detached_mode_differs(checkpoint, tmp_path):
    """The check can fail: detached mode's gradient (prompt state constant) is not TRL's full-sequence one."""
    assert _both(checkpoint, tmp_path, longstraw={"prefix_grad": "detached"}, loss_type="dapo") > 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_from_capture(checkpoint, tmp_path, temperature):
    """generate_from_capture: the completions are sampled from the captured prompt and every step trains on that
    capture (one prompt pass per step); TRL's own trainer, given the same completions, takes the same steps (at
    temperature 0.7 both score logits / 0.7, and the samples are drawn at it)."""
    path, initial = checkpoint
    calls, reused = [], []

    def record(trainer):
        sample, run_groups = trainer._sampler.sample, trainer._run_groups

        def recording_sample(model, prompt_ids, **kwargs):
            completions = sample(model, prompt_ids, **kwargs)
            calls.append((prompt_ids, completions))
            return completions

        def recording_run(groups, *rest):
            results = run_groups(groups, *rest)
            reused.extend(result.extras.get("capture_reused", False) for result in results)
            return results

        trainer._sampler.sample, trainer._run_groups = recording_sample, recording_run

    # one prompt per generation batch (2 x 2 rows = its 4 generations), so its capture is kept
    case = dict(loss_type="dapo", max_steps=2, per_device_train_batch_size=2, max_completion_length=5,
                temperature=temperature)
    logs = []
    ours = trl_runs.train(LongStrawGRPOTrainer, path, str(tmp_path / "ours"), longstraw=EXACT, rollout=None,
                          on_trainer=record, trainer_kwargs={"generate_from_capture": True}, logs=logs, **case)
    assert len(calls) == 2 and reused == [True, True]
    assert [e["longstraw/capture_reused"] for e in logs if "longstraw/capture_reused" in e] == [1.0, 1.0]
    if temperature == 1.0:  # some samples ended with eos (at 0.7, the sharper softmax, none happens to)
        assert {len(c) for _, completions in calls for c in completions} != {case["max_completion_length"]}
    theirs = trl_runs.train(GRPOTrainer, path, str(tmp_path / "trl"), rollout=trl_runs.replayed(calls), **case)
    assert trl_runs.update_difference(initial, ours, theirs) < TOLERANCE
