"""TRL's GRPOTrainer and LongStrawGRPOTrainer under `accelerate launch` on 2 CPU processes with DeepSpeed ZeRO-3.

Each case trains TRL's own trainer, then ours, from the same checkpoint, data, seeds and completions
(tests/trl_runs.py) in float32 with the DeepSpeed config given to TRL (GRPOConfig.deepspeed; ours carries the
"longstraw" block); rank 0 writes, per case, || our update - TRL's || / || TRL's || with the weights gathered whole.
The processes' prompts differ (TRL's sampler splits the generation batch), and a prompt's members are split over
the two processes, so each process runs its own transactions and DeepSpeed's one reduction averages them.
Two cases have TRL's own trainer on ONE process as the reference, trained by the caller before the launch: context
parallelism (CP_CASE: one replica over the two processes) and GLM with expert parallelism (EP_CASE: two replicas,
the reference holding both processes' rows, EP_REFERENCE). One case runs TRL's tool loop from the capture
(tool_loop_case: the processes' samples take different numbers of turns), TRL's trainer replaying each process's
turns through its own loop. The last case only checks a refusal.

    TRL_CHECKS_DIR=DIR accelerate launch --num_processes 2 tests/dist_scripts/trl_checks.py OUT_JSON
"""

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trl import GRPOTrainer  # noqa: E402

from ds_longstraw.integrations.trl import LongStrawGRPOTrainer  # noqa: E402
from tests import trl_runs  # noqa: E402

CASES = {
    "dapo-two-steps": dict(loss_type="dapo", max_steps=2),
    "grpo-beta-two-iterations": dict(loss_type="grpo", beta=0.3, num_iterations=2, max_steps=2),
    "bnpo-tools": dict(loss_type="bnpo", tool_masks=True),
    # 2 rows per process, 4 generations per prompt: each prompt's members split over the two processes
    "grpo-split-prompts": dict(loss_type="grpo", per_device_train_batch_size=2, gradient_accumulation_steps=1,
                               max_steps=2),
}


def ds_config(path: str, longstraw: bool | dict) -> str:
    """The DeepSpeed config, written by this rank to a file of its own (two ranks writing one file race)."""
    path = f"{path}.rank{os.environ.get('RANK', '0')}"
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_allow_untested_optimizer": True}
    if longstraw:
        config["longstraw"] = longstraw if isinstance(longstraw, dict) else {"prefix_grad": "exact"}
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    root = os.environ["TRL_CHECKS_DIR"]
    model = os.path.join(root, "model")  # saved by the caller (trl_runs.save_tiny_model), before the launch
    results = {}
    # whole, before any trainer: once a DeepSpeed ZeRO-3 config is live, from_pretrained builds partitioned weights
    initial = trl_runs.initial_weights(model, dtype=torch.float32)
    glm = os.path.join(root, "glm")  # the expert-parallel case's, saved by the caller too (trl_runs.save_tiny_glm)
    glm_initial = trl_runs.initial_weights(glm, dtype=torch.float32)
    tools = os.path.join(root, "tools")  # the tool-loop case's, saved by the caller (trl_tools.save_driven_model)
    tools_initial = trl_runs.initial_weights(tools, dtype=torch.float32)
    for name, case in CASES.items():
        _barrier()
        weights = {}
        for label, trainer_class, longstraw in (("trl", GRPOTrainer, False), ("ours", LongStrawGRPOTrainer, True)):
            config = ds_config(os.path.join(root, f"{name}-{label}.json"), longstraw)
            with tempfile.TemporaryDirectory() as output_dir:
                weights[label] = trl_runs.train(trainer_class, model, output_dir, dtype=torch.float32,
                                                deepspeed=config, **case)
        results[name] = trl_runs.update_difference(initial, weights["ours"], weights["trl"])
    results.update(capture_case(model, root, initial))
    results.update(tool_loop_case(tools, root, tools_initial))
    results.update(context_parallel_case(model, root, initial))
    results.update(expert_parallel_case(glm, root, glm_initial))
    results.update(refusal_case(model, root))
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    _barrier()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def capture_case(model: str, root: str, initial: dict) -> dict:
    """generate_from_capture under ZeRO-3: each process samples its one prompt from its capture (the two decode in
    lockstep) and trains on it; TRL's trainer replays each process's completions. Also reports how many groups
    took their kept capture (every one, on both processes, is 1.0)."""
    calls, reused = [], []

    def record(trainer: object) -> None:
        sample, run_groups = trainer._sampler.sample, trainer._run_groups

        def recording_sample(module: object, prompt_ids: list, **kwargs: object) -> list:
            completions = sample(module, prompt_ids, **kwargs)
            calls.append((prompt_ids, completions))
            return completions

        def recording_run(groups: list, *rest: object) -> list:
            results = run_groups(groups, *rest)
            reused.extend(float(result.extras.get("capture_reused", False)) for result in results)
            return results

        trainer._sampler.sample, trainer._run_groups = recording_sample, recording_run

    case = dict(loss_type="dapo", max_steps=2, per_device_train_batch_size=2, max_completion_length=5)
    _barrier()
    with tempfile.TemporaryDirectory() as output_dir:
        ours = trl_runs.train(LongStrawGRPOTrainer, model, output_dir, dtype=torch.float32, rollout=None,
                              on_trainer=record, trainer_kwargs={"generate_from_capture": True},
                              deepspeed=ds_config(os.path.join(root, "capture-ours.json"), True), **case)
    with tempfile.TemporaryDirectory() as output_dir:
        theirs = trl_runs.train(GRPOTrainer, model, output_dir, dtype=torch.float32,
                                rollout=trl_runs.replayed(calls),
                                deepspeed=ds_config(os.path.join(root, "capture-trl.json"), False), **case)
    reuse = torch.tensor([sum(reused), len(reused)], dtype=torch.float64)
    torch.distributed.all_reduce(reuse)
    return {"generate-from-capture": trl_runs.update_difference(initial, ours, theirs),
            "capture-reused-share": float(reuse[0] / reuse[1])}


# one prompt per process per generation batch (2 rows x 2 accumulation steps = its 4 generations: its capture is
# kept); 48 tokens hold up to three turns with their tool messages (tests/trl_tools.py). One optimizer step (one
# generation batch) already has the processes take different numbers of turns: a second doubles the case's time
# (11 s -> 22 s on 2 shared cores) for what the cases above check already
TOOL_CASE = dict(loss_type="dapo", max_steps=1, per_device_train_batch_size=2, max_completion_length=48)


def tool_loop_case(model: str, root: str, initial: dict) -> dict:
    """generate_from_capture with TRL's tool loop (tools and an environment, tests/trl_tools.py) under ZeRO-3: each
    process decodes every turn of its prompt's samples from its capture, the two in lockstep, and trains on the kept
    capture; TRL's own trainer replays each process's turns through its own tool loop (trl_tools.replaying_trainer,
    as tests/equivalence/test_trl_tools.py does on one process). Also reports whether both built the same
    completions, masks and messages, the share of groups that took their kept capture, each process's tool-message
    count per generation batch (the two differ: the processes' samples take different numbers of turns), and the
    observation forwards the lockstep padded with (ghosts, both processes)."""
    from ds_longstraw.rollout import generate as generate_module
    from tests import trl_tools

    ghosts = [0]
    ghost_captures = generate_module._ghost_captures

    def counting_ghost_captures(adapter: object, view: object, start: int, count: int) -> None:
        ghosts[0] += count
        ghost_captures(adapter, view, start, count)

    ours_out, reused = [], []
    _barrier()
    generate_module._ghost_captures = counting_ghost_captures
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            ours = trl_tools.train(LongStrawGRPOTrainer, model, output_dir, tools=True, environment=True,
                                   dtype=torch.float32, trainer_kwargs={"generate_from_capture": True},
                                   on_trainer=lambda trainer: trl_tools.recording(trainer, ours_out, reused),
                                   deepspeed=ds_config(os.path.join(root, "tools-ours.json"), True), **TOOL_CASE)
    finally:
        generate_module._ghost_captures = ghost_captures
    theirs_out = []
    batches = [(out[0], out[1], out[2]) for out in ours_out]  # prompt ids, completion ids, tool mask per row
    with tempfile.TemporaryDirectory() as output_dir:
        theirs = trl_tools.train(trl_tools.replaying_trainer(batches, theirs_out), model, output_dir, tools=True,
                                 environment=True, dtype=torch.float32,
                                 deepspeed=ds_config(os.path.join(root, "tools-trl.json"), False), **TOOL_CASE)
    # TRL's own loop over the same turns built the same completions, masks and messages
    same = [out[:4] for out in ours_out] == [out[:4] for out in theirs_out]
    observations = [sum(trl_tools.observation_runs(mask) for mask in out[2]) for out in ours_out]
    counts = torch.tensor([sum(reused), len(reused), int(same), ghosts[0]], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    per_process = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_process, observations)
    return {"tool-loop": trl_runs.update_difference(initial, ours, theirs),
            "tool-loop-capture-reused-share": float(counts[0] / counts[1]),
            "tool-loop-same-turns": int(counts[2]), "tool-loop-ghost-observations": int(counts[3]),
            "tool-loop-observations": per_process}


CP_CASE = dict(loss_type="dapo", beta=0.3, max_steps=2)


def context_parallel_case(model: str, root: str, initial: dict) -> dict:
    """"cp_size" 2: the two processes form one CP group (one data-parallel replica) and shard each prompt; TRL's
    own trainer on ONE process (the caller ran it, no DeepSpeed: cp_reference.pt) is the reference."""
    reference = torch.load(os.path.join(root, "cp_reference.pt"))
    path = ds_config(os.path.join(root, "cp-ours.json"), {"prefix_grad": "exact", "cp_size": 2})
    _barrier()
    with tempfile.TemporaryDirectory() as output_dir:
        ours = trl_runs.train(LongStrawGRPOTrainer, model, output_dir, dtype=torch.float32, deepspeed=path, **CP_CASE)
    return {"context-parallel": trl_runs.update_difference(initial, ours, reference)}


# the same generation batch (4 prompts x 4 generations) as the reference's one process with twice the rows
EP_CASE = dict(loss_type="dapo", beta=0.3, max_steps=2)
EP_REFERENCE = dict(EP_CASE, per_device_train_batch_size=8)


def expert_parallel_case(model: str, root: str, initial: dict) -> dict:
    """GLM (glm_moe_dsa, 6 routed experts) with "ep_size" 2: each process holds 3 experts of every MoE block, out
    of ZeRO, and the routed pairs go to their owners; TRL's reference model (beta > 0) is a ZeRO-3 engine whose MoE
    blocks are leaf modules, set before TRL builds it. The two processes are two data-parallel replicas; TRL's own
    trainer on ONE process with both processes' rows (the caller ran it, no DeepSpeed: ep_reference.pt) is the
    reference. Both run transformers' indexer with its canonical top-k (tests/glm_models.glm_reference)."""
    from tests.glm_models import glm_reference

    reference = torch.load(os.path.join(root, "ep_reference.pt"))
    path = ds_config(os.path.join(root, "ep-ours.json"), {"prefix_grad": "exact", "ep_size": 2})
    seen = {}

    def record(trainer: object) -> None:  # before training: what TRL's reference engine and the policy hold
        import deepspeed

        from ds_longstraw.arch.glm_moe_dsa_experts import moe_blocks

        seen["expert-slices"] = len(trainer._experts.params)
        seen["reference-moe-leaves"] = sum(deepspeed.utils.z3_leaf_module(block)
                                           for block in moe_blocks(trainer.ref_model.module))
        seen["policy-moe-leaves"] = sum(deepspeed.utils.z3_leaf_module(block) for block in moe_blocks(trainer.model))

    _barrier()
    with tempfile.TemporaryDirectory() as output_dir, glm_reference():
        ours = trl_runs.train(LongStrawGRPOTrainer, model, output_dir, dtype=torch.float32, deepspeed=path,
                              on_trainer=record, **EP_CASE)
    return {"expert-parallel": trl_runs.update_difference(initial, ours, reference), **seen}


def refusal_case(model: str, root: str) -> dict:
    """top_entropy_quantile < 1 under ZeRO-3 on two processes: refused at construction, naming the setting (its
    entropy pass would run each process's prompts alone, and ZeRO-3's gathers are collectives)."""
    path = ds_config(os.path.join(root, "quantile-ours.json"), True)
    _barrier()
    with tempfile.TemporaryDirectory() as output_dir:
        try:
            trl_runs.train(LongStrawGRPOTrainer, model, output_dir, dtype=torch.float32, deepspeed=path,
                           top_entropy_quantile=0.5)
        except ValueError as error:
            return {"top-entropy-quantile-refused": str(error)}
    return {"top-entropy-quantile-refused": None}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
