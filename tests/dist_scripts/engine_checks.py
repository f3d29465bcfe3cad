"""Rank script of tests/launcher/test_engine.py, started by the real launcher, on one node (`deepspeed --num_gpus 2
engine_checks.py --out D`) or, as the test does, as a 2-node job of one rank per node (two launcher invocations
with a hostfile, --no_ssh and --node_rank 0/1, master on 127.0.0.1).

Every rank runs every check (they are collective) and writes D/engine_rank<r>.json: check -> measured numbers (or
the error). The single-process references are computed on each rank from a deep copy of the model taken before
`ds_longstraw.initialize` partitions it, or for the adapter checks from a second build of the same weights
(plain grpo_backward + the same torch optimizer, no process group).

Checks (float32 tiny qwen3_5, ZeRO-3 with every parameter partitioned: stage3_param_persistence_threshold 0,
gradient_clipping 0):
  same_step   detached; both ranks bring the same group; two grpo_steps (SGD)
              == two single-process grpo_backward + SGD steps
  average     exact, host-memory page tier; rank 0 brings [A, B], rank 1 brings C; one step (SGD)
              == SGD step on 1/2 (1/2 (g_A + g_B) + g_C); mean_loss == 1/2 (1/2 (L_A + L_B) + L_C). The prefix
              pass recomputes each layer in backward (prefix_recompute, the default), its padding iterations too:
              ZeRO-3 gathers the layers' weights again inside backward, in step on both ranks
  checkpoint  detached, AdamW + DeepSpeed WarmupLR: step 1, save, step 2 -> P; a fresh engine on DIFFERENT initial
              weights loads the step-1 checkpoint, takes step 2 -> Q; P == Q bit for bit (loss and lr too). Then
              copies of that checkpoint crafted by rank 0 (tests/crafted_checkpoints.py): an entry in rank 1's
              model-state file whose unpickling would touch a marker is refused by load_checkpoint on BOTH ranks
              (each reads every file first), naming the file and the type, and the marker never appears; a
              harmless legacy entry is refused the same way and loads with trust_pickle=True
  zero2       ZeRO stage 2 (weights replicated: no lockstep needed), rank r brings its own group; one step
              == SGD on the mean of the two groups' gradients. Then a parameter only rank 0 gives a gradient
              (loss sum(p^2) over all parameters on rank 0, all but lm_head on rank 1): grpo_step's zero fill lets
              the one reduction run and lm_head moves by lr * 2p / 2, the rest by lr * 2p
  lora        exact, peft LoRA (adapters made non-zero), kl_coef 0.1, a different group per rank (so the
              reference scoring is padded too); one step (SGD over the adapters) == single-process step on the
              mean of the two groups' gradients; frozen weights unchanged bit for bit; each rank's reference
              log-probs == the base model's log-probs (and differ from the policy's, so the check can fail)
  qlora       as lora, over an NF4 base loaded from a checkpoint written by rank 0 (bitsandbytes; frozen weights
              compared bit for bit: packed codes stored as float32 may read as NaN)
  glm         as average, on a tiny float32 glm_moe_dsa (GLM-5.2 shape: MLA + DSA, IndexShare, MoE with a dense
              first layer): its MoE blocks are ZeRO-3 leaf modules (gathered whole per call; the experts a call
              routes to depend on the tokens), and the step equals the single-process step
  ep          as glm with "ep_size": 2 (8 routed experts, 4 per rank): the slices kept out of ZeRO, routed pairs
              dispatched over the ranks, each slice's gradient summed over the ranks holding it / W; the step on
              the non-expert weights and on each rank's slice == the single-process step on the whole model
  ep_export   an EP run's checkpoint through `longstraw export`: the whole model (experts joined from both ranks'
              slice files), every tensor equal to the engine's at the save, loaded by transformers; a copy whose
              rank-1 slice file would run code is refused, with --trust-pickle too (slices are the project's data)
  ep_checkpoint  ZeRO-3 + EP, AdamW + WarmupLR: step 1, save, step 2 -> P; a fresh engine on different weights
              loads the step-1 checkpoint (the engine's and each rank's expert-slice file), step 2 -> Q; P == Q bit
              for bit, slices and their optimizer state included. Crafted copies as in checkpoint: slice files
              that would run code are refused by load_checkpoint and by the expert-slice loader itself, each
              naming the file
  rollout_lockstep  grpo_step(prompts, rollout=ROLLOUT) with eos ids, two steps: rank 0 [29, 19]-token prompts and
              rank 1 [41] (an idle decode slot), then [19] and [41] (different capture chunks, trained on the kept
              captures; "zero3_weights" "auto" finding room: the weights gathered once, ZeRO-3's hooks off while
              decoding; step 1's "auto" is granted none, zero3_whole_budget 0, and decodes per call);
              each rank's samples == single-process rollout_groups at the same seeds and the weights ==
              the single-process SGD steps on the averaged gradients; then generate(dp_group=, batched=False) with 3
              samples on rank 0 and 2 on rank 1 == single-process generate on the engine's weights; then
              generate(dp_group=, environment=) batched and not, the ranks' samples taking different turns ==
              single-process generate, with the same module calls on both ranks
  rollout_ep  the two rollout steps on the tiny glm_moe_dsa with "ep_size": 2 (decode dispatches in lockstep)
  shared_document  ZeRO-2, exact, KL: each rank's two groups share a document of its own, captured once per rank
              (grpo/shared.py); the step == SGD on the mean of the four groups' plain gradients
  shared_document_zero3  ZeRO-3, exact, KL: rank 0's two groups share a document, run as one group over it
              (grpo/flat_document.py) padded against rank 1's one group; the step == the average
  shared_document_zero3_detached  the same in detached mode: each merged member holds its question
              (GRPOGroup.held_prefixes), its steps cut where the question ends, rank 1 padding its calls to them
"""

import argparse
import copy
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: models.py

import deepspeed  # noqa: E402
import torch  # noqa: E402
from crafted_checkpoints import RunsCommand, add_entry, copy_tag, legacy_entry  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from glm_models import VOCAB as GLM_VOCAB  # noqa: E402
from glm_models import tiny_glm_moe_dsa  # noqa: E402
from models import tiny_qwen3_5  # noqa: E402

import ds_longstraw  # noqa: E402
from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward  # noqa: E402

# The references below weigh each group's own loss equally (the mean of the groups' gradients): the "group" scope.
# The default "step" scope is proven against the peers' losses in tests/distributed/test_objective_dp.py.
GROUP_MEAN = GRPOObjective(loss_scope="group")
from ds_longstraw.grpo.transaction import score_reference  # noqa: E402


def block(mode, tier="none"):
    # chunk 16, page 8, replay block 4: prompts and responses below are not multiples of any of them
    return {"enabled": True, "prefix_grad": mode, "capture_chunk": 16, "replay_block": 4, "page_tokens": 8,
            "offload": {"tier": tier}}


def ds_config(mode, tier="none", **extra):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "longstraw": block(mode, tier)}
    config.update(extra)
    return config


def make_group(seed, prompt_len, response_lens, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(0, vocab, (prompt_len,), generator=gen),
                     [torch.randint(0, vocab, (n,), generator=gen) for n in response_lens],
                     rewards=torch.rand(len(response_lens), generator=gen).tolist())


def gathered(engine):
    """Full copies of every parameter of a ZeRO-3 engine (collective)."""
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            out[name] = param.detach().clone()
    return out


def step_error(engine_params, reference, before):
    """||engine - reference|| / ||reference - before||: the engine's update against the reference update
    (reference: a module, or {name: tensor})."""
    ref = dict(reference) if isinstance(reference, dict) else dict(reference.named_parameters())
    num = sum(float(((engine_params[n] - ref[n].detach()) ** 2).sum()) for n in engine_params)
    den = sum(float(((ref[n].detach() - before[n]) ** 2).sum()) for n in engine_params)
    return (num / den) ** 0.5


def same_bits(a, b):
    """Bit-for-bit equality (packed 4-bit codes stored as float32 can read as NaN, which never equals itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_same_step(out_dir):
    model = tiny_qwen3_5(torch.float32, seed=0)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config("detached"))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ref_losses = [], []
    for group in [make_group(10, 37, [5, 1, 9]), make_group(11, 23, [4, 6])]:
        losses.append(engine.grpo_step(group, GROUP_MEAN).mean_loss)
        reference.zero_grad(set_to_none=True)
        ref_losses.append(grpo_backward(reference, group, longstraw=block("detached")).loss)
        ref_opt.step()
    return {"rel": step_error(gathered(engine), reference, before), "losses": losses, "ref_losses": ref_losses,
            "global_steps": engine.global_steps}


AVERAGE_WEIGHTS = {"A": 0.25, "B": 0.25, "C": 0.5}  # rank 0 brings [A, B], rank 1 [C]


def reference_sgd_step(reference, groups, weights, mode):
    """Single process: SGD (lr 0.1) on sum_name weight * grad(group name); returns the weighted loss."""
    grads, loss = {}, 0.0
    for name, group in groups.items():  # each group's gradient alone, then the weighted sum
        reference.zero_grad(set_to_none=True)
        loss += weights[name] * grpo_backward(reference, group, longstraw=block(mode)).loss
        for pname, p in reference.named_parameters():
            # no gradient: a parameter no loss path reaches (GLM's indexer) or an expert no token was routed to
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            grads[pname] = grads.get(pname, 0.0) + weights[name] * grad
    for pname, p in reference.named_parameters():
        p.grad = grads[pname]
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    return loss


def check_average(out_dir, model=None, groups=None):
    rank = dist.get_rank()
    model = tiny_qwen3_5(torch.float32, seed=1) if model is None else model
    reference = copy.deepcopy(model)
    before = snapshot(model)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config("exact", tier="cpu"))
    groups = groups or {"A": make_group(20, 29, [3, 7]), "B": make_group(21, 19, [1, 2, 5]),
                        "C": make_group(22, 41, [6, 2])}
    mine = [groups["A"], groups["B"]] if rank == 0 else [groups["C"]]
    result = engine.grpo_step(mine, GROUP_MEAN)
    ref_loss = reference_sgd_step(reference, groups, AVERAGE_WEIGHTS, "exact")
    return {"rel": step_error(gathered(engine), reference, before), "mean_loss": result.mean_loss,
            "ref_mean_loss": ref_loss, "rank_groups": len(result.groups)}


def check_glm(out_dir):
    """check_average on the tiny glm_moe_dsa (prompts longer than index_topk: the selection is sparse)."""
    model = tiny_glm_moe_dsa(torch.float32, seed=3)
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    groups = {"A": make_group(30, 45, [3, 7], GLM_VOCAB), "B": make_group(31, 37, [1, 2, 5], GLM_VOCAB),
              "C": make_group(32, 53, [6, 2], GLM_VOCAB)}
    result = check_average(out_dir, model, groups)
    result["moe_blocks"] = len(moe)
    result["moe_leaves"] = sum(deepspeed.utils.z3_leaf_module(block) for block in moe)
    return result


EP_MODEL = {"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}


def engine_params(engine):
    """Every parameter this rank's engine holds: the ZeRO-3 ones gathered, and its expert slices (ep_size > 1)."""
    params = gathered(engine)
    experts = engine.longstraw_experts
    if experts is not None:
        params.update({n: p.detach().clone() for n, p in experts.params.items()})
    return params


def as_engine_holds(engine, params):
    """A whole model's {name: tensor} as this rank's engine holds it: expert parameters sliced to its experts."""
    experts = engine.longstraw_experts
    if experts is None:
        return params
    lo, hi = experts.local.start, experts.local.stop
    return {n: (p[lo:hi] if n in experts.params else p) for n, p in params.items()}


def check_ep(out_dir):
    """check_average's groups and weights on the tiny glm_moe_dsa with its experts sharded over the 2 ranks."""
    rank = dist.get_rank()
    model = tiny_glm_moe_dsa(torch.float32, seed=3, **EP_MODEL)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    config = ds_config("exact", tier="cpu")
    config["longstraw"]["ep_size"] = 2
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    groups = {"A": make_group(30, 45, [3, 7], GLM_VOCAB), "B": make_group(31, 37, [1, 2, 5], GLM_VOCAB),
              "C": make_group(32, 53, [6, 2], GLM_VOCAB)}
    result = engine.grpo_step([groups["A"], groups["B"]] if rank == 0 else [groups["C"]], GROUP_MEAN)
    ref_loss = reference_sgd_step(reference, groups, AVERAGE_WEIGHTS, "exact")
    ref_after = as_engine_holds(engine, {n: p.detach() for n, p in reference.named_parameters()})
    experts = engine.longstraw_experts
    zero3 = {n for n, p in engine.module.named_parameters() if hasattr(p, "ds_id")}
    return {"rel": step_error(engine_params(engine), ref_after, as_engine_holds(engine, before)),
            "mean_loss": result.mean_loss, "ref_mean_loss": ref_loss, "experts": [experts.local.start,
                                                                                   experts.local.stop],
            "slices": len(experts.params), "slices_in_zero": len(set(experts.params) & zero3),
            "load_imbalance": result.groups[0].extras["ep"]["load_imbalance"],
            "moe_leaves": sum(deepspeed.utils.z3_leaf_module(b) for b in experts_blocks(engine.module))}


def experts_blocks(model):
    from ds_longstraw.arch.glm_moe_dsa_experts import moe_blocks

    return moe_blocks(model)


def check_ep_checkpoint(out_dir):
    """resumed_step_2 on the tiny glm_moe_dsa with its experts sharded over the two ranks."""
    first, second = make_group(33, 39, [4, 3], GLM_VOCAB), make_group(34, 31, [2, 8, 1], GLM_VOCAB)
    result, engine = resumed_step_2(lambda seed: tiny_glm_moe_dsa(torch.float32, seed=seed, **EP_MODEL), (5, 6),
                                    first, second, os.path.join(out_dir, "ckpt_ep"), ep_size=2)
    files = sorted(f for f in os.listdir(os.path.join(out_dir, "ckpt_ep", "step1")) if f.startswith("experts_"))
    crafted = crafted_loads(engine, os.path.join(out_dir, "ckpt_ep"), "ep", files,
                            "zero_pp_rank_1_mp_rank_00_model_states.pt")
    try:  # the expert-slice loader alone, on this rank's own crafted file
        engine.longstraw_experts.load(os.path.join(out_dir, "ep_crafted"), "step1")
        crafted["slice_loader_refused"] = None
    except ValueError as error:
        crafted["slice_loader_refused"] = str(error)
    crafted["marker"] = os.path.exists(os.path.join(out_dir, "ep_MARKER"))
    return dict(result, slices=len(engine.longstraw_experts.params), files=files, **crafted)


def check_ep_export(out_dir):
    """An EP run's checkpoint (the engine's shards + each rank's expert-slice file) exported by `longstraw export`
    is the whole model: every tensor equals the engine's at the save, the experts joined from both ranks' slices,
    and transformers loads it."""
    from transformers import AutoModelForCausalLM

    from ds_longstraw.engine.export import export_checkpoint
    from ds_longstraw.models.modeling import build_model

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shape = os.path.join(repo, "configs", "models", "tiny_glm_moe_dsa.yaml")  # 4 routed experts: 2 per rank
    model = build_model(shape=shape, dtype="float32", seed=11)
    config = ds_config("detached")
    config["longstraw"]["ep_size"] = 2
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    engine.grpo_step(make_group(36, 41, [3, 5], 128), GROUP_MEAN)
    ckpt = os.path.join(out_dir, "ckpt_ep_export")
    engine.save_checkpoint(ckpt, tag="step1")
    params = engine_params(engine)
    slices = engine.longstraw_experts.params
    everyone = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(everyone, {n: p.detach() for n, p in slices.items()})
    for name in slices:
        params[name] = torch.cat([rank_slices[name] for rank_slices in everyone])
    result = {"experts": len(slices)}
    if dist.get_rank() == 0:
        run = os.path.join(out_dir, "ep_export_run.yaml")
        with open(run, "w") as handle:
            handle.write(f"deepspeed_config: {os.path.join(repo, 'configs', 'deepspeed', 'zero3_cpu.json')}\n"
                         f"model: {{shape: {shape}, dtype: float32}}\ndata: {{path: unused.jsonl}}\n")
        out = os.path.join(out_dir, "ep_export")
        export_checkpoint(ckpt, out, tag="step1", run_config=run)
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        result.update(names_match=sorted(params) == sorted(n for n in exported if n in params),
                      missing=[n for n in params if n not in exported],
                      max_abs=max(float((exported[n] - p).abs().max()) for n, p in params.items() if n in exported),
                      expert_shape=list(exported[next(iter(slices))].shape))
        marker = os.path.join(out_dir, "ep_export_MARKER")
        add_entry(os.path.join(copy_tag(ckpt, "step1", ckpt + "_crafted"), "experts_ep2_rank1.pt"), "extra",
                  RunsCommand(marker))
        result["refused"] = [_refusal(lambda trust=trust: export_checkpoint(
            ckpt + "_crafted", out + "_crafted", tag="step1", run_config=run, trust_pickle=trust))
            for trust in (False, True)]
        result["marker"] = os.path.exists(marker) or os.path.exists(out + "_crafted")
    dist.barrier()
    return result


def resumed_step_2(build, seeds, first, second, ckpt, ep_size=1):
    """AdamW + DeepSpeed WarmupLR: step 1 on build(seeds[0]), save, step 2 -> P; a fresh engine on build(seeds[1])
    (different starting weights: everything must come from the checkpoint) loads the step-1 checkpoint and takes
    step 2 -> Q. Returns (P against Q, the first engine)."""
    config = ds_config("detached", scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}})
    config["longstraw"]["ep_size"] = ep_size

    def engine_from(seed):
        model = build(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        return ds_longstraw.initialize(model=model, optimizer=optimizer, config=config)[0]

    engine = engine_from(seeds[0])
    engine.grpo_step(first, GROUP_MEAN)
    engine.save_checkpoint(ckpt, tag="step1", client_state={"step": 1})
    straight = engine.grpo_step(second, GROUP_MEAN)
    p = engine_params(engine)
    resumed = engine_from(seeds[1])
    path, client = resumed.load_checkpoint(ckpt, tag="step1")
    again = resumed.grpo_step(second, GROUP_MEAN)
    q = engine_params(resumed)
    return {"max_abs": max(float((p[n] - q[n]).abs().max()) for n in p), "same_names": sorted(p) == sorted(q),
            "loss": straight.mean_loss, "resumed_loss": again.mean_loss, "lr": straight.lr, "resumed_lr": again.lr,
            "client_step": client.get("step"), "loaded": path is not None,
            "global_steps": [engine.global_steps, resumed.global_steps]}, engine


def _refusal(load):
    """The ValueError's message of load(), or None when it loaded."""
    try:
        load()
    except ValueError as error:
        return str(error)
    return None


def crafted_loads(engine, ckpt, name, code_files, legacy_file):
    """engine.load_checkpoint of two copies of the step-1 checkpoint `ckpt`, crafted by rank 0 (both ranks then read
    them): <name>_crafted with an entry in each of `code_files` whose unpickling would touch <name>_MARKER, and
    <name>_legacy with a harmless legacy entry in `legacy_file`. Returns each refusal's message (None: loaded), the
    trusted legacy load's client state and whether the marker exists."""
    out_dir = os.path.dirname(ckpt)
    crafted, legacy = os.path.join(out_dir, f"{name}_crafted"), os.path.join(out_dir, f"{name}_legacy")
    marker = os.path.join(out_dir, f"{name}_MARKER")
    if dist.get_rank() == 0:
        tag_dir = copy_tag(ckpt, "step1", crafted)
        for victim in code_files:
            add_entry(os.path.join(tag_dir, victim), "extra", RunsCommand(marker))
        add_entry(os.path.join(copy_tag(ckpt, "step1", legacy), legacy_file), "extra", legacy_entry())
    dist.barrier()
    out = {"refused": _refusal(lambda: engine.load_checkpoint(crafted, tag="step1")),
           "legacy_refused": _refusal(lambda: engine.load_checkpoint(legacy))}  # tag None: the `latest` file's
    path, client = engine.load_checkpoint(legacy, tag="step1", trust_pickle=True)
    out.update(legacy_trusted=path is not None and client.get("step") == 1, marker=os.path.exists(marker))
    return out


def check_checkpoint(out_dir):
    first, second = make_group(30, 33, [4, 3]), make_group(31, 27, [2, 8, 1])
    result, engine = resumed_step_2(lambda seed: tiny_qwen3_5(torch.float32, seed=seed), (3, 4), first, second,
                                    os.path.join(out_dir, "ckpt"))
    victim = "zero_pp_rank_1_mp_rank_00_model_states.pt"  # rank 0 never loads it, and refuses it all the same
    return dict(result, **crafted_loads(engine, os.path.join(out_dir, "ckpt"), "zero3", [victim], victim))


def check_lora(out_dir):
    return adapter_step(lambda: tiny_qwen3_5(torch.float32, seed=5))


def check_qlora(out_dir):
    """As check_lora on an NF4 base loaded from a checkpoint (bitsandbytes 4-bit codes stored as float32)."""
    from ds_longstraw.models.modeling import build_model

    base_dir = os.path.join(out_dir, "qlora_base")
    if dist.get_rank() == 0:
        tiny_qwen3_5(torch.float32, seed=8).save_pretrained(base_dir)
    dist.barrier()
    return adapter_step(lambda: build_model(pretrained=base_dir, four_bit=True, ds_config=ds_config("exact")))


def adapter_step(load_base):
    """exact, peft LoRA over `load_base()` (adapters made non-zero), kl_coef 0.1, a different group per rank; the
    ZeRO-3 step against the single-process step on the mean gradient, frozen weights, reference log-probs."""
    from ds_longstraw.models.lora import apply_lora

    base = load_base()
    base_copy = load_base()  # (a deepcopy of a 4-bit model would share its quantization state)
    four_bit_layers = sum(type(m).__name__ == "Linear4bit" for m in base.modules())
    policy = apply_lora(base, r=4, alpha=8, seed=0)
    reference = apply_lora(load_base(), r=4, alpha=8, seed=0)
    with torch.no_grad():  # peft starts lora_B at zero (adapters a no-op): make them matter
        for model in (policy, reference):
            gen = torch.Generator().manual_seed(6)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    before = snapshot(policy)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    objective = GRPOObjective(kl_coef=0.1, loss_scope="group")
    groups = [make_group(40, 35, [3, 5]), make_group(41, 18, [6, 1, 4])]
    group = groups[dist.get_rank()]
    engine, *_ = ds_longstraw.initialize(model=policy, optimizer=torch.optim.SGD(trainable, lr=0.1),
                                         config=ds_config("exact"))
    result = engine.grpo_step(group, objective)
    grads = {}
    for each in groups:  # the mean of the two ranks' group gradients
        reference.zero_grad(set_to_none=True)
        grpo_backward(reference, each, objective, longstraw=block("exact"))
        for name, p in reference.named_parameters():
            if p.requires_grad:
                grads[name] = grads.get(name, 0.0) + 0.5 * p.grad
    for name, p in reference.named_parameters():
        if p.requires_grad:
            p.grad = grads[name]
    torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1).step()
    after = gathered(engine)
    trainable_names = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    frozen_changed = [n for n in after if n not in trainable_names and not same_bits(after[n], before[n])]
    adapters_moved = sum(float((after[n] - before[n]).abs().max() > 0) for n in trainable_names)
    base_scores = score_reference(base_copy, group, ds_longstraw.parse_config(block("exact")))
    ref_vs_base = max(float((a - b).abs().max())
                      for a, b in zip(result.groups[0].ref_logprobs, base_scores, strict=True))
    policy_vs_base = max(float((a - b).abs().max())
                         for a, b in zip(result.groups[0].logprobs, base_scores, strict=True))
    return {"rel": step_error({n: after[n] for n in trainable_names}, reference, before),
            "frozen_changed": frozen_changed, "adapters_moved": adapters_moved, "adapters": len(trainable_names),
            "all_adapters_are_lora": all("lora_" in n for n in trainable_names),
            "ref_vs_base": ref_vs_base, "policy_vs_base": policy_vs_base, "four_bit_layers": four_bit_layers}


def check_zero2(out_dir):
    from ds_longstraw.engine.engine import _fill_missing_grads

    rank = dist.get_rank()
    model = tiny_qwen3_5(torch.float32, seed=7)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    config = ds_config("detached")
    config["zero_optimization"] = {"stage": 2}
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    groups = [make_group(50, 30, [2, 6]), make_group(51, 45, [5, 3, 1])]
    engine.grpo_step(groups[rank], GROUP_MEAN)
    grads = {}
    for group in groups:
        reference.zero_grad(set_to_none=True)
        grpo_backward(reference, group, longstraw=block("detached"))
        for name, p in reference.named_parameters():
            grads[name] = grads.get(name, 0.0) + 0.5 * p.grad
    for name, p in reference.named_parameters():
        p.grad = grads[name]
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    rel = step_error({n: p.detach().clone() for n, p in engine.module.named_parameters()}, reference, before)

    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with engine.coalesce_grad_reduction():
        loss = sum((p ** 2).sum() for n, p in engine.module.named_parameters() if rank == 0 or "lm_head" not in n)
        engine.backward(loss, scale_wrt_gas=False)
        _fill_missing_grads(engine)
    engine.step()
    fill = 0.0
    for name, p in engine.module.named_parameters():
        factor = 0.5 if "lm_head" in name else 1.0
        want = start[name] - 0.1 * factor * 2 * start[name]
        fill = max(fill, float((p.detach() - want).abs().max() / want.abs().max()))
    return {"rel": rel, "fill": fill}


# Rollouts in lockstep: eos ends samples early, so the ranks' decode steps differ (the ghost steps pad them).
ROLLOUT = {"source": "internal", "num_samples": 3, "max_new_tokens": 6, "temperature": 1.0,
           "reward": "rewards:mod3_reward", "eos_token_id": list(range(0, 97, 4)), "seed": 5}


def rollout_steps(model, ep_size, steps, vocab):
    """`steps`: per step, (rank 0's prompt lengths, rank 1's). Step s is engine.grpo_step(this rank's prompts,
    rollout=ROLLOUT) under ZeRO-3 (detached, SGD), "zero3_weights" "auto" serving the weights per call in step 1
    (no room granted) and gathering them whole in the later ones, against a single-process reference on a copy of
    the weights:
    rollout_groups of every rank's prompts at that step's seeds (rank 1's prompt indices after rank 0's), each
    group's gradient weighted as the engine averages (1/len per rank, 1/2 over ranks), one SGD step."""
    from ds_longstraw.rollout import generate as rollout_module
    from ds_longstraw.rollout.step import rollout_groups

    rank = dist.get_rank()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    config = ds_config("detached")
    config["longstraw"]["ep_size"] = ep_size
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    ghost_steps, fetches, decoding = [0], [0], [False]
    real_ghost, real_generate = rollout_module._ghost_step, rollout_module._generate
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    real_fetch = coordinator.fetch_sub_module

    def counted(*args, **kwargs):  # the padding steps this rank takes (the real ones, counted)
        ghost_steps[0] += 1
        return real_ghost(*args, **kwargs)

    def generating(*args, **kwargs):  # marks the calls made while generate captures and decodes
        decoding[0] = True
        try:
            return real_generate(*args, **kwargs)
        finally:
            decoding[0] = False

    def fetch(*args, **kwargs):  # ZeRO-3's gather of a submodule's weights before it runs
        fetches[0] += decoding[0]
        return real_fetch(*args, **kwargs)

    rollout_module._ghost_step, rollout_module._generate = counted, generating
    coordinator.fetch_sub_module = fetch
    out = {"responses": [], "ref_responses": [], "reused": [], "ghost_steps": [], "decode_fetches": []}
    try:
        for step, lengths in enumerate(steps):
            gen = torch.Generator().manual_seed(100 + step)
            prompts = [[torch.randint(0, vocab, (n,), generator=gen) for n in rank_lengths] for rank_lengths in lengths]
            ghost_steps[0] = fetches[0] = 0
            # step 1: "auto" with no room granted (zero3_whole_budget 0) decodes per call; later steps: "auto"
            # finds room on this machine for the tiny model and gathers it whole
            rollout = dict(ROLLOUT, zero3_whole_budget=0.0) if step == 0 else ROLLOUT
            result = engine.grpo_step(prompts[rank], GROUP_MEAN, rollout=rollout)
            out.setdefault("zero3_weights", []).append(result.extras["zero3_weights"])
            out["ghost_steps"].append(ghost_steps[0])
            out["decode_fetches"].append(fetches[0])
            out["reused"].append([g.extras["capture_reused"] for g in result.groups])
            out["responses"].append([[len(logp) for logp in g.logprobs] for g in result.groups])
            groups, weights = {}, {}
            for r, rank_prompts in enumerate(prompts):
                first = sum(len(q) for q in prompts[:r])
                for j, group in enumerate(rollout_groups(reference, rank_prompts, ROLLOUT, step=step,
                                                         first_index=first, longstraw=block("detached"))):
                    groups[f"{r}.{j}"], weights[f"{r}.{j}"] = group, 0.5 / len(rank_prompts)
            out["ref_responses"].append([[len(x) for x in groups[f"{rank}.{j}"].response_ids]
                                         for j in range(len(prompts[rank]))])
            out.setdefault("rewards", []).append(result.extras["rewards"])
            out.setdefault("ref_rewards", []).append([groups[f"{rank}.{j}"].rewards.tolist()
                                                      for j in range(len(prompts[rank]))])
            reference_sgd_step(reference, groups, weights, "detached")
    finally:
        rollout_module._ghost_step, rollout_module._generate = real_ghost, real_generate
        coordinator.fetch_sub_module = real_fetch
    ref_after = as_engine_holds(engine, {n: p.detach() for n, p in reference.named_parameters()})
    out["rel"] = step_error(engine_params(engine), ref_after, as_engine_holds(engine, before))
    return out, engine, reference


def document_groups(seed, document, questions, response_lens):
    """Groups whose prompts are one `document`-token document and a question of their own of each length."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 97, (document,), generator=gen)
    return [GRPOGroup(torch.cat([shared, torch.randint(0, 97, (q,), generator=gen)]),
                      [torch.randint(0, 97, (n,), generator=gen) for n in response_lens],
                      rewards=torch.rand(len(response_lens), generator=gen).tolist()) for q in questions]


def check_shared_document(out_dir, stage=2, mode="exact"):
    """Exact, KL. ZeRO-2 (no lockstep): each rank's two groups share a document of its own (rank 0: 40 tokens,
    questions of 5 and 9; rank 1: 33 tokens, questions of 7 and 3), which grpo_step captures once per rank as a
    tree (grpo/shared.py). ZeRO-3 (stage 3, lockstep): rank 0's two groups share its document, rank 1 brings one
    group; rank 0's run as one group over the document (grpo/flat_document.py), padded against rank 1's. Either
    way the step == SGD on the data-parallel average of plain grpo_backward gradients, each group capturing its
    whole prompt. mode "detached": the same with ZeRO-3, rank 0's members holding their questions."""
    rank = dist.get_rank()
    model = tiny_qwen3_5(torch.float32, seed=11)
    ref_model = tiny_qwen3_5(torch.float32, seed=12)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    objective = GRPOObjective(loss_scope="group", kl_coef=0.2)
    config = ds_config(mode)
    if stage == 2:
        config["zero_optimization"] = {"stage": 2}
    config["longstraw"]["shared_prefix_min"] = 16
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    groups = [document_groups(60, 40, [5, 9], [3, 6]), document_groups(61, 33, [7, 3], [4, 2, 5])]
    if stage == 3:
        groups[1] = groups[1][:1]
    result = engine.grpo_step(groups[rank], objective, ref_model=ref_model)
    documents = [g.extras.get("document", {}).get("tokens") for g in result.groups]
    how = [g.extras.get("document", {}).get("questions", "captured") for g in result.groups]
    grads = {}
    for mine in groups:
        for group in mine:
            reference.zero_grad(set_to_none=True)
            grpo_backward(reference, group, objective, longstraw=block(mode), ref_model=ref_model)
            for name, p in reference.named_parameters():
                grads[name] = grads.get(name, 0.0) + 0.5 / len(mine) * p.grad
    for name, p in reference.named_parameters():
        p.grad = grads[name]
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    after = gathered(engine) if stage == 3 else {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"rel": step_error(after, reference, before), "documents": documents, "how": how}


def check_rollout_lockstep(out_dir):
    """Step 1: rank 0 two prompts, rank 1 one (an idle slot; captured again for training); step 2: one prompt each,
    of different capture chunks (chunk 16: 2 and 3), trained on the rollout captures padded alike. Then generate
    itself over the data-parallel group, one sample at a time (the plain reference path: rank 1 decodes 2 samples
    and a ghost sample while rank 0 decodes 3), against single-process generate on the engine's weights."""
    out, engine, reference = rollout_steps(tiny_qwen3_5(torch.float32, seed=12), 1,
                                           [((29, 19), (41,)), ((19,), (41,))], 97)
    rank = dist.get_rank()
    params = gathered(engine)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(params[name])
    prompt = torch.randint(0, 97, (29 if rank == 0 else 45,), generator=torch.Generator().manual_seed(200 + rank))
    kwargs = dict(eos_token_id=ROLLOUT["eos_token_id"], seed=7 + rank, longstraw=block("detached"), batched=False)
    got = ds_longstraw.generate(engine.module, prompt, 3 - rank, 6, dp_group=engine.data_parallel_group, **kwargs)
    want = ds_longstraw.generate(reference, prompt, 3 - rank, 6, **kwargs)
    out["each_ids"] = [ids.tolist() for ids in got.response_ids]
    out["each_ref_ids"] = [ids.tolist() for ids in want.response_ids]
    out["each_logprob_diff"] = max(float((a - b).abs().max()) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    out.update(_turn_rollouts(engine, reference, prompt))
    return out


def _turn_rollouts(engine, reference, prompt):
    """generate(dp_group=, environment=) batched and one sample at a time: rank 0 decodes 2 samples, rank 1 3, each
    rank's tool table answering with observations of its own lengths, so the ranks' samples take different turns
    and capture different observations per step; against single-process generate on the engine's weights. Counts
    every module call each rank makes while it decodes (the lockstep pads them to the same)."""
    from turn_envs import ToolTable

    rank = dist.get_rank()
    stops, lengths = tuple(range(2, 97, 5)), ((3, 0, 6, 1), (9, 2, 1))[rank]
    kwargs = dict(temperature=0.9, top_p=0.95, seed=11 + rank, longstraw=block("detached"), max_turns=3)
    calls = [0]

    def count(*_):
        calls[0] += 1

    out = {"turns": [], "turns_ref": [], "turn_ids": [], "turn_ref_ids": [], "turn_masks_equal": [],
           "turn_logprob_diff": [], "turn_calls": []}
    for batched in (True, False):
        hooks = [m.register_forward_pre_hook(count) for m in engine.module.modules()]
        calls[0] = 0
        try:
            got = ds_longstraw.generate(engine.module, prompt, 2 + rank, 24, dp_group=engine.data_parallel_group,
                                        environment=ToolTable(stops, lengths), batched=batched, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        want = ds_longstraw.generate(reference, prompt, 2 + rank, 24, environment=ToolTable(stops, lengths),
                                     batched=batched, **kwargs)
        out["turns"].append(got.turns)
        out["turns_ref"].append(want.turns)
        out["turn_ids"].append([ids.tolist() for ids in got.response_ids])
        out["turn_ref_ids"].append([ids.tolist() for ids in want.response_ids])
        out["turn_masks_equal"].append(all(torch.equal(a, b) for a, b in zip(got.response_masks,
                                                                              want.response_masks, strict=True)))
        out["turn_logprob_diff"].append(max(float((a - b).abs().max())
                                            for a, b in zip(got.logprobs, want.logprobs, strict=True)))
        out["turn_calls"].append(calls[0])
    return out


def check_rollout_ep(out_dir):
    """As check_rollout_lockstep's steps on the tiny glm_moe_dsa with its experts sharded over the two ranks: every
    decode step dispatches routed tokens to the other rank, ghost steps included."""
    return rollout_steps(tiny_glm_moe_dsa(torch.float32, seed=13, **EP_MODEL), 2,
                         [((45,), (37, 23)), ((23,), (45,))], GLM_VOCAB)[0]


def check_objective_step(out_dir):
    """The default "step" scope over 2 data-parallel ranks (ZeRO-3, exact mode): rank 0 trains groups A and B, rank
    1 group C, with different trained-token counts, clip-higher, an entropy bonus and a token-truncated rollout
    correction. Reference: TRL's "dapo" loss (its default) on the three groups as one batch, whose normaliser is
    every trained token of the step, through full-sequence autograd of the model, then SGD."""
    from models import full_sequence_logprobs
    from objective_cases import objective_group
    from peer_losses import TRLLoss, trl_advantages, trl_rollout_ratio

    rank = dist.get_rank()
    model = tiny_qwen3_5(torch.float32, seed=2)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    groups = [objective_group(model, seed, nullcontext, prompt_len, lens)
              for seed, prompt_len, lens in ((40, 27, (4, 9)), (41, 21, (2, 6, 3)), (42, 33, (8, 5)))]
    objective = GRPOObjective(clip_high=0.28, entropy_coef=0.01, rollout_correction="token_truncate",
                              advantage_eps=1e-4)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config("exact", tier="cpu"))
    result = engine.grpo_step(groups[:2] if rank == 0 else groups[2:], objective)

    logps, entropies = [], []
    for group in groups:
        logps += full_sequence_logprobs(reference, group.prompt_ids, group.response_ids, entropies)

    def pad(rows):
        return torch.stack([torch.cat([r.double(), r.new_zeros(9 - r.numel(), dtype=torch.float64)]) for r in rows])

    mask = pad([g.mask(i).double() for g in groups for i in range(g.size)])
    old, sampling = (pad([x for g in groups for x in getattr(g, name)]) for name in ("old_logprobs",
                                                                                    "sampling_logprobs"))
    trl = TRLLoss("dapo", epsilon_high=0.28, entropy_coef=0.01, vllm_importance_sampling_correction=True)
    loss = trl(pad(logps), mask, torch.cat([trl_advantages(g.rewards) for g in groups]), old=old,
               entropies=pad(entropies), importance_ratio=trl_rollout_ratio(old, sampling, mask, "token_truncate"))
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    return {"rel": step_error(engine_params(engine), reference, before), "mean_loss": result.mean_loss,
            "ref_loss": float(loss.detach()), "trained_tokens": [g.trained_tokens() for g in groups]}


CHECKS = {"same_step": check_same_step, "average": check_average, "checkpoint": check_checkpoint,
          "zero2": check_zero2, "lora": check_lora, "qlora": check_qlora, "glm": check_glm, "ep": check_ep,
          "ep_checkpoint": check_ep_checkpoint, "ep_export": check_ep_export,
          "rollout_lockstep": check_rollout_lockstep, "rollout_ep": check_rollout_ep,
          "objective_step": check_objective_step, "shared_document": check_shared_document,
          "shared_document_zero3": lambda out: check_shared_document(out, stage=3),
          "shared_document_zero3_detached": lambda out: check_shared_document(out, stage=3, mode="detached")}


def run_checks(checks, file_prefix, **context):
    """The rank script's main: parse --out/--checks, run each named check (collective: every rank runs every check;
    one check's error is recorded for pytest and the others still run) and write <out>/<file_prefix><rank>.json
    with `context` and check -> numbers."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", default=",".join(checks))
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    results = {"world": dist.get_world_size(), **context}
    for name in args.checks.split(","):
        started = time.perf_counter()
        try:
            results[name] = checks[name](args.out)
        except Exception:  # recorded for pytest to show; the other checks still run
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    with open(os.path.join(args.out, f"{file_prefix}{dist.get_rank()}.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_checks(CHECKS, "engine_rank", node=int(os.environ.get("CROSS_RANK", -1)),
               nodes=int(os.environ.get("CROSS_SIZE", -1)), local_rank=int(os.environ.get("LOCAL_RANK", -1)))
