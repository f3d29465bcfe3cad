"""The reread task (ds_longstraw.tasks.reread) by GRPO in exact mode: the policy leaves the warm-up's habit.

  learning:  the supervised warm-up (reread.WARMUP: "? k" -> v at 20-token prompts; built into runs/reread/warmup on
             first use, as bench/exact_pays_study.py builds it, then reused) answers "! k" with the first field v,
             which is never the asked second field w: held-out exact match 0.000 at 40 tokens. GRPO through the
             engine (recall_grpo.train with configs/run/reread_task.yaml: `engine.grpo_step` with rollouts,
             prefix_grad exact, seed 0) at 40-token prompts raises it by more than MARGIN in STEPS steps.
What this does not show: a rise ABOVE chance (1/values = 0.167). In the study (BENCHMARKS.md, "When exact mode pays")
both modes rise from 0 to about chance within 5-15 steps and stay there for 50: they stop answering v and settle on
a value that does not depend on the prompt; neither builds the second field's lookup in that budget.
The task's layout, rewards and refused sizes: tests/unit/test_reread_task.py.
"""

import time
from pathlib import Path

import pytest
import torch

from ds_longstraw.tasks import reread

# STEPS and MARGIN from the study's runs (bench/results/exact_pays_study.json): from 0.000, exact mode at lr 6e-3 stood
# at 0.137-0.168 at step 5-10 (sweep, seed 100) and at 0.160, 0.141, 0.188 at step 10 (seeds 0, 1, 2). MARGIN 0.1 is
# about three quarters of the smallest of those rises and four times the binomial sd of a 256-prompt accuracy near 0.15
# (~0.022): a step that did nothing, or a reward that was not read, leaves the policy answering v (0.000).
LENGTH, STEPS, MARGIN, LR = 40, 10, 0.1, 6e-3
WARMUP_DIR = Path(__file__).resolve().parents[2] / "runs" / "reread" / "warmup"


@pytest.mark.slow
def test_grpo_exact_leaves_the_first_field(tmp_path):
    """Warm-up (cached) -> GRPO, exact, at LENGTH tokens, lr LR: the held-out accuracy on "! k" rises from the
    warm-up's (0: it answers v) by more than MARGIN in STEPS steps."""
    from ds_longstraw.tasks import recall_demo, recall_grpo

    torch.set_num_threads(1)  # tests/conftest.py's rule: with 2 threads on a loaded 2-core machine it ran 5x slower
    start = time.perf_counter()
    warm, info = recall_demo.warm_checkpoint(WARMUP_DIR, log=lambda line: None, task=reread,
                                             short=reread.WARMUP_SIZES, recipe=reread.WARMUP,
                                             eval_lengths=reread.WARMUP_EVAL_LENGTHS)
    assert info["accuracy_short"] >= 0.9  # the warm-up reads the first field at its own length
    run_config = recall_grpo.CONFIGS_DIR / "run" / "reread_task.yaml"
    result = recall_grpo.train(tmp_path / "grpo", warm_dir=warm, prefix_grad="exact", seed=0, steps=STEPS,
                               eval_every=STEPS, eval_lengths=(LENGTH,), overrides=[f"optim.lr={LR}"],
                               run_config=run_config, log=lambda line: None)
    before, after = (e["accuracy"][LENGTH] for e in (result["evals"][0], result["evals"][-1]))
    assert before < 0.05  # the warm-up's habit: v for "! k", never right
    assert after > before + MARGIN, (before, after, result["evals"])
    # measured on 2 cores shared with other work (load ~5): 42 s with the warm-up cached, 131 s from a clean clone
    # (the warm-up built here, 97 s of CPU in all); the bound leaves room for a busier machine
    assert time.perf_counter() - start < 300


@pytest.mark.slow
def test_two_runs_in_one_process(tmp_path):
    """recall_grpo.train twice in one process (a study's seeds, the recall and reread tests in one pytest run): the
    first run's process group is torn down with the groups DeepSpeed cached from it, so the second builds its
    engine on its own group (with torch's teardown alone, ZeRO-3 asked the destroyed group for its rank)."""
    from ds_longstraw.tasks import recall_demo, recall_grpo

    torch.set_num_threads(1)
    warm, _ = recall_demo.warm_checkpoint(WARMUP_DIR, log=lambda line: None, task=reread,
                                          short=reread.WARMUP_SIZES, recipe=reread.WARMUP,
                                          eval_lengths=reread.WARMUP_EVAL_LENGTHS)
    run_config = recall_grpo.CONFIGS_DIR / "run" / "reread_task.yaml"
    for run in range(2):
        result = recall_grpo.train(tmp_path / str(run), warm_dir=warm, prefix_grad="detached", seed=run, steps=1,
                                   eval_every=1, eval_lengths=(LENGTH,), eval_prompts=16, run_config=run_config,
                                   log=lambda line: None)
        assert [e["step"] for e in result["evals"]] == [0, 1]
    assert not torch.distributed.is_initialized()
