"""Rank script of tests/launcher/test_engine_cp.py: `deepspeed --num_gpus W engine_cp_checks.py --out D` with W = 2 (one
data-parallel replica of CP 2) or W = 4 (2 replicas x CP 2; consecutive ranks form a CP group).

Every rank runs every check (they are collective) and writes D/engine_cp_rank<r>.json: check -> numbers (or the
error). The single-process references come from a deep copy of the model taken before `ds_longstraw.initialize`
partitions it: plain grpo_backward (no process group, no CP) + the same torch optimizer.

Groups: A (prompt 30), B (prompt 26), C (prompt 41); capture_chunk 3 so the CP shards have different chunk counts
(B: 13 / 12 tokens -> 5 / 4 chunks; across replicas 5 vs 7), replay_block 4, responses of different block counts.
Replica 0 brings [A, B], replica 1 (W = 4) brings [C]: lockstep pads chunks, blocks, members and a whole group slot.
The step must follow the data-parallel average: W = 2: (g_A + g_B) / 2; W = 4: (g_A + g_B) / 4 + g_C / 2.

Checks (float32 tiny qwen3_5, SGD, gradient_clipping 0):
  zero3   ZeRO-3 with every parameter partitioned (persistence threshold 0), detached, cp_size 2, "cp_replay":
          "auto" (gathered at these sizes: each rank replays its members over the whole prompt's pages, gathered
          once; no replay lockstep of its own, the engine's pads the calls)
  zero2   ZeRO stage 2, exact (the layer-major CP prefix pass; no weight gathers to keep in step)
  zero3exact  ZeRO-3, exact, Ulysses capture (padded like the LSE capture), pages on the host tier: the
          layer-major prefix pass, each of its per-chunk loops padded to the most chunks of any shard (7)
  zero3kept   ZeRO-3, exact, prefix_keep_attention, "cp_prefix": "turns": the prefix turns are mirrored by the
          ranks not in turn, padded likewise; the owner in turn sends no forward page request (its
          attention was kept), and the mirroring ranks answer only the backward ones; with no remote exchange in
          a layer's forward, every layer is recomputed in backward (prefix_recompute), mirrors included
  glm3    ZeRO-3, detached, on a tiny float32 glm_moe_dsa (MLA + DSA with a global top-k over the CP shards,
          IndexShare, MoE blocks as ZeRO-3 leaves; prompts longer than index_topk, so the selection is sparse):
          the "topk_lse" capture padded like the LSE one
  glm3exact   the same in exact mode, pages on the host tier: in the mirrored prefix turns the serving rank
          answers the owner's SELECT, FORWARD and BACKWARD requests from inside its one-token dummy layers
  zero3spread  ZeRO-3, exact, host tier, "cp_replay": "spread" (layer-major prefix pass, every 2nd layer's input
          kept and the others recomputed, padded like the capture): each CP rank replays
          its own members (A, B: 3 and 2 members over 2 ranks; C: 2), padded to the common member slots and blocks
          of all 4 ranks
  glm3ep  glm3exact with "ep_size" = cp_size = 2 (8 routed experts, 4 per rank of each CP group: GLM-5.2's
          CP32/EP32 layout at toy size) and the layer-major prefix pass (its sparse layers' loops padded, the
          experts' dispatch in every padded call): routed pairs dispatched over the CP group, each slice's gradient
          summed over the replicas holding it; the step on the non-expert weights and each rank's slice == the
          average. "cp_replay": "gathered": each rank replays its own members over the gathered pages, and the
          pages' gradients go back to their ranks once before the prefix pass
  rollout ZeRO-3, detached, grpo_step(prompts, rollout=) with eos ids: replica 0 two prompts, replica 1 one (an idle
          decode slot, shard captures padded, ghost steps); then one prompt each of different lengths (trained on
          the kept shard captures, padded alike): samples == one process's, two steps == the averages
  document  ZeRO-3, exact, W = 4: replica 0's two groups share a document, run as one group over it
          (grpo/flat_document.py), padded against replica 1's C
Controls (single process, so a check can fail): the engine's step measured against a reference without the prefix
pass's gradient (exact) and against equal group weights (W = 4) must be far off.
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: models.py

import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from engine_checks import (  # noqa: E402
    EP_MODEL,
    as_engine_holds,
    document_groups,
    engine_params,
    make_group,
    run_checks,
    snapshot,
    step_error,  # noqa: E402
)
from glm_models import VOCAB as GLM_VOCAB  # noqa: E402
from glm_models import tiny_glm_moe_dsa  # noqa: E402
from models import tiny_qwen3_5  # noqa: E402

import ds_longstraw  # noqa: E402
from ds_longstraw import GRPOObjective, grpo_backward  # noqa: E402

CP = 2


def block(mode, cp_size=CP, tier="none", cp_attention="lse", keep=False, ep_size=1, cp_replay="replicated",
          cp_prefix="auto", inputs_every=1):
    return {"enabled": True, "prefix_grad": mode, "capture_chunk": 3, "replay_block": 4, "page_tokens": 8,
            "cp_size": cp_size, "offload": {"tier": tier}, "cp_attention": cp_attention,
            "prefix_keep_attention": keep, "ep_size": ep_size, "cp_replay": cp_replay, "cp_prefix": cp_prefix,
            "prefix_inputs_every": inputs_every}


def ds_config(mode, stage, **block_options):
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
            "longstraw": block(mode, **block_options)}


GROUPS = {"A": (60, 30, [5, 1, 9]), "B": (61, 26, [4, 6]), "C": (62, 41, [2, 7])}


def plan(vocab=97):
    """(this rank's groups, {name: weight of its gradient in the data-parallel average})."""
    replicas = dist.get_world_size() // CP
    replica = dist.get_rank() // CP
    groups = {name: make_group(*args, vocab) for name, args in GROUPS.items()}
    per_replica = [["A", "B"], ["C"]][:replicas]
    weights = {}
    for names in per_replica:
        for name in names:
            weights[name] = 1.0 / (replicas * len(names))
    return [groups[n] for n in per_replica[replica]], weights, groups


# family -> (a fresh tiny float32 model from a seed, its vocabulary)
MODELS = {"qwen": (lambda seed: tiny_qwen3_5(torch.float32, seed=seed), 97),
          "glm": (lambda seed: tiny_glm_moe_dsa(torch.float32, seed=seed), GLM_VOCAB),
          "glm_ep": (lambda seed: tiny_glm_moe_dsa(torch.float32, seed=seed, **EP_MODEL), GLM_VOCAB)}


def reference_step(reference, mode, weights, groups):
    """Single process: SGD on sum_name weight * grad(group name) (no CP); returns (model after, weighted loss)."""
    grads, loss = {}, 0.0
    for name, weight in weights.items():
        reference.zero_grad(set_to_none=True)
        loss += weight * grpo_backward(reference, groups[name], longstraw=block(mode, 1)).loss
        for pname, p in reference.named_parameters():
            if p.grad is not None:  # none: no loss path reaches it (GLM's indexer), or no token met that expert
                grads[pname] = grads.get(pname, 0.0) + weight * p.grad
    for pname, p in reference.named_parameters():
        p.grad = grads.get(pname)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    return reference, loss


def check(mode, stage, seed, family="qwen", **block_options):
    fresh, vocab = MODELS[family]
    model = fresh(seed)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config(mode, stage, **block_options))
    mine, weights, groups = plan(vocab)
    result = engine.grpo_step(mine, GRPOObjective(loss_scope="group"))
    after = engine_params(engine) if stage == 3 else {n: p.detach().clone() for n, p in
                                                       engine.module.named_parameters()}
    before = as_engine_holds(engine, before)
    cp = engine.longstraw_parallelism.cp
    ref, ref_loss = reference_step(reference, mode, weights, groups)
    ref = as_engine_holds(engine, {n: p.detach() for n, p in ref.named_parameters()})
    # Controls: the same comparison against references that a wrong CP factor or averaging would approach (the
    # first ignores the prefix pass's gradient, the second weighs every group equally); both must be far off.
    wrong = {}
    if mode == "exact":
        wrong["vs_detached"] = reference_step(fresh(seed), "detached", weights, groups)[0]
    if len(weights) > 2:
        wrong["vs_equal_weights"] = reference_step(fresh(seed), mode, {n: 1 / len(weights) for n in weights},
                                                   groups)[0]
    controls = {k: step_error(after, as_engine_holds(engine, {n: p.detach() for n, p in v.named_parameters()}),
                              before) for k, v in wrong.items()}
    return {"rel": step_error(after, ref, before), "controls": controls, "mean_loss": result.mean_loss,
            "ref_mean_loss": ref_loss,
            "rank_groups": len(result.groups), "cp_rank": cp.rank, "cp_size": cp.size,
            "shards": [g.extras["cp"]["shard"] for g in result.groups],
            "layouts": [g.extras["cp"]["layout"] for g in result.groups],
            "prefixes": [g.extras["cp"]["prefix"] for g in result.groups],
            "replays": [g.extras["cp"]["replay"] for g in result.groups]}


def check_rollout(out_dir):
    """ZeRO-3, detached, CP 2, grpo_step(prompts, rollout=ROLLOUT): replica 0 brings prompts of 30 and 26 tokens,
    replica 1 (W = 4) one of 41, their samples stopping at eos at different steps: the replicas decode in lockstep
    (idle slot, padded shard captures, ghost steps) while each CP group decodes its samples together. Each rank's
    samples == single-process rollout_groups at the same seeds; the step == the single-process data-parallel
    average."""
    from engine_checks import ROLLOUT

    from ds_longstraw.rollout.step import rollout_groups

    model = tiny_qwen3_5(torch.float32, seed=9)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=ds_config("detached", 3))
    replicas, replica = dist.get_world_size() // CP, dist.get_rank() // CP
    out = {}
    # step 1: two prompts on replica 0, one on replica 1; step 2: one each, of different shard chunk counts, so
    # the training step reuses every rank's kept capture padded alike
    for step, lengths in enumerate([[(30, 26), (41,)], [(26,), (41,)]]):
        gen = torch.Generator().manual_seed(70 + step)
        prompts = [[torch.randint(0, 97, (n,), generator=gen) for n in ls] for ls in lengths][:replicas]
        result = engine.grpo_step(prompts[replica], GRPOObjective(loss_scope="group"), rollout=ROLLOUT)
        groups, weights, mine = {}, {}, []
        for r, replica_prompts in enumerate(prompts):
            first = sum(len(q) for q in prompts[:r])
            for j, group in enumerate(rollout_groups(reference, replica_prompts, ROLLOUT, step=step,
                                                     first_index=first, longstraw=block("detached", 1))):
                groups[f"{r}.{j}"], weights[f"{r}.{j}"] = group, 1.0 / (replicas * len(replica_prompts))
                if r == replica:
                    mine.append(group)
        reference, ref_loss = reference_step(reference, "detached", weights, groups)
        for key, value in {"mean_loss": result.mean_loss, "ref_mean_loss": ref_loss,
                           "rewards": result.extras["rewards"], "ref_rewards": [g.rewards.tolist() for g in mine],
                           "responses": [[len(logp) for logp in g.logprobs] for g in result.groups],
                           "ref_responses": [[len(ids) for ids in g.response_ids] for g in mine],
                           "reused": [g.extras["capture_reused"] for g in result.groups]}.items():
            out.setdefault(key, []).append(value)
    out["rel"] = step_error(engine_params(engine), {n: p.detach() for n, p in reference.named_parameters()}, before)
    return out


def check_document(out_dir, mode="exact"):
    """ZeRO-3, exact, CP 2, W = 4: replica 0's two groups share a 40-token document (questions of 5 and 9 tokens),
    replica 1 brings C. grpo_step runs replica 0's as one group over the document (grpo/flat_document.py: sharded
    over the CP group as any prompt, each member opening with its question), padded against replica 1's group:
    the step == SGD on (g_D1 + g_D2)/4 + g_C/2 of plain single-process transactions. mode "detached": the same,
    each member holding its question (GRPOGroup.held_prefixes)."""
    model = tiny_qwen3_5(torch.float32, seed=8)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    config = ds_config(mode, 3, cp_prefix="layer_major")
    config["longstraw"]["shared_prefix_min"] = 16
    engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=config)
    first, second = document_groups(63, 40, [5, 9], [3, 2, 4])
    groups = {"D1": first, "D2": second, "C": make_group(*GROUPS["C"])}
    mine = [[first, second], [groups["C"]]][dist.get_rank() // CP]
    result = engine.grpo_step(mine, GRPOObjective(loss_scope="group"))
    after = engine_params(engine)
    before = as_engine_holds(engine, before)
    weights = {"D1": 0.25, "D2": 0.25, "C": 0.5}
    ref, _ = reference_step(reference, mode, weights, groups)
    ref = as_engine_holds(engine, {n: p.detach() for n, p in ref.named_parameters()})
    return {"rel": step_error(after, ref, before), "rank_groups": len(result.groups),
            "documents": [g.extras.get("document", {}).get("questions") for g in result.groups]}


CHECKS = {"zero3": lambda out: check("detached", 3, 0, cp_replay="auto"),
          "zero2": lambda out: check("exact", 2, 1, cp_prefix="layer_major"),
          "zero3exact": lambda out: check("exact", 3, 2, tier="cpu", cp_attention="ulysses", cp_prefix="layer_major"),
          "zero3kept": lambda out: check("exact", 3, 3, keep=True, cp_prefix="turns"),
          "glm3": lambda out: check("detached", 3, 4, family="glm"),
          "glm3exact": lambda out: check("exact", 3, 5, family="glm", tier="cpu", cp_prefix="turns"),
          "glm3ep": lambda out: check("exact", 3, 6, family="glm_ep", ep_size=2, cp_prefix="layer_major",
                                      cp_replay="gathered"),
          "zero3spread": lambda out: check("exact", 3, 7, tier="cpu", cp_replay="spread", cp_prefix="layer_major",
                                           inputs_every=2),
          "rollout": check_rollout, "document": check_document,
          "document_detached": lambda out: check_document(out, "detached")}


if __name__ == "__main__":
    run_checks(CHECKS, "engine_cp_rank")
