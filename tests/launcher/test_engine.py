"""ds_longstraw.initialize + engine.grpo_step under ZeRO-3 on 2 gloo ranks started by the real `deepspeed` launcher,
as a 2-NODE job: two launcher invocations on this machine (hostfile of two one-slot hosts, --no_ssh,
--node_rank 0 and 1, master 127.0.0.1) form one job of one rank per node: the multi-node path.

That one job runs every check of tests/dist_scripts/engine_checks.py (see its docstring for the equivalence
chains); each rank writes its measurements, asserted here:
  same_step   ZeRO-3 grpo_step (detached, both ranks one group, 2 steps)  == single-process grpo_backward + SGD
  average     rank 0 [A, B], rank 1 [C] (exact; shapes differ, so lockstep pads)  == SGD on (g_A + g_B)/4 + g_C/2
  checkpoint  save after step 1, resume on a fresh engine with other weights  -> step 2 identical bit for bit;
              a copy with a file that would run code when unpickled is refused on every rank, naming the file
  zero2       stage 2 (no lockstep needed) takes the same averaged step; a gradient only one rank has is
              zero-filled on the other so the one reduction runs
  lora        only adapters move; the reference (adapters disabled) scores exactly as the base model
  qlora       the same over NF4 4-bit base weights loaded from a checkpoint (bitsandbytes): the packed codes are
              partitioned and gathered like any frozen weight and come back bit for bit
  glm         glm_moe_dsa (MLA + DSA + MoE): as average, its MoE blocks ZeRO-3 leaf modules
  ep          the same with "ep_size" 2: the routed experts sharded over the two nodes, outside ZeRO-3
  ep_checkpoint  resume of an EP run (the engine's checkpoint and each rank's expert-slice file): bit for bit;
              slice files that would run code are refused by resume and by the slice loader, naming the file
  ep_export   `longstraw export` of an EP run's checkpoint: the whole model, experts joined from the slice files;
              a slice file that would run code is refused, --trust-pickle or not
  rollout_lockstep  grpo_step(prompts, rollout=) with an eos, prompts of different lengths and counts per rank:
              decoding in lockstep (ghost steps, an idle slot, padded captures) samples what one process samples,
              and two steps (the second trained on the rollouts' padded captures, its weights gathered whole for
              decoding by "zero3_weights" "auto": no ZeRO-3 gather while it decodes) == the single-process steps
  rollout_ep  the same on glm_moe_dsa with its experts sharded over the two ranks (every decode step dispatches)
  shared_document  ZeRO-2, exact, KL: each rank's two groups share a document, which grpo_step captures once per
              rank (grpo/shared.py); ZeRO-3: rank 0's two groups share one and run as one group over it
              (grpo/flat_document.py), padded against rank 1's one group, in both modes (detached: each member
              holds its question); the step == the plain average
Tolerance: float32, relative 1e-5 on the parameter update. Measured 5e-7 .. 1.4e-6: the engine's and the
reference's sums of member gradients run in different orders (DeepSpeed reduce-scatters rank partitions, lockstep
pads blocks with dummy tokens so blocked matmuls change shape), each step a few float32 ulps; a wrong averaging
weight, a dropped member or a doubly scaled prefix gradient shows up at 1e-2 or worse (seen: 0.2).
"""

import json
import os

import pytest
from dist_scripts.launching import REPO, finish, free_port, start

pytestmark = pytest.mark.slow

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine")
    (out / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    port = free_port()
    logs = [str(out / f"node{n}.log") for n in (0, 1)]
    nodes = [start(["--hostfile", str(out / "hostfile"), "--no_ssh", "--node_rank", str(n),
                    "--master_addr", "127.0.0.1", "--master_port", str(port)],
                   [os.path.join(REPO, "tests", "dist_scripts", "engine_checks.py"), "--out", str(out)], logs[n])
             for n in (0, 1)]
    finish(nodes, timeout=420, logs=logs)
    ranks = []
    for rank in range(2):
        with open(out / f"engine_rank{rank}.json") as handle:
            ranks.append(json.load(handle))
    return ranks


def test_the_job_spans_two_nodes(results):
    assert [(r["world"], r["nodes"], r["node"], r["local_rank"]) for r in results] == [(2, 2, 0, 0), (2, 2, 1, 0)]


def _check(results, name):
    for rank, result in enumerate(results):
        assert result["world"] == 2
        assert "error" not in result[name], f"rank {rank}:\n{result[name]['error']}"
    return [result[name] for result in results]


def test_same_step_as_single_process(results):
    for r in _check(results, "same_step"):
        assert r["rel"] < TOL, r
        assert r["global_steps"] == 2
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)


def test_different_groups_per_rank_average(results):
    for r in _check(results, "average"):
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_mean_loss"], rel=1e-6)
    assert [r["rank_groups"] for r in _check(results, "average")] == [2, 1]


def test_step_scope_equals_trl_over_two_ranks(results):
    """The default normalisation ("step": every trained token of the step, over both ranks' groups) with an entropy
    bonus and a rollout correction: the engine's update equals SGD on TRL's "dapo" loss of the three groups
    (float32; TOL as the other checks)."""
    for r in _check(results, "objective_step"):
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert len(set(r["trained_tokens"])) > 1


def test_glm_under_zero3_with_moe_leaf_modules(results):
    for r in _check(results, "glm"):
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_mean_loss"], rel=1e-6)
        assert r["moe_leaves"] == r["moe_blocks"] > 0  # every MoE block gathered whole by ZeRO-3
    assert [r["rank_groups"] for r in _check(results, "glm")] == [2, 1]


def test_expert_parallel_step_equals_single_process(results):
    """ep_size 2 over the two ranks (nodes): each holds 4 of the 8 routed experts, outside ZeRO-3."""
    checks = _check(results, "ep")
    for r in checks:
        assert r["rel"] < TOL, r
        assert r["mean_loss"] == pytest.approx(r["ref_mean_loss"], rel=1e-6)
        assert r["slices"] == 6 and r["slices_in_zero"] == 0  # 3 MoE layers x 2 fused parameters, none ZeRO's
        assert r["moe_leaves"] == 0  # the router and shared expert are gathered by their own hooks
        assert r["load_imbalance"] >= 1.0
    assert [r["experts"] for r in checks] == [[0, 4], [4, 8]]


def test_expert_parallel_checkpoint_resume_is_bit_exact(results):
    for r in _check(results, "ep_checkpoint"):
        assert r["loaded"] and r["client_step"] == 1 and r["same_names"]
        assert r["max_abs"] == 0.0, r
        assert r["loss"] == r["resumed_loss"] and r["lr"] == r["resumed_lr"] > 0
        assert r["files"] == ["experts_ep2_rank0.pt", "experts_ep2_rank1.pt"]


def test_expert_parallel_checkpoint_exports_the_whole_model(results):
    rank0, rank1 = _check(results, "ep_export")
    assert rank0["names_match"] and rank0["missing"] == [], rank0
    assert rank0["max_abs"] == 0.0, rank0
    assert rank0["expert_shape"] == [4, 64, 64]  # 4 routed experts: both ranks' 2-expert slices joined
    assert rank0["experts"] == rank1["experts"] == 6


def _refused(message, path, type_name):
    """engine/safe_load.py's refusal of `path` (under the check's output directory) for needing `type_name`."""
    return message is not None and f"{path}: refused before loading: it needs type {type_name}," in message


def test_checkpoint_files_that_would_run_code_are_refused_on_every_rank(results):
    """engine_checks.crafted_loads: real checkpoints copied with one more entry in one file. ZeRO-3: rank 1's
    model-state file, which rank 0 never reads, is refused by both ranks' load_checkpoint (neither goes on into
    DeepSpeed's collectives alone); EP: the slice files, by load_checkpoint and by each rank's slice loader;
    export of an EP checkpoint: a slice file, with trust_pickle too. The marker the payload would create never
    appears; a harmless legacy entry is refused by type and loads with trust_pickle=True."""
    legacy = "zero_pp_rank_1_mp_rank_00_model_states.pt"
    for r in _check(results, "checkpoint"):
        assert _refused(r["refused"], f"zero3_crafted/step1/{legacy}", "posix.system"), r["refused"]
        assert _refused(r["legacy_refused"], f"zero3_legacy/step1/{legacy}", "argparse.Namespace"), r
        assert r["legacy_trusted"] and not r["marker"]
    for rank, r in enumerate(_check(results, "ep_checkpoint")):
        assert _refused(r["refused"], "ep_crafted/step1/experts_ep2_rank0.pt", "posix.system"), r["refused"]
        assert _refused(r["slice_loader_refused"], f"ep_crafted/step1/experts_ep2_rank{rank}.pt", "posix.system"), r
        assert _refused(r["legacy_refused"], f"ep_legacy/step1/{legacy}", "argparse.Namespace"), r
        assert r["legacy_trusted"] and not r["marker"]
    rank0 = _check(results, "ep_export")[0]
    for message in rank0["refused"]:  # without and with trust_pickle
        assert _refused(message, "ckpt_ep_export_crafted/step1/experts_ep2_rank1.pt", "posix.system"), message
    assert not rank0["marker"]


def test_checkpoint_resume_reproduces_step_2_exactly(results):
    for r in _check(results, "checkpoint"):
        assert r["loaded"] and r["client_step"] == 1
        assert r["max_abs"] == 0.0, r
        assert r["loss"] == r["resumed_loss"]
        assert r["lr"] == r["resumed_lr"] and r["lr"] > 0
        assert r["global_steps"] == [2, 2]


def test_zero_stage_2_and_missing_gradients(results):
    for r in _check(results, "zero2"):
        assert r["rel"] < TOL, r
        assert r["fill"] < 1e-6, r


def test_groups_sharing_a_document_capture_it_once_per_rank(results):
    """ZeRO-2: rank 0's groups share a 40-token document, rank 1's a 33-token one, each captured once as a tree.
    ZeRO-3: rank 0's two groups run as one group over their document, padded against rank 1's single group. Each
    group's extras say how; the step is the plain transactions' averaged step either way."""
    for rank, r in enumerate(_check(results, "shared_document")):
        assert r["rel"] < TOL, r
        assert r["documents"] == [[40, 40], [33, 33]][rank] and r["how"] == ["captured"] * 2, r
    for rank, r in enumerate(_check(results, "shared_document_zero3")):
        assert r["rel"] < TOL, r
        assert r["documents"] == [[40, 40], [None]][rank], r
        assert r["how"] == [["replayed with each member"] * 2, ["captured"]][rank], r
    for rank, r in enumerate(_check(results, "shared_document_zero3_detached")):  # the questions held (detached)
        assert r["rel"] < TOL, r
        assert r["documents"] == [[40, 40], [None]][rank], r
        assert r["how"] == [["held by each member"] * 2, ["captured"]][rank], r


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_lora_trains_only_adapters_and_reference_is_base(results, name):
    for r in _check(results, name):
        assert r["rel"] < TOL, r
        assert (r["four_bit_layers"] > 0) == (name == "qlora"), r
        assert r["frozen_changed"] == []
        assert r["all_adapters_are_lora"] and r["adapters_moved"] == r["adapters"] > 0
        # float32 scoring of the same weights; lockstep's padded blocks change matmul shapes (a few ulps)
        assert r["ref_vs_base"] < 1e-5, r
        assert r["policy_vs_base"] > 1e-3, r  # the adapters do change the policy: the check above can fail


@pytest.mark.parametrize("name", ["rollout_lockstep", "rollout_ep"])
def test_rollouts_decode_in_lockstep(results, name):
    """Each rank samples what a single process samples at the same seeds (response lengths: eos stops them at
    different steps; rewards), the ranks took ghost steps to stay in step (so the check exercises them), step 2
    trained on every rank's kept capture although the ranks' prompts need different capture chunks, and the
    two steps land on the single-process weights."""
    checks = _check(results, name)
    for r in checks:
        assert r["responses"] == r["ref_responses"] and r["rewards"] == r["ref_rewards"], r
        assert r["rel"] < TOL, r
    counts = [[len(step) for step in r["reused"]] for r in checks]
    assert counts[0][0] != counts[1][0], counts  # step 1: different prompt counts (an idle slot)
    assert all(not any(r["reused"][0]) and r["reused"][1] == [True] for r in checks), checks
    assert sum(sum(r["ghost_steps"]) for r in checks) > 0
    lengths = {n for r in checks for step in r["responses"] for group in step for n in group}
    assert min(lengths) < ROLLOUT_MAX_NEW_TOKENS, lengths  # some sample stopped at eos
    # "auto": no room granted in step 1 (per call), room found on this machine in step 2 (whole); ZeRO-3's
    # per-submodule gathers while generate ran follow: step 1 makes them, the "whole" step none
    assert all(r["zero3_weights"] == ["per_call", "whole"] for r in checks), checks
    assert all(r["decode_fetches"][0] > 0 and r["decode_fetches"][1:] == [0] for r in checks), checks
    if name == "rollout_lockstep":  # generate(dp_group=) one sample at a time, 3 samples on rank 0, 2 on rank 1
        for r in checks:
            assert r["each_ids"] == r["each_ref_ids"], r
            # the same float32 weights (gathered by ZeRO-3) through the same ops: equal up to a few ulps
            assert r["each_logprob_diff"] < 1e-6, r
        assert [len(r["each_ids"]) for r in checks] == [3, 2]
        # generate(dp_group=, environment=): each rank's multi-turn samples are its own alone, batched and not
        for r in checks:
            assert r["turn_ids"] == r["turn_ref_ids"] and r["turns"] == r["turns_ref"], r
            assert all(r["turn_masks_equal"]) and max(r["turn_logprob_diff"]) < 1e-6, r
        turns = [r["turns"][0] for r in checks]
        assert turns[0] != turns[1] and max(max(t) for t in turns) >= 2, turns  # the ranks' turns differ
        # the lockstep pads decode steps and observation forwards alike: the same module calls on both ranks
        assert checks[0]["turn_calls"] == checks[1]["turn_calls"], [r["turn_calls"] for r in checks]
        # the same submodule calls on both ranks, whatever each sampled: the lockstep itself
        assert checks[0]["decode_fetches"][0] == checks[1]["decode_fetches"][0]


ROLLOUT_MAX_NEW_TOKENS = 6  # engine_checks.ROLLOUT's
