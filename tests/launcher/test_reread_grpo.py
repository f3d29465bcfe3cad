"""The reread_hint task (ds_longstraw.tasks.reread_hint) by GRPO in exact mode: the policy rises above chance.

  learning:  the two-phase warm-up (reread_hint.warm_checkpoint: "? k" -> v at two records, then "@ k" -> w at ONE
             record; built into runs/reread_hint/warmup on first use, as bench/exact_pays_study.py --task reread_hint
             builds it, then reused) never asked "! k" for a field (its "!" prompts had random labels): held-out
             exact match on "! k" at two records and 40 tokens is near chance. GRPO through the engine
             (recall_grpo.train with configs/run/reread_hint_task.yaml: `engine.grpo_step` with rollouts, prefix_grad
             exact, seed 0) raises it above chance by more than MARGIN in STEPS steps.
What the rise shows, and what it does not: the policy learns to read a record's second field for "!" (the query's
side; the "@" readout formed at one record is there to reuse). It does not show the binding that would take it above
1/records = 0.5 (the second field's position holding its key); see BENCHMARKS.md, "When exact mode pays".
The task's layout, rewards and refused sizes: tests/unit/test_reread_hint_task.py.
"""

import time
from pathlib import Path

import pytest
import torch

from ds_longstraw.tasks import reread_hint

LENGTH, STEPS, CHANCE = 40, 20, 1 / 6  # chance: 1/values, a value drawn without reading the prompt
# MARGIN from the study's exact runs (bench/results/exact_pays_hint.json: lr 1e-3, this config, 256 held-out prompts):
# from the warm-up's 0.231, step 20 stood at 0.398, 0.457, 0.457 (seeds 0, 1, 2; this test's run is the seed-0 one and
# gave the same 0.398), step 15 at 0.301, 0.422, 0.348. The smallest rise in 20 steps, 0.168, is ~6 binomial sd of a
# 256-prompt accuracy near 0.3 (sd ~0.029). MARGIN 0.1 is ~3.5 sd, so a policy that does not read the prompt (within
# ~2 sd of 1/6) fails the first bound, and 3/5 of that smallest rise, so the run must rise, not merely start above
# chance (the warm-up's "! k", 0.231, leans a little on "@"'s readout: 2.7 sd above 1/6).
MARGIN = 0.1
WARMUP_DIR = Path(__file__).resolve().parents[2] / "runs" / "reread_hint" / "warmup"
RUN_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "run" / "reread_hint_task.yaml"


def _warm():
    warm, info = reread_hint.warm_checkpoint(WARMUP_DIR, log=lambda line: None)
    levels = info["levels"]
    assert levels["first@2"]["20"] >= 0.9 and levels["hint@1"]["20"] >= 0.9  # both readouts formed at 20 tokens
    return warm, levels


@pytest.mark.slow
def test_grpo_exact_rises_above_chance(tmp_path):
    """Warm-up (cached) -> GRPO, exact, at LENGTH tokens: the held-out accuracy on "! k" ends above CHANCE + MARGIN,
    and above where it started by MARGIN."""
    from ds_longstraw.tasks import recall_grpo

    torch.set_num_threads(1)  # tests/conftest.py's rule: with 2 threads on a loaded 2-core machine it ran 5x slower
    warm, levels = _warm()
    start = time.perf_counter()
    result = recall_grpo.train(tmp_path / "grpo", warm_dir=warm, prefix_grad="exact", seed=0, steps=STEPS,
                               eval_every=STEPS, eval_lengths=(LENGTH,), run_config=RUN_CONFIG,
                               log=lambda line: None)
    before, after = (e["accuracy"][LENGTH] for e in (result["evals"][0], result["evals"][-1]))
    assert before == levels["second@2"][str(LENGTH)]  # the same held-out prompts as the warm-up's own measure
    assert after > CHANCE + MARGIN and after > before + MARGIN, (before, after, result["evals"])
    # measured on 2 cores shared with other work: 68 s at a load of ~3 (78 s for this file, the warm-up cached); 313 s
    # with two more GRPO runs beside it at a load of ~6. Building the warm-up (a clean clone) comes before the clock:
    # 95 s at a load of ~4, 205 s at ~6. The bound catches a step grown several times slower, not a busy machine.
    assert time.perf_counter() - start < 420


@pytest.mark.slow
def test_two_runs_in_one_process(tmp_path):
    """recall_grpo.train twice in one process (a study's seeds, the recall and reread tests in one pytest run): the
    first run's process group is torn down with the groups DeepSpeed cached from it, so the second builds its
    engine on its own group (with torch's teardown alone, ZeRO-3 asked the destroyed group for its rank)."""
    from ds_longstraw.tasks import recall_grpo

    torch.set_num_threads(1)
    warm, _ = _warm()
    for run in range(2):
        result = recall_grpo.train(tmp_path / str(run), warm_dir=warm, prefix_grad="detached", seed=run, steps=1,
                                   eval_every=1, eval_lengths=(LENGTH,), eval_prompts=16, run_config=RUN_CONFIG,
                                   log=lambda line: None)
        assert [e["step"] for e in result["evals"]] == [0, 1]
    assert not torch.distributed.is_initialized()
