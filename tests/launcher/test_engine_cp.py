"""Context parallelism inside the DeepSpeed engine: `"longstraw": {"cp_size": 2}`, started by the real `deepspeed`
launcher (tests/dist_scripts/engine_cp_checks.py; see its docstring for groups and weights). Two jobs run at once:

  W = 4  two data-parallel replicas x CP 2 (ranks 0-1 and 2-3 form the CP groups); replica 0 brings [A, B],
         replica 1 brings [C]:
           zero3  ZeRO-3, every parameter partitioned, detached, "cp_replay": "auto" (gathered here): the CP
                  capture and replay are padded so all four ranks make the same submodule calls (shard chunk
                  counts 5/5, 5/4 vs 7/7; members, blocks and a whole group slot differ) == SGD on
                  (g_A + g_B)/4 + g_C/2 from single-process grpo_backward
           zero2  ZeRO stage 2, exact (the layer-major CP prefix pass) == the same average
           zero3exact  ZeRO-3, exact, Ulysses capture, host-tier pages: the Ulysses capture and the layer-major
                  prefix pass padded (every rank makes the same submodule calls) == the same average
           glm3exact  the same on a tiny glm_moe_dsa (LSE capture, host tier): its global top-k capture padded,
                  and the owner's SELECT / FORWARD / BACKWARD requests answered inside the mirrored turns
           zero3spread  ZeRO-3, exact, host tier, "cp_replay": "spread": each CP rank replays its own members,
                  padded to the common member slots of all four ranks
           glm3ep  the same with "ep_size" 2 and the layer-major prefix pass: each CP group is also the EP group
                  (GLM-5.2's CP32/EP32 layout), each rank's expert slice outside ZeRO, its gradient summed over the
                  replicas holding it; "cp_replay": "gathered", the pages' gradients returned to their ranks
           rollout  ZeRO-3, detached, grpo_step(prompts, rollout=) with eos ids (replica 0 two prompts, replica 1
                  one): the replicas decode in lockstep; samples == one process's, the step == the average
           document  ZeRO-3, exact: replica 0's two groups share a document, run as one group over it sharded
                  over its CP group (grpo/flat_document.py), padded against replica 1's C == the average
           document_detached  the same in detached mode, each member holding its question
  W = 2  one replica of CP 2: == single-process SGD on (g_A + g_B)/2
           zero3  ZeRO-3, detached
           zero3kept  ZeRO-3, exact, prefix_keep_attention, "cp_prefix": "turns": mirrored turns in which the
                  owner's forward requests are skipped (its attention was kept from capture) and only the
                  backward ones answered
           glm3   ZeRO-3, detached, on the tiny glm_moe_dsa
No explicit CP all-reduce runs under the engine: each CP rank back-propagates the whole replay and cp_size x its
own prefix share, and DeepSpeed's average over all W ranks is then the average over the W / cp_size replicas.
Tolerance: float32, relative 1e-5 on the parameter update (measured ~7e-7); the controls show a missing prefix
gradient or wrong group weights would be off by far more.
"""

import json
import os
from itertools import pairwise

import pytest
from dist_scripts.launching import REPO, finish, free_port, start

from ds_longstraw.engine.config import read_block

TOL = 1e-5
SCRIPT = os.path.join(REPO, "tests", "dist_scripts", "engine_cp_checks.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_cp")
    jobs = {4: "zero3,zero2,zero3exact,glm3exact,glm3ep,zero3spread,rollout,document,document_detached",
            2: "zero3,zero3kept,glm3"}
    dirs, logs, procs = {}, [], []
    for world, checks in jobs.items():
        dirs[world] = out / f"w{world}"
        dirs[world].mkdir()
        logs.append(str(dirs[world] / "launcher.log"))
        procs.append(start(["--num_gpus", str(world), "--master_port", str(free_port())],
                           [SCRIPT, "--out", str(dirs[world]), "--checks", checks], logs[-1]))
    finish(procs, timeout=400, logs=logs)
    ranks = {}
    for world in jobs:
        ranks[world] = []
        for rank in range(world):
            with open(dirs[world] / f"engine_cp_rank{rank}.json") as handle:
                ranks[world].append(json.load(handle))
    return ranks


def _check(results, world, name):
    out = []
    for rank, result in enumerate(results[world]):
        assert result["world"] == world
        assert "error" not in result[name], f"world {world} rank {rank}:\n{result[name]['error']}"
        out.append(result[name])
    return out


@pytest.mark.slow
def _pieces(shard):
    """A report's shard as a list of (lo, hi): one contiguous shard, or a rank's pieces."""
    return [tuple(shard)] if isinstance(shard[0], int) else [tuple(piece) for piece in shard]


@pytest.mark.parametrize("world,name", [(4, "zero3"), (4, "zero2"), (4, "zero3exact"), (4, "glm3exact"),
                                        (4, "glm3ep"), (4, "zero3spread"), (2, "zero3"), (2, "zero3kept"),
                                        (2, "glm3")])
def test_cp_step_equals_data_parallel_average(results, world, name):
    checks = _check(results, world, name)
    for rank, r in enumerate(checks):
        assert (r["cp_rank"], r["cp_size"]) == (rank % 2, 2)
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_mean_loss"], rel=1e-6)
        for control, value in r["controls"].items():
            assert value > 100 * TOL, (control, r)
    # the prompt really is sharded: the CP ranks of a replica hold non-overlapping pieces that tile it, each rank
    # some tokens; both families take the zigzag layout (2 pieces a rank), but contiguous shards under Ulysses
    # capture (zero3exact) and for glm_moe_dsa's prefix pass in turns (glm3exact)
    layout = "contiguous" if name in ("zero3exact", "glm3exact") else "zigzag"
    for lo_rank, hi_rank in zip(checks[0::2], checks[1::2], strict=True):
        layouts_of_pair = zip(lo_rank["layouts"], hi_rank["layouts"], strict=True)
        for mine, theirs, layouts in zip(lo_rank["shards"], hi_rank["shards"], layouts_of_pair, strict=True):
            pieces = sorted(_pieces(mine) + _pieces(theirs))
            assert pieces[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(pieces))
            assert all(hi > lo for lo, hi in pieces) and len(pieces) == (4 if layout == "zigzag" else 2)
            assert set(layouts) == {layout}
    # the exact prefix pass: layer-major where asked for (glm3ep included), the turns where asked for (zero3kept,
    # glm3exact); detached mode runs none
    prefix = None if name in ("zero3", "glm3") else "turns" if name in ("zero3kept", "glm3exact") else "layer_major"
    assert all(set(r["prefixes"]) == {prefix} for r in checks)
    # how the members reach the pages: "auto" gathers at these sizes (zero3), as "gathered" asks (glm3ep)
    replay = {"zero3": "gathered", "glm3ep": "gathered", "zero3spread": "spread"}.get(name, "replicated")
    assert all(set(r["replays"]) == {replay} for r in checks), [r["replays"] for r in checks]
    if world == 4:
        assert [r["rank_groups"] for r in checks] == [2, 2, 1, 1]
        assert "vs_equal_weights" in checks[0]["controls"]
    if name in ("zero2", "zero3exact", "zero3kept"):
        assert "vs_detached" in checks[0]["controls"]


@pytest.mark.slow
def test_cp_replicas_roll_out_in_lockstep(results):
    """2 replicas x CP 2 under ZeRO-3: replica 0 rolls out two prompts, replica 1 one, with eos, then one prompt each
    of different lengths; every rank's samples are one process's at the same seeds (the CP ranks of a replica alike),
    and each step is the data-parallel average of the single-process gradients."""
    checks = _check(results, 4, "rollout")
    for r in checks:
        assert r["responses"] == r["ref_responses"] and r["rewards"] == r["ref_rewards"], r
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_mean_loss"], rel=1e-6)
    assert [[len(step) for step in r["responses"]] for r in checks] == [[2, 1], [2, 1], [1, 1], [1, 1]]
    # step 1: several prompts on a replica, so every group is captured again; step 2: one prompt per replica, so
    # every rank trains on its kept shard capture although the replicas' prompts differ in length
    assert all(r["reused"] == [[False] * len(r["responses"][0]), [True]] for r in checks), checks
    assert min(n for r in checks for step in r["responses"] for group in step for n in group) < 6  # eos


def _config(stage, **block):
    return {"gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
            "longstraw": {"cp_size": 2, **block}}


def test_cp_config_checks_at_the_door():
    assert read_block(_config(3), world_size=4).cp_size == 2
    assert read_block(_config(2, prefix_grad="exact"), world_size=4).cp_size == 2
    with pytest.raises(ValueError, match="cp_size.*does not divide the world size 3"):
        read_block(_config(3), world_size=3)
    assert read_block(_config(3, prefix_grad="exact", offload={"tier": "cpu"}), world_size=2).cp_size == 2
    assert read_block(_config(3, cp_attention="ulysses"), world_size=2).cp_attention == "ulysses"


def test_groups_sharing_a_document_under_cp(results):
    """Replica 0's groups share a document: the flat form ran on both of its CP ranks (each group's result says
    so) and the step is the plain transactions' average; in detached mode each member holds its question."""
    for rank, r in enumerate(_check(results, 4, "document")):
        assert r["rel"] < TOL, r
        expected = ["replayed with each member"] * 2 if rank < 2 else [None]
        assert r["documents"] == expected, r
    for rank, r in enumerate(_check(results, 4, "document_detached")):
        assert r["rel"] < TOL, r
        expected = ["held by each member"] * 2 if rank < 2 else [None]
        assert r["documents"] == expected, r
