"""bench/gpu_check.sh's CPU dry run: the GPU check must run end to end before a GPU is lent, not rot unseen.

It collects the CUDA/Triton parity tests and runs every benchmark section at toy sizes on the CPU; every section
must report rows for each of its paths and no error, and the GRPO rows must carry the same loss on every path
(the fast path, the torch fallback and the conventional step compute one objective).
"""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    # every default section, and agent_decode (issue 45's turns on the 27B shape, run by name)
    names = "attention,logprobs,whole_qwen,glm_layer,triton,gated_delta,agent_decode"
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--dry-run", "--out", str(tmp_path),
                          "--sections", names], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": ""})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tests collected" in run.stdout
    # every file that marks a test `cuda` is collected, wherever it lives
    listed = next(line for line in run.stdout.splitlines() if line.startswith("== 1. CUDA parity tests: "))
    marked = subprocess.run(["grep", "-rlE", "--include=test_*.py", r"mark\.cuda", "tests"], cwd=ROOT,
                            capture_output=True, text=True).stdout.split()
    assert len(marked) >= 5 and set(listed.split(": ", 1)[1].rstrip(" =").split()) == set(marked)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    sections = report["sections"]
    assert set(sections) == {"attention", "gated_delta", "logprobs", "triton", "glm_layer", "whole_qwen",
                             "agent_decode"}
    assert all(section["error"] is None for section in sections.values())
    assert {row["path"] for row in sections["attention"]["rows"]} == {"fast", "fast_token_major_storage",
                                                                       "fast_constant_keys", "peer",
                                                                       "backward_constant_keys", "reference"}
    # which kernels "fast" ran, per section: on the CPU the project's own (flash, fla and Triton on CUDA)
    assert set(sections["attention"]["paths"]["attention forward"]) == {"torch_fused_cpu"}
    assert set(sections["gated_delta"]["paths"]["gated delta rule"]) == {"torch_chunked"}
    assert "Paths taken: attention forward: torch_fused_cpu x " in (tmp_path / "gpu_check.md").read_text()
    assert {row["path"] for row in sections["gated_delta"]["rows"]} == {"fast", "reference", "fast_forward",
                                                                     "reference_forward"}
    assert {(row["head"], row["path"]) for row in sections["logprobs"]["rows"]} == {
        (head, path) for head in ("trained", "frozen") for path in ("chunked", "full_logits")}
    assert {(row["kernel"], row["path"]) for row in sections["triton"]["rows"]} == {
        (kernel, path) for kernel in ("dsa_select", "sparse_mla fwd", "sparse_mla fwd+bwd",
                                      "sparse_mla fwd+bwd, prompt rows to a sink", "paged attention fwd+bwd")
        for path in ("fast", "reference")}
    for name in ("attention", "gated_delta", "logprobs"):  # the planner's workspace beside each measured peak
        assert all(row["planned_mib"] > 0 for row in sections[name]["rows"]), name
    # the whole-model sections: every step measured (none skipped at toy sizes), both modes, the planner beside it
    whole = sections["whole_qwen"]["rows"]
    assert {(row["prompt"], row["mode"]) for row in whole} == {(p, m) for p in (64, 96) for m in ("detached", "exact")}
    assert all(row["trains"] == "LoRA r 16 on a frozen body" and row["planned_gpu_gib"] > 0
               and row["planned_host_gib"] > 0 and row["plan_fits"] for row in whole)
    assert all(row["phases"].startswith("capture ") for row in whole)
    assert all("prefix " in row["phases"] for row in whole if row["mode"] == "exact")
    glm = sections["glm_layer"]["rows"]
    assert {(row["mode"], row["kernels"]) for row in glm} == {("detached", "auto"), ("detached", "reference"),
                                                              ("exact", "auto")}
    # float32, one objective: every path and both modes give one loss (the modes differ only in gradients)
    for rows in (whole, glm):
        for prompt in {row["prompt"] for row in rows}:
            losses = [row["loss"] for row in rows if row["prompt"] == prompt]
            assert max(losses) - min(losses) < 1e-5, losses
    # the agent rollouts: the turns, one turn at each turn's context, and the same-context ratio
    agent = sections["agent_decode"]["rows"]
    assert [(row["kind"], row.get("context_turns")) for row in agent] == [
        ("turns", None), ("one_turn", 0), ("one_turn", 1), ("one_turn", 2), ("summary", None)]
    assert agent[0]["turns"] == [2, 2] and agent[0]["full_batch_steps"] > 0
    assert agent[-1]["full_batch_speed_vs_one_turn_at_same_context"] > 0
    assert (tmp_path / "whole_qwen.png").stat().st_size > 10_000  # the steps' picture (matplotlib: a test extra)
    assert "| prompt |" in (tmp_path / "gpu_check.md").read_text()


def test_a_step_that_would_overrun_the_deadline_is_skipped_saying_so(tmp_path):
    """The device time is the budget: a step predicted (from the last one measured) to end after the deadline is
    not started; its row says why and still carries the planner's figures."""
    import sys
    import time

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    import gpu_whole_model

    sizes = gpu_whole_model.sizes_for(True)["whole_qwen"]
    model, config, note = gpu_whole_model.build_model("qwen3_6_27b.yaml", sizes["shape"], torch.device("cpu"),
                                                      torch.float32, lora=False)
    report = gpu_check.Report(str(tmp_path), True)
    steps = gpu_whole_model.Steps(report, "whole_qwen", model, config, torch.device("cpu"), sizes,
                                  time.monotonic() + 60, note)
    steps.timed["detached"] = (64, 50.0)  # as if a 64-token step had taken 50 s
    assert steps.predict(128, "detached") == pytest.approx(50.0 * (0.9 * 2 + 0.1 * 4))
    assert steps.run(128, "detached") is None
    (row,) = report.sections["whole_qwen"]["rows"]
    assert row["seconds"].startswith("skipped: predicted 110 s > ") and row["planned_gpu_gib"] > 0


def test_cudnn_probe_records_a_refusal_as_its_answer():
    """The probe of cuDNN's attention entry runs on CUDA only; where the entry refuses (here: CPU tensors, on a
    GPU perhaps grouped heads or a head dim) the row carries the error in the table's columns and nothing raises,
    so the attention section's rows stand."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    class Rows:
        def __init__(self):
            self.rows = []

        def add(self, section, row):
            self.rows.append((section, row))

    q, k, v = torch.randn(4, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    report = Rows()
    gpu_check.cudnn_probe(report, gpu_check.Clock(torch.device("cpu"), 1), q, k, v, torch.randn(4, 8, 16), q,
                          torch.zeros(4, 8), 0.25, 1.0)
    assert [(section, row["kv_heads"]) for section, row in report.rows] == [
        ("attention_cudnn_probe", "grouped"), ("attention_cudnn_probe", "expanded")]
    for _, row in report.rows:
        assert row["tk"] == 8 and row["ms"] is None
        assert row["error"].startswith("NotImplementedError") and "_scaled_dot_product_cudnn_attention" in row["error"]
