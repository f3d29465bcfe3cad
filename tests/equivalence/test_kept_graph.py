"""Exact mode's capture that keeps its graph (longstraw.prefix_keep_graph), against full-sequence autograd.

Equivalence chain (float64 tiny models of both families, transformers computing in float64):
  grpo_backward(exact, the capture's graph kept whole, the probe only, part of it, or none)
      == transformers' full-sequence autograd of prompt + response for every member
Tolerance: relative L2 <= 1e-8 over all parameter gradients (the contract's, as in test_transaction.py and
test_glm.py): the two sides differ only in the order of float64 sums (~1e-15); a gradient counted twice at the seam
of the kept and the recomputed segments (on the gradient pages and through the graph), or lost there, shows up at
1e-3 or worse.
Also proven: the budget bounds what is kept; a later segment is never charged less than it saves (what makes
counting only the first segments sound); where no graph may be kept (detached mode, False, a zero budget, a shared
document's groups) none is; with the whole graph kept the step's matrix products are full autograd's less the last
layer's over the prompt (counted op by op, not timed).
"""

import pytest
import torch
from glm_models import VOCAB, glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.arch import adapter_for
from ds_longstraw.config import parse_config
from ds_longstraw.grpo import kept_graph
from ds_longstraw.grpo.state import capture_prefix

TOL = 1e-8
GIB = 1 << 30

FAMILIES = {
    # family: (model builder, the reference's context, prompt length, response lengths, settings)
    "qwen3_5": (tiny_qwen3_5, float64_model, 37, [6, 4, 9],
                {"capture_chunk": 7, "page_tokens": 5, "replay_block": 4}),
    "glm_moe_dsa": (tiny_glm_moe_dsa, glm_reference, 47, [5, 3, 7],
                    {"capture_chunk": 9, "page_tokens": 6, "replay_block": 4}),
}


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    """A probe of 4 tokens, so that these short prompts have a probe, whole segments and a rest."""
    monkeypatch.setattr(kept_graph, "PROBE_TOKENS", 4)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    build, reference, prompt, responses, settings = FAMILIES[request.param]
    return request.param, build(), reference, _group(prompt, responses), settings


def _group(prompt_len, response_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in response_lens]
    return GRPOGroup(prompt, responses, rewards=torch.rand(len(responses), generator=gen).tolist())


def _step(model, group, settings, objective=None, ref_model=None, backward=None):
    config = {"prefix_grad": "exact", "prefix_keep_graph": "fits", **settings}
    return grads_of(model, lambda: grpo_backward(model, group, objective or GRPOObjective(), longstraw=config,
                                                 ref_model=ref_model, backward=backward))


def _whole_graph_bytes(model, group, settings):
    """What the whole prompt's graph saves, as the kept graph counts it."""
    _, result = _step(model, group, {**settings, "prefix_keep_graph": True})
    return result.extras["kept_graph_bytes"]


def _assert_exact(model, reference, group, settings, objective=None, ref_model=None, backward=None):
    objective = objective or GRPOObjective()
    with reference():
        ref_grads, (ref_loss, ref_logps, _) = reference_step(model, group, objective.group_loss,
                                                             full_sequence_logprobs, ref_model)
        grads, result = _step(model, group, settings, objective, ref_model, backward)
    error = relative_l2(grads, ref_grads)
    assert error <= TOL, error
    assert set(grads) == set(ref_grads)
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    for mine, ref in zip(result.logprobs, ref_logps, strict=True):
        torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    return result


@pytest.mark.parametrize("kept", ["whole", "fits", "probe", "part"])
def test_kept_graph_matches_full_sequence_autograd(family, kept):
    """The kept graph whole (True, and "fits" where the prompt fits), the probe alone (a budget below it) and part
    of it (half the whole graph's bytes): the rest is captured without a graph and recomputed."""
    _, model, reference, group, settings = family
    captured = group.prompt_ids.numel() - 1
    if kept == "whole":
        settings = {**settings, "prefix_keep_graph": True}
    elif kept == "probe":
        settings = {**settings, "prefix_graph_budget_gb": 1 / GIB}
    elif kept == "part":
        settings = {**settings, "prefix_graph_budget_gb": _whole_graph_bytes(model, group, settings) / 2 / GIB}
    result = _assert_exact(model, reference, group, settings)
    tokens = result.extras["kept_graph_tokens"]
    if kept in ("whole", "fits"):
        assert tokens == captured
    elif kept == "probe":
        assert tokens == 4
    else:
        assert 4 < tokens < captured
        assert result.extras["kept_graph_bytes"] <= settings["prefix_graph_budget_gb"] * GIB


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_part_kept_on_tiers_with_the_kept_attention(family, tier, tmp_path):
    """Part of the graph kept with the pages, their gradient pages and the kept attention (glm_moe_dsa's selections
    by default; qwen3_5's outputs and LSE asked for) on the host or in NVMe files: the kept attention's pages start
    where the kept graph ends. No page file is left behind."""
    name, model, reference, group, settings = family
    if name == "qwen3_5":  # an attention layer before the last, whose attention one rank keeps (its last layer's
        # capture runs for the rows alone: test_last_layer_rows.py)
        model = tiny_qwen3_5(layer_types=["linear_attention", "full_attention"] * 2)
    offload = ({"tier": "cpu"} if tier == "cpu" else
               {"tier": "nvme", "nvme_path": str(tmp_path), "aio": {"block_size": 4096, "queue_depth": 4}})
    budget = _whole_graph_bytes(model, group, settings) / 3 / GIB
    settings = {**settings, "prefix_keep_attention": True, "prefix_graph_budget_gb": budget, "offload": offload}
    if tier == "nvme":
        from ds_longstraw.offload import io_engine

        try:
            io_engine.load_aio()
        except RuntimeError as error:
            pytest.skip(f"DeepSpeed's aio op cannot be built here: {error}")
    result = _assert_exact(model, reference, group, settings)
    assert 4 < result.extras["kept_graph_tokens"] < group.prompt_ids.numel() - 1
    assert result.retained_bytes["kept_attention_pages"] > 0
    assert list(tmp_path.iterdir()) == []


def test_kl_with_the_graph_kept_in_part(family):
    """kl_coef > 0: the reference's capture keeps no graph (detached), the policy's keeps part of one."""
    name, model, reference, group, settings = family
    ref_model = tiny_qwen3_5(seed=7) if name == "qwen3_5" else tiny_glm_moe_dsa(seed=7)
    budget = _whole_graph_bytes(model, group, settings) / 2 / GIB
    result = _assert_exact(model, reference, group, {**settings, "prefix_graph_budget_gb": budget},
                           GRPOObjective(kl_coef=0.3), ref_model)
    assert 4 < result.extras["kept_graph_tokens"] < group.prompt_ids.numel() - 1
    assert not any(p.grad is not None for p in ref_model.parameters())


def test_under_a_callers_backward(family):
    """A caller that back-propagates itself (the DeepSpeed engine passes engine.backward) gets each member's loss
    share, one surrogate per recomputed segment and ONE for the whole kept graph."""
    _, model, reference, group, settings = family
    budget = _whole_graph_bytes(model, group, settings) / 2 / GIB
    scalars = []

    def backward(scalar):
        scalars.append(1)
        scalar.backward()

    result = _assert_exact(model, reference, group, {**settings, "prefix_graph_budget_gb": budget},
                           backward=backward)
    captured, kept = group.prompt_ids.numel() - 1, result.extras["kept_graph_tokens"]
    recomputed = -(-(captured - kept) // settings["capture_chunk"])
    assert len(scalars) == group.size + recomputed + 1


def test_the_whole_graph_kept_runs_full_autograds_products_less_the_last_layer(family, monkeypatch):
    """With the whole prompt's graph kept the exact step runs full autograd's matrix products less the last layer's
    over the prompt, and nothing more: the prompt's forward once (in capture, with its graph), none of it again in
    the prefix pass, the last layer for its rows alone (no token reads its outputs over the prompt); against
    tools/baselines.conventional (one prompt forward with autograd shared by the members, one backward) through the
    same layer kernels. Counted by torch's FlopCounterMode, op by op: deterministic, where CPU seconds vary by
    10-30% between rounds on this machine (BENCHMARKS.md, issue 46). With that last layer run whole the two counts
    are equal op for op, so the strict bound fails there. One capture segment and one replay block per member, and
    a probe as long, so that both schedules cut the prompt and the responses alike (a kernel's work per call is not
    linear at these lengths: the GDN kernel pads a call to whole chunks). The default (each segment's forward again
    in the prefix pass, then each layer once more in its backward) counts above conventional's."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_longstraw.tools.baselines import conventional

    _, model, _, group, settings = family
    whole = {**settings, "capture_chunk": 64, "replay_block": 16}
    monkeypatch.setattr(kept_graph, "PROBE_TOKENS", 64)
    assert group.prompt_ids.numel() <= 64 and max(r.numel() for r in group.response_ids) <= 16

    def products(step):
        with FlopCounterMode(display=False) as counter:
            step()
        model.zero_grad(set_to_none=True)
        return {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}

    full = products(lambda: conventional(model, group, GRPOObjective(), longstraw=whole))
    kept = products(lambda: grpo_backward(model, group, GRPOObjective(),
                                          longstraw={**whole, "prefix_grad": "exact", "prefix_keep_graph": True}))
    default = products(lambda: grpo_backward(model, group, GRPOObjective(),
                                             longstraw={**whole, "prefix_grad": "exact"}))
    assert set(kept) == set(full) and all(kept[op] <= full[op] for op in full), (kept, full)
    assert 0 < sum(kept.values()) < sum(full.values()), (kept, full)
    assert sum(default.values()) > sum(full.values()), (default, full)


def test_later_segments_are_never_charged_less_than_they_save(family, monkeypatch):
    """The hooks count segments until the bytes per token are steady, then charge the largest figure: counted on
    every segment (STEADY < 0 never settles), no later segment saves more than it was charged. The figures
    settle: a token's past is counted once, not again per later segment."""
    _, model, _, _, settings = family
    group = _group(90, [3])
    config = parse_config({"prefix_grad": "exact", **settings})
    adapter = adapter_for(model)

    def segments():
        state = capture_prefix(adapter, group.prompt_ids, config, "exact", graph_budget=None)
        try:
            return [(s.end - s.start, s.saved_bytes, s.measured) for s in state.kept_graph.segments]
        finally:
            state.release()

    charged = segments()
    monkeypatch.setattr(kept_graph, "STEADY", -1.0)
    measured = segments()
    assert [t for t, _, _ in charged] == [t for t, _, _ in measured]
    assert all(m for _, _, m in measured)
    settled = [index for index, (_, _, m) in enumerate(charged) if not m]
    assert settled and len(settled) < len(charged) - 2, "the rule measures a few segments, then charges"
    for index in settled:
        assert charged[index][1] >= measured[index][1], (index, charged[index], measured[index])
    # the steady figure is close: charging is not a gross overestimate either
    for index in settled:
        assert charged[index][1] <= 1.1 * measured[index][1]


def test_no_graph_kept_where_none_may_be(family):
    """Detached mode, exact mode's default (prefix_keep_graph False) and a zero budget capture without a graph, and
    say none was kept."""
    _, model, _, group, settings = family
    for mode, extra in [("detached", {}), ("exact", {}), ("exact", {"prefix_keep_graph": False}),
                        ("exact", {"prefix_keep_graph": "fits", "prefix_graph_budget_gb": 0})]:
        result = grpo_backward(model, group, GRPOObjective(), longstraw={"prefix_grad": mode, **settings, **extra})
        assert "kept_graph_tokens" not in result.extras, (mode, extra)
        model.zero_grad(set_to_none=True)


def test_a_padding_lockstep_keeps_no_graph(family):
    """Under a lockstep that pads this rank's module calls to other ranks' (ZeRO-3 data parallelism) a kept graph
    would change which segments the prefix pass runs, so "fits" keeps none there; the step is still exact."""
    from ds_longstraw.grpo.lockstep import GroupCalls, Lockstep, calls_of

    _, model, reference, group, settings = family
    config = parse_config({"prefix_grad": "exact", "prefix_keep_graph": "fits", **settings})
    calls = calls_of(group, config)
    lockstep = Lockstep(calls, GroupCalls(chunks=calls.chunks + 1, blocks=calls.blocks), config)
    with reference():
        ref_grads, _ = reference_step(model, group, GRPOObjective().group_loss, full_sequence_logprobs)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, GRPOObjective(), longstraw=config,
                                                              lockstep=lockstep))
    assert "kept_graph_tokens" not in result.extras
    assert relative_l2(grads, ref_grads) <= TOL


def test_a_shared_document_keeps_no_graph(family):
    """Groups sharing a document capture it once as a tree's root and themselves as its children: neither keeps a
    graph (a child's past is its parent's pages), and the gradients stay exact (test_shared_document.py)."""
    _, model, _, group, settings = family
    from ds_longstraw.grpo.shared import grpo_backward_shared

    other = GRPOGroup(torch.cat([group.prompt_ids[:30], group.prompt_ids[5:12]]), group.response_ids,
                      rewards=[0.3, 0.9, 0.1])
    results = grpo_backward_shared(model, [group, other], GRPOObjective(),
                                   longstraw={"prefix_grad": "exact", "prefix_keep_graph": "fits", **settings,
                                              "shared_prefix_min": 8})
    model.zero_grad(set_to_none=True)
    assert all("document" in result.extras for result in results), "the tree path ran"
    assert all("kept_graph_tokens" not in result.extras for result in results)


def test_a_child_capture_refuses_a_graph(family):
    _, model, _, group, settings = family
    config = parse_config({"prefix_grad": "exact", **settings})
    adapter = adapter_for(model)
    root = capture_prefix(adapter, group.prompt_ids[:20], config, "exact")
    try:
        with pytest.raises(ValueError, match="root capture"):
            capture_prefix(adapter, group.prompt_ids[19:], config, "exact", parent=root, graph_budget=None)
    finally:
        root.release()
