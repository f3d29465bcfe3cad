"""launch/train.py under the real `deepspeed` launcher (2 CPU ranks, ZeRO-3): training and checkpoint resume.
(The multi-node path is tests/launcher/test_engine.py's 2-node job.)

  train:   2 GRPO steps (detached, AdamW) from JSONL groups, checkpoint per step; the final weights == a
           single-process reference: the same tiny model from the same shape config and seed, and per step the
           mean over the two ranks' groups (the same JSONL rows, ds_longstraw.tools.data order) of grpo_backward's
           gradients, then the AdamW step.
  qlora:   LoRA over NF4 4-bit base weights from a checkpoint (lora.qlora, kl_coef > 0: the reference is the base
           with adapters disabled), 2 steps; a second job resumes its step-1 checkpoint (which carries
           bitsandbytes' quantization state beside each 4-bit weight) and reproduces step 2 bit for bit.
  cp:      a third job with cp_size 2 (one replica sharded over both ranks), exact mode, host-tier pages ==
           single-process exact grpo_backward of each step's group, then AdamW.
  resume:  a second job resumes the step-1 checkpoint and runs step 2: its final weights equal the first job's
           bit for bit, and so does its step-2 metric line. It builds its model partitioned at construction
           (model.zero_init=true: transformers' DeepSpeed integration enters deepspeed.zero.Init), the path
           big models take; the weights then come from the checkpoint.
  crafted: a job resumes a copy of the step-1 checkpoint with one more entry in rank 1's optimizer-state file, an
           object whose unpickling runs a shell command: it fails before any step, naming the file and the type,
           and the command never runs.
Tolerance against the reference: float32, relative 1e-5 on the update (see test_engine.py). AdamW's eps is set
to 1.0 so its update stays close to linear in the gradient: with eps 1e-8 the first steps are ~lr * sign(g) and
would hide a gradient that is off by a factor.
"""

import json
import os

import pytest
import torch
from dist_scripts.launching import REPO, finish, free_port, start

pytestmark = pytest.mark.slow

RUN = os.path.join(REPO, "configs", "run", "quickstart.yaml")
SHAPE = os.path.join(REPO, "configs", "models", "tiny_qwen3_5.yaml")
BLOCK = {"enabled": True, "prefix_grad": "detached", "capture_chunk": 16, "replay_block": 4, "page_tokens": 8}
CP_BLOCK = dict(BLOCK, prefix_grad="exact", cp_size=2, offload={"tier": "cpu"})
OPTIM = {"lr": 1e-3, "eps": 1.0, "weight_decay": 0.01}


def _overrides(tmp, name, **extra):
    items = {"deepspeed_config": tmp / "ds.json", "data.path": tmp / "groups.jsonl", "train.max_steps": 2,
             "train.save_dir": tmp / "ckpt", "train.save_every": 1, "train.metrics": tmp / f"{name}.jsonl",
             "train.dump_params": tmp / f"{name}.pt", "model.seed": 0,
             # the reference weighs each replica's group alike: the "group" scope
             "objective.loss_scope": "group", **{f"optim.{k}": v for k, v in OPTIM.items()}, **extra}
    return [f"{key}={value}" for key, value in items.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launcher")
    with open(os.path.join(REPO, "configs", "deepspeed", "zero3_cpu.json")) as handle:
        ds = json.load(handle)
    ds.update(gradient_clipping=0.0, longstraw=BLOCK)
    (tmp / "ds.json").write_text(json.dumps(ds))
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_toy_groups", os.path.join(REPO, "launch", "make_toy_groups.py"))
    make_toy_groups = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_toy_groups)
    make_toy_groups.main([str(tmp / "groups.jsonl"), "--groups", "5", "--prompt-tokens", "40",
                          "--response-tokens", "7"])

    script = [os.path.join(REPO, "launch", "train.py"), "--config", RUN]
    log = str(tmp / "train.log")
    train = start(["--num_gpus", "2", "--master_port", str(free_port())], script + _overrides(tmp, "train"), log)
    finish([train], timeout=300, logs=[log])

    log = str(tmp / "train_resume.log")
    resume = start(["--num_gpus", "2", "--master_port", str(free_port())],
                   script + _overrides(tmp, "train_resume", **{"train.resume": "step1", "train.save_every": 0,
                                                          "train.save_dir": tmp / "ckpt",
                                                          "model.zero_init": "true"}), log)
    finish([resume], timeout=300, logs=[log])

    # QLoRA: a 4-bit base loaded from a checkpoint; straight 2 steps, then step 2 again from the step-1 checkpoint
    from ds_longstraw.models.modeling import build_model

    build_model(shape=SHAPE, dtype="float32", seed=0).save_pretrained(tmp / "base")
    qlora = {"lora.enabled": "true", "lora.qlora": "true", "lora.r": 4, "model.shape": "null",
             "model.pretrained": tmp / "base", "objective.kl_coef": 0.1, "train.save_dir": tmp / "ckpt_qlora"}
    for name, extra in (("qlora", {}), ("qlora_resume", {"train.resume": "step1", "train.save_every": 0})):
        log = str(tmp / f"{name}.log")
        job = start(["--num_gpus", "2", "--master_port", str(free_port())],
                    script + _overrides(tmp, name, **qlora, **extra), log)
        finish([job], timeout=300, logs=[log])

    # context parallelism: both ranks one replica (the prompt sharded over them), exact mode, host-tier pages
    cp_ds = dict(ds, longstraw=CP_BLOCK)
    (tmp / "ds_cp.json").write_text(json.dumps(cp_ds))
    log = str(tmp / "cp.log")
    cp = start(["--num_gpus", "2", "--master_port", str(free_port())],
               script + _overrides(tmp, "cp", **{"deepspeed_config": tmp / "ds_cp.json", "train.save_every": 0,
                                                  "train.save_dir": tmp / "ckpt_cp"}), log)
    finish([cp], timeout=300, logs=[log])
    return tmp


@pytest.fixture
def one_thread():
    """On this shared 2-core box the tiny reference runs ~25x faster on one thread than on two (spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(tmp, replicas=2, block=BLOCK):
    """Single process: per step, the mean over `replicas` data replicas of grpo_backward's gradients of their
    groups (ds_longstraw.tools.data order), then the AdamW step."""
    from ds_longstraw import grpo_backward
    from ds_longstraw.models.modeling import build_model
    from ds_longstraw.tools.data import GroupSource

    model = build_model(shape=SHAPE, dtype="float32", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    source = GroupSource(tmp / "groups.jsonl")
    single = {k: v for k, v in block.items() if k not in ("cp_size", "offload")}
    for step in range(2):
        total = {}
        for replica in range(replicas):
            model.zero_grad(set_to_none=True)
            for group in source.for_step(step, replica, replicas):
                grpo_backward(model, group, longstraw=single)
            for name, p in model.named_parameters():
                total[name] = total.get(name, 0.0) + p.grad / replicas
        for name, p in model.named_parameters():
            p.grad = total[name]
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def _lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def test_training_takes_the_reference_steps(runs, one_thread):
    from ds_longstraw.models.modeling import build_model

    start_weights = dict(build_model(shape=SHAPE, dtype="float32", seed=0).named_parameters())
    got = torch.load(runs / "train.pt")
    want = _reference(runs)
    assert set(got) == set(want)
    num = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want)
    den = sum(float(((want[n] - start_weights[n].detach()) ** 2).sum()) for n in want)
    assert (num / den) ** 0.5 < 1e-5
    metrics = _lines(runs / "train.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["dp_world"] == 2 for m in metrics)
    assert {"latest", "step1", "step2"} <= set(os.listdir(runs / "ckpt"))


def test_context_parallel_training_takes_the_reference_steps(runs, one_thread):
    """cp_size 2 on 2 ranks: one data replica whose two ranks share each step's group (the prompt sharded over
    them), exact mode: the same steps as single-process exact grpo_backward on that group."""
    from ds_longstraw.models.modeling import build_model

    start_weights = dict(build_model(shape=SHAPE, dtype="float32", seed=0).named_parameters())
    got = torch.load(runs / "cp.pt")
    want = _reference(runs, replicas=1, block=CP_BLOCK)
    num = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want)
    den = sum(float(((want[n] - start_weights[n].detach()) ** 2).sum()) for n in want)
    assert (num / den) ** 0.5 < 1e-5
    metrics = _lines(runs / "cp.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["dp_world"] == 1 for m in metrics)


def test_first_step_says_which_kernel_paths_ran(runs):
    """Rank 0 prints the kernels' paths once, after its first step (kernels/dispatch.py): on CPU ranks the
    project's own kernels. The resumed job's first step is step 2."""
    for log, first in (("train.log", "step 1/2"), ("train_resume.log", "step 2/2")):
        with open(runs / log) as handle:
            lines = [line for line in handle.read().splitlines() if "[longstraw]" in line]
        kernels = [i for i, line in enumerate(lines) if "[longstraw] kernels (mode auto): " in line]
        steps = [i for i, line in enumerate(lines) if "[longstraw] step " in line]
        assert len(kernels) == 1 and first in lines[steps[0]] and kernels[0] == steps[0] + 1, lines
        for path in ("attention forward: torch_fused_cpu", "gated delta rule: torch_chunked", "log-probs: chunked"):
            assert path in lines[kernels[0]], (path, lines[kernels[0]])


@pytest.mark.parametrize("job", ["train", "qlora"])
def test_resume_from_step_1_reproduces_step_2_exactly(runs, job):
    straight, resumed = torch.load(runs / f"{job}.pt"), torch.load(runs / f"{job}_resume.pt")
    assert set(straight) == set(resumed)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    step2 = _lines(runs / f"{job}.jsonl")[1]
    again = _lines(runs / f"{job}_resume.jsonl")
    assert [m["step"] for m in again] == [2]
    for key in ("loss", "mean_loss", "lr", "grad_norm"):
        assert again[0][key] == step2[key], key


def test_resume_refuses_a_checkpoint_file_that_would_run_code(runs, tmp_path):
    """train.resume under the launcher from a crafted copy of the step-1 checkpoint (tests/crafted_checkpoints.py;
    the payload would touch a marker file): the job exits non-zero before its first step, the log naming the file
    and the type (engine/safe_load.py), and the marker never appears. Before the check DeepSpeed unpickled the file
    (weights_only=False) and the command ran."""
    from crafted_checkpoints import RunsCommand, add_entry, copy_tag

    marker = tmp_path / "MARKER"
    tag = copy_tag(runs / "ckpt", "step1", tmp_path / "ckpt")
    victim = os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    add_entry(victim, "extra", RunsCommand(marker))
    log = str(tmp_path / "crafted.log")
    script = [os.path.join(REPO, "launch", "train.py"), "--config", RUN]
    job = start(["--num_gpus", "2", "--master_port", str(free_port())],
                script + _overrides(runs, "crafted", **{"train.resume": "step1", "train.save_dir": tmp_path / "ckpt"}),
                log)
    with pytest.raises(AssertionError, match="launcher exit codes"):
        finish([job], timeout=300, logs=[log])
    with open(log) as handle:
        text = handle.read()
    assert f"ValueError: {victim}: refused before loading: it needs type posix.system" in text, text[-3000:]
    assert "[longstraw] step " not in text and not marker.exists()


def test_qlora_trains_adapters_over_four_bit_weights(runs):
    import bitsandbytes  # noqa: F401 -- a test extra: its absence must fail here, not skip

    trained = torch.load(runs / "qlora.pt")
    assert trained and all("lora_" in name for name in trained)  # dump_params holds the trainable parameters
    steps = _lines(runs / "qlora.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[1]["kl_rank0"] > 0  # the policy moved away from the 4-bit base (adapters disabled)
    assert steps[0]["grad_norm"] > 0
