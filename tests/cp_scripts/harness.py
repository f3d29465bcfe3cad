"""Run grpo_backward on N gloo ranks (forked local processes) and collect each rank's results in files.

`run_cp(world, cases, out_dir)` forks `world` processes that join one gloo process group on localhost, build a
CP group with new_group (not the default group: the code under test must use the group it is given), run every
case and write `<case>.rank<r>.pt` with the rank's gradients, loss, log-probs, retained bytes and traffic.
Forking (rather than spawning) reuses the parent's imports of torch/transformers (about 10 s per process here).

A case is a dict: name, prompt_len, response_lens, mode, chunk, page, block, optional objective kwargs,
optional ref_seed (KL to a separate reference model), optional capture_move ("auto"/"kv"/"q"), optional
dtype ("float64" default), optional model (tiny_qwen3_5 config overrides), optional cp_attention, optional
worlds (the world sizes it runs on), optional expect_error (a ValueError is recorded instead of results),
optional repeat (grpo_backward calls without zeroing .grad in between), optional tier ("cpu", or "nvme": page
files under <out_dir>/nvme), optional keep (prefix_keep_attention) and kept_tier (offload.kept_attention_tier),
optional cp_replay, optional objective_case (a name of tests/objective_cases.py: its group and objective).
A GLM case (family "glm_moe_dsa") builds tests/glm_models.py's tiny_glm_moe_dsa (model: its config overrides) and
runs under glm_reference() instead of float64_model(); with record, every selection a selecting layer makes
(capture, replay, prefix pass) is saved as (phase, layer, first query position, positions, valid).
"""

import os
import sys
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
for path in (TESTS, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

from dist_scripts.launching import free_port  # noqa: E402  (one port finder for every launch; TESTS is on the path)


def make_group(prompt_len, response_lens, seed=0, **extra):
    from ds_longstraw import GRPOGroup

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 97, (n,), generator=gen) for n in response_lens]
    scores = torch.rand(len(responses), generator=gen).tolist()
    if len(responses) == 1:
        return GRPOGroup(prompt, responses, advantages=[0.7], **extra)
    return GRPOGroup(prompt, responses, rewards=scores, **extra)


def case_config(case, world, out_dir=None):
    config = {"prefix_grad": case["mode"], "capture_chunk": case["chunk"], "page_tokens": case["page"],
              "replay_block": case["block"], "cp_size": world, "cp_attention": case.get("cp_attention", "lse")}
    if "tier" in case:  # each rank's pages on the host tier, or in NVMe files under out_dir/nvme
        config["offload"] = {"tier": case["tier"]}
        if case["tier"] == "nvme":
            config["offload"]["nvme_path"] = nvme_dir(out_dir)
    if "cp_replay" in case:  # who replays which member ("replicated" or "spread")
        config["cp_replay"] = case["cp_replay"]
    if "layout" in case:
        config["cp_layout"] = case["layout"]
    if "scan" in case:
        config["cp_scan"] = case["scan"]
    if "prefix" in case:
        config["cp_prefix"] = case["prefix"]
    if "inputs_every" in case:
        config["prefix_inputs_every"] = case["inputs_every"]
    if case.get("keep"):  # exact mode's kept attention, optionally on a tier of its own
        config["prefix_keep_attention"] = True
    if "kept_tier" in case:
        offload = config.setdefault("offload", {})
        offload["kept_attention_tier"] = case["kept_tier"]
        if case["kept_tier"] == "nvme":
            offload["nvme_path"] = nvme_dir(out_dir)
    return config


def nvme_dir(out_dir):
    path = os.path.join(out_dir, "nvme")
    os.makedirs(path, exist_ok=True)
    return path


def runs_on(case, world):
    return world in case.get("worlds", (world,))


@contextmanager
def _glm_parts(case):
    """(model builder, reference mode, selections recorded or None) of a GLM case; the recording patch is undone
    on leaving."""
    from glm_models import glm_reference, tiny_glm_moe_dsa

    from ds_longstraw.arch.glm_moe_dsa import GlmMoeDsaAdapter

    if not case.get("record"):
        yield tiny_glm_moe_dsa, glm_reference, None
        return
    record, length = [], case["prompt_len"] - 1
    forward, select = GlmMoeDsaAdapter.attention_forward, GlmMoeDsaAdapter.sparse_selection

    def attention_forward(self, index, module, h, cos, sin, start, past, selection, remote=None, selected=None):
        result = forward(self, index, module, h, cos, sin, start, past, selection, remote, selected)
        if module.indexer is not None:
            record.append(("replay" if start >= length else "prefix", index, start, *result[2]))
        return result

    def sparse_selection(self, index, best, start, tokens):
        result = select(self, index, best, start, tokens)
        record.append(("capture", index, start, *result))
        return result

    GlmMoeDsaAdapter.attention_forward = attention_forward
    GlmMoeDsaAdapter.sparse_selection = sparse_selection
    try:
        yield tiny_glm_moe_dsa, glm_reference, record
    finally:
        GlmMoeDsaAdapter.attention_forward, GlmMoeDsaAdapter.sparse_selection = forward, select


def _run_case(case, world, cp_group, out_dir, rank):
    if case.get("family") == "glm_moe_dsa":
        with _glm_parts(case) as (build, reference, record):
            return _run_model_case(case, world, cp_group, out_dir, rank, build, reference, record)
    from models import float64_model, tiny_qwen3_5

    return _run_model_case(case, world, cp_group, out_dir, rank, tiny_qwen3_5, float64_model, None)


def _run_model_case(case, world, cp_group, out_dir, rank, build, float64_model, record):
    from ds_longstraw import GRPOObjective, grpo_backward
    from ds_longstraw.parallel import CPContext

    dtype = getattr(torch, case.get("dtype", "float64"))
    model = build(dtype=dtype, **case.get("model", {}))
    ref_model = None
    if "ref_seed" in case:
        ref_model = build(dtype=dtype, seed=case["ref_seed"], **case.get("model", {}))
    if "objective_case" in case:  # tests/objective_cases.py: its group (masks, old and sampler log-probs), its settings
        from objective_cases import CASES, objective_group

        group, objective = objective_group(model), GRPOObjective(**CASES[case["objective_case"]][0])
    else:
        group = make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))
        objective = GRPOObjective(**case.get("objective", {}))
    context = CPContext(cp_group, capture_move=case.get("capture_move", "auto"))
    model.zero_grad(set_to_none=True)
    path = os.path.join(out_dir, f"{case['name']}.rank{rank}.pt")
    with float64_model():
        try:
            for _ in range(case.get("repeat", 1)):  # repeat > 1: gradients must accumulate into .grad
                result = grpo_backward(model, group, objective, longstraw=case_config(case, world, out_dir),
                                       ref_model=ref_model, cp_group=context)
        except ValueError as error:  # a case may expect a refusal at the door (recorded, asserted in pytest)
            if not case.get("expect_error"):
                raise
            torch.save({"error": str(error)}, path)
            return
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"grads": grads, "loss": result.loss, "logprobs": result.logprobs,
                "ref_logprobs": result.ref_logprobs, "retained": result.retained_bytes,
                "phases": {k: (v.seconds, v.peak_bytes) for k, v in result.phases.items()},
                "cp": result.extras["cp"], "selections": record}, path)


def worker(rank, world, cases, out_dir, cp_ranks=None):
    """One rank of run_cp (inside fork_ranks' process group)."""
    cp_group, cp_size = None, world
    for ranks in cp_ranks or [list(range(world))]:  # new_group is collective: every rank creates every group
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            cp_group, cp_size = group, len(ranks)
    for case in cases:
        if runs_on(case, cp_size):
            _run_case(case, cp_size, cp_group, out_dir, rank)


def _rank_main(rank, world, port, out_dir, body, args):
    """A forked rank: one intra-op thread, one gloo group of `world` ranks on `port`, body(rank, world, *args), a
    barrier; on failure its traceback goes to out_dir/error.rank<r>.txt and the process exits 1."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        body(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error.rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def fork_ranks(world, body, args, out_dir, timeout=600, what="CP run"):
    """Fork `world` processes, each running body(rank, world, *args) inside one gloo process group (_rank_main);
    wait, kill what outlives `timeout`, and raise with the ranks' tracebacks if any failed."""
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, out_dir, body, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.startswith("error.")]
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{what} on {world} ranks failed (exit codes {[p.exitcode for p in procs]}):\n"
                           + "\n".join(errors))


def run_cp(world, cases, out_dir, timeout=600, cp_ranks=None):
    """Fork `world` ranks, run `cases`, return {case name: [results by global rank]}; raise with the ranks'
    tracebacks. cp_ranks: the CP groups as lists of global ranks (default: one group of all ranks), say
    [[0, 2], [1, 3]] for two CP groups whose group ranks differ from their global ranks."""
    fork_ranks(world, worker, (cases, out_dir, cp_ranks), out_dir, timeout)
    cp_size = len(cp_ranks[0]) if cp_ranks else world
    return {case["name"]: [torch.load(os.path.join(out_dir, f"{case['name']}.rank{r}.pt"), weights_only=False)
                           for r in range(world)] for case in cases if runs_on(case, cp_size)}
