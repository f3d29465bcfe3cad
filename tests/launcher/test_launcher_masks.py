"""launch/train.py under the real `deepspeed` launcher (2 CPU ranks, ZeRO-3, exact mode) on JSONL agent
trajectories whose responses hold masked tool spans ("response_masks" in token-id form).

  The data: 4 groups of 3 responses, context-only spans at the start, middle and end of responses; one member
  with no trained token; one whole group with none (its rank contributes a zero gradient to that step's average).
  Ranks bring groups of different shapes, so ZeRO-3's lockstep pads members and blocks; tool spans of 3+ tokens
  run in steps (member_span_capture 3, grpo/member_steps.py), so the ranks' slots in steps differ too and the
  lockstep runs a slot in steps on both ranks where either's member does.
  Chain: final weights after 2 AdamW steps == a single process that, per step, averages over the two ranks' groups
  (the same JSONL rows, ds_longstraw.tools.data order) the gradients of grpo_backward with the masks, then steps;
  and != the same reference with the masks dropped (the launcher path must carry them to the loss).
Tolerance against the reference: float32, relative 1e-5 on the update, as test_launcher.py (AdamW eps 1.0 so
the update stays close to linear in the gradient; measured 2.5e-6). Dropping the masks moves the update by 0.8
relative (asserted > 1e-2, far outside the tolerance).
"""

import json
import os

import pytest
import torch
from dist_scripts.launching import REPO, finish, free_port, start

pytestmark = pytest.mark.slow

RUN = os.path.join(REPO, "configs", "run", "quickstart.yaml")
SHAPE = os.path.join(REPO, "configs", "models", "tiny_qwen3_5.yaml")
BLOCK = {"enabled": True, "prefix_grad": "exact", "capture_chunk": 16, "replay_block": 4, "page_tokens": 8,
         "member_span_capture": 3}
OPTIM = {"lr": 1e-3, "eps": 1.0, "weight_decay": 0.01}
STEPS = 2


def _records():
    """Token-id groups (vocab 128, the tiny shape's) with tool spans; rows 0..3 go to (step, rank) (0,0) (0,1)
    (1,0) (1,1)."""
    gen = torch.Generator().manual_seed(0)
    # per group: prompt length, [(response length, context-only spans)]
    layouts = [
        (29, [(7, [(2, 5)]), (5, [(0, 2)]), (6, [(4, 6)])]),
        (22, [(4, []), (9, [(1, 3), (6, 8)]), (3, [(0, 3)])]),  # an all-False member
        (35, [(6, [(0, 1)]), (8, [(3, 7)]), (2, [])]),
        (18, [(5, [(0, 5)]), (4, [(0, 4)]), (3, [(0, 3)])]),  # nothing trained in this group
    ]
    records = []
    for prompt_len, members in layouts:
        masks = []
        for length, spans in members:
            mask = [1] * length
            for lo, hi in spans:
                mask[lo:hi] = [0] * (hi - lo)
            masks.append(mask)
        records.append({
            "prompt_ids": torch.randint(0, 128, (prompt_len,), generator=gen).tolist(),
            "response_ids": [torch.randint(0, 128, (length,), generator=gen).tolist() for length, _ in members],
            "response_masks": masks,
            "rewards": torch.rand(len(members), generator=gen).tolist(),
        })
    return records


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launcher_masks")
    with open(os.path.join(REPO, "configs", "deepspeed", "zero3_cpu.json")) as handle:
        ds = json.load(handle)
    ds.update(gradient_clipping=0.0, longstraw=BLOCK)
    (tmp / "ds.json").write_text(json.dumps(ds))
    (tmp / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    overrides = {"deepspeed_config": tmp / "ds.json", "data.path": tmp / "groups.jsonl", "train.max_steps": STEPS,
                 "train.save_dir": tmp / "ckpt", "train.save_every": 0, "train.metrics": tmp / "masks.jsonl",
                 "train.dump_params": tmp / "masks.pt", "model.seed": 0,
                 "objective.loss_scope": "group",  # the reference weighs each replica's group alike
                 **{f"optim.{k}": v for k, v in OPTIM.items()}}
    script = [os.path.join(REPO, "launch", "train.py"), "--config", RUN]
    log = str(tmp / "masks.log")
    job = start(["--num_gpus", "2", "--master_port", str(free_port())],
                script + [f"{key}={value}" for key, value in overrides.items()], log)
    finish([job], timeout=300, logs=[log])
    return tmp


@pytest.fixture
def one_thread():
    """On this shared 2-core box the tiny reference runs much faster on one thread than on two (spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(tmp, drop_masks=False, replicas=2):
    """Single process: per step, the mean over the data replicas of grpo_backward's gradients of their groups
    (ds_longstraw.tools.data order), then the AdamW step."""
    from ds_longstraw import GRPOGroup, grpo_backward
    from ds_longstraw.models.modeling import build_model
    from ds_longstraw.tools.data import GroupSource

    model = build_model(shape=SHAPE, dtype="float32", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    source = GroupSource(tmp / "groups.jsonl")
    for step in range(STEPS):
        total = {}
        for replica in range(replicas):
            model.zero_grad(set_to_none=True)
            for group in source.for_step(step, replica, replicas):
                assert group.response_masks is not None
                if drop_masks:
                    group = GRPOGroup(group.prompt_ids, group.response_ids, rewards=group.rewards)
                grpo_backward(model, group, longstraw=BLOCK)
            for name, p in model.named_parameters():  # a group with nothing trained, in steps, runs no backward
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                total[name] = total.get(name, 0.0) + grad / replicas
        for name, p in model.named_parameters():
            p.grad = total[name]
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_masked_training_takes_the_reference_steps(run, one_thread):
    from ds_longstraw.models.modeling import build_model

    start_weights = {n: p.detach() for n, p in build_model(shape=SHAPE, dtype="float32", seed=0).named_parameters()}
    got = torch.load(run / "masks.pt")
    want = _reference(run)
    unmasked = _reference(run, drop_masks=True)
    assert set(got) == set(want)

    def relative_update_error(weights):
        num = sum(float(((got[n] - weights[n]) ** 2).sum()) for n in weights)
        den = sum(float(((weights[n] - start_weights[n]) ** 2).sum()) for n in weights)
        return (num / den) ** 0.5

    assert relative_update_error(want) < 1e-5
    assert relative_update_error(unmasked) > 1e-2
    with open(run / "masks.jsonl") as handle:
        metrics = [json.loads(line) for line in handle]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["dp_world"] == 2 for m in metrics)
    assert all(m["members_in_steps_rank0"] >= 1 for m in metrics)  # rank 0's tool spans ran in steps
