"""LongStrawGRPOTrainer against TRL's own GRPOTrainer under `accelerate launch`: 2 CPU processes, DeepSpeed ZeRO-3.

tests/dist_scripts/trl_checks.py trains both trainers per case in one launch (float32, the same checkpoint, data,
seeds and completions) and reports || our update - TRL's || / || TRL's ||. Tolerance 1e-5, float32: the two sum
the same terms in different orders (a prompt's members on two processes, DeepSpeed's reduce-scatter against TRL's
per-micro-batch backward), a few ulps per step; measured 0.8e-6 .. 1.3e-6. A member normalised over the wrong
micro-batch or process count, or an optimizer step not taken, shows up at 1e-2 or more. One case samples with
generate_from_capture (the two processes decode in lockstep under ZeRO-3) and trains on the kept captures; TRL's
trainer replays each process's completions. Another does so with TRL's tool loop (tools and an environment, one
step): the processes' samples take different numbers of turns, so the lockstep pads one process's observation
forwards with ghost ones; TRL's trainer replays each process's turns through its own loop. Then "cp_size" 2 (one
replica, each prompt sharded over the two processes) against TRL's own trainer on one process, and GLM
(glm_moe_dsa) with "ep_size" 2 (each process holds half the routed experts, out of ZeRO; two data-parallel replicas)
against TRL's own trainer on one process with both processes' rows. Last, top_entropy_quantile under ZeRO-3 on two
processes is refused at construction.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from dist_scripts.launching import REPO, free_port, launcher_env

from tests import trl_runs, trl_tools

pytestmark = pytest.mark.slow

TOL = 1e-5
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


def test_same_weights_as_trl_under_accelerate_zero3(tmp_path):
    trl_runs.save_tiny_model(str(tmp_path / "model"), dtype=torch.float32)
    trl_tools.save_driven_model(str(tmp_path / "tools"), dtype=torch.float32)  # the tool-loop case's
    # the context-parallel case's reference: TRL's own trainer on one process (its replica's data), no DeepSpeed
    sys.path.insert(0, os.path.join(REPO, "tests", "dist_scripts"))
    from trl import GRPOTrainer
    from trl_checks import CP_CASE, EP_REFERENCE

    from tests.glm_models import glm_reference

    torch.save(trl_runs.train(GRPOTrainer, str(tmp_path / "model"), str(tmp_path / "reference"), dtype=torch.float32,
                              **CP_CASE), tmp_path / "cp_reference.pt")
    # the expert-parallel case's reference: TRL's own trainer on one process (both replicas' rows), no DeepSpeed
    trl_runs.save_tiny_glm(str(tmp_path / "glm"), dtype=torch.float32)
    with glm_reference():  # transformers' indexer picks ties canonically, as the adapter does
        torch.save(trl_runs.train(GRPOTrainer, str(tmp_path / "glm"), str(tmp_path / "glm_reference"),
                                  dtype=torch.float32, **EP_REFERENCE), tmp_path / "ep_reference.pt")
    out, log = tmp_path / "out.json", tmp_path / "log.txt"
    env = {**launcher_env(), "TRL_CHECKS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [ACCELERATE, "launch", "--use_deepspeed", "--zero_stage", "3", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "tests/dist_scripts/trl_checks.py", str(out)]
    with open(log, "w") as handle:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=1200).returncode
    assert code == 0, log.read_text()[-6000:]
    results = json.loads(out.read_text())
    # generate_from_capture: every group of both processes trained on the capture its samples were decoded from
    assert results.pop("capture-reused-share") == 1.0
    # the tool loop from the capture: TRL's own loop over the same turns built the same completions, masks and
    # messages on both processes; every group trained on its kept capture
    assert results.pop("tool-loop-same-turns") == 2
    assert results.pop("tool-loop-capture-reused-share") == 1.0
    # the lockstep was exercised: the processes' samples took different numbers of turns (tool-message runs per
    # generation batch, per process), and a process padded its observation forwards with ghost ones
    observations = results.pop("tool-loop-observations")
    assert observations[0] != observations[1] and sum(map(sum, observations)) > 0, observations
    assert results.pop("tool-loop-ghost-observations") > 0
    # expert parallelism: each process holds 2 slices (gate_up_proj, down_proj) of each of the 3 MoE blocks, the
    # policy's blocks are no ZeRO-3 leaves (their experts are out of ZeRO) and TRL's reference engine's are (set
    # before TRL built it)
    assert (results.pop("expert-slices"), results.pop("policy-moe-leaves"), results.pop("reference-moe-leaves")) \
        == (6, 0, 3)
    assert "top_entropy_quantile = 0.5 under ZeRO-3" in (results.pop("top-entropy-quantile-refused") or "")
    assert set(results) == {"dapo-two-steps", "grpo-beta-two-iterations", "bnpo-tools", "grpo-split-prompts",
                            "generate-from-capture", "tool-loop", "context-parallel", "expert-parallel"}
    for name, difference in results.items():
        # tool-loop holds to the same 1e-5 (measured 5.4e-7): the same sums over the actions' tokens in other orders;
        # the tool messages' tokens put in the loss: 4.6 (two steps)
        # expert-parallel holds to the same 1e-5 (measured 1.3e-6): besides the summation orders above, its routed
        # pairs are computed on their expert's process and summed on the token's, and its float32 router picks the
        # same experts on both sides; the slices' gradients summed instead of averaged over the two replicas: 0.29
        assert difference < TOL, (name, difference)


def test_the_example_trains(tmp_path):
    """examples/trl_grpo.py (TRL's generation, the needle reward) takes its steps on one process through the
    block given as an argument, and reports a finite reward per step."""
    env = {**launcher_env(), "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run([sys.executable, "examples/trl_grpo.py", "--no-deepspeed", "--steps", "2", "--prompt", "512",
                           "--output-dir", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2 and all(0.0 <= r <= 2.0 for r in report["reward"])
