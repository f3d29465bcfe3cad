"""Expert parallelism for GLM-5.2's MoE (ds_longstraw.shard_experts, "ep_size", parallel/experts.py) on 2 and 4
gloo ranks, against single-process float64 grpo_backward on the unsharded model (itself proven against
transformers' own model in test_glm.py), under glm_reference() (float64 router and norms, canonical top-k).

  EP on the CP group   (layout "cp": one prompt sharded over the ranks, ep_size = cp_size): every rank's
                        gradients equal the unsharded model's, the experts' for the rank's slice
  EP over "DP" ranks   (layout "dp": each rank its own group of a different shape, cp_size 1): rank r's non-expert
                        gradients equal group r's; its experts' equal the sum over every rank's group, sliced
Both gradient modes, the host tier, KL to a separate (unsharded) reference model, and (2 ranks) the objective's
options on tests/objective_cases.py's groups (tool masks, an all-masked member, old and sampler log-probs): entropy
bonus, a dual clip that bites, low_var_kl, rollout correction with the Dr. GRPO sum-norm. Tolerance: relative L2 <= 1e-8
(the contract's); both sides compute the same float64 functions, the dispatch summing a token's k expert outputs
in another order than the model's expert loop: measured ~1e-16. A pair sent to the wrong expert, a lost pair, or
a gradient missing its other ranks' tokens is off by 1e-2 or more.
"""

import os

import pytest
import torch
from cp_scripts.expert_ranks import EP_MODEL, run_ep
from glm_models import tiny_glm_moe_dsa
from grads import relative_l2

from ds_longstraw import GRPOGroup, grpo_backward, shard_experts
from ds_longstraw.arch.glm_moe_dsa_experts import moe_blocks, moe_forward_reference
from ds_longstraw.parallel.experts import dispatch_reference

TOL = 1e-8
WORLDS = [2, 4]

CASES = [
    # prompt[:-1] = 44 tokens over 2 / 4 ranks, chunks of 5, pages of 4
    dict(name="cp-detached", layout="cp", prompt_len=45, response_lens=[5, 3, 4], mode="detached", chunk=5, page=4,
         block=3),
    dict(name="cp-exact", layout="cp", prompt_len=45, response_lens=[5, 3, 4], mode="exact", chunk=5, page=4,
         block=3, seed=1),
    dict(name="cp-exact-host-kl", layout="cp", prompt_len=41, response_lens=[4, 2], mode="exact", chunk=7, page=3,
         block=2, tier="cpu", kl=9, seed=2, worlds=(2,)),
    # each rank its own group: prompts, member counts and response lengths differ (the ranks pad to a common shape)
    dict(name="dp-detached", layout="dp", groups=[(30, [4, 6]), (43, [2, 1, 7]), (25, [3]), (38, [5, 5])],
         mode="detached", chunk=8, page=4, block=3, seed=3),
    dict(name="dp-exact", layout="dp", groups=[(30, [4, 6]), (43, [2, 1, 7]), (25, [3]), (38, [5, 5])],
         mode="exact", chunk=8, page=4, block=3, seed=4),
    # objective options on tests/objective_cases.py's objective_group (prompt 21, responses 6, 9, 4, 10): at these
    # seeds clip_ratio_c 1.5 bites (ratios above it on negative advantages: 2 tokens; 2 + 1 over the two groups)
    dict(name="cp-exact-objective", layout="cp", mode="exact", chunk=5, page=4, block=3, kl=9, seed=8,
         objective_group=True, worlds=(2,),
         objective=dict(clip_ratio_c=1.5, kl_coef=0.05, kl_estimator="low_var_kl", entropy_coef=0.02,
                        loss_agg="seq-mean-token-mean")),
    dict(name="dp-detached-objective", layout="dp", mode="detached", chunk=6, page=4, block=3, seed=6,
         objective_group=True, worlds=(2,),
         objective=dict(clip_ratio_c=1.5, entropy_coef=0.05, loss_agg="seq-mean-token-sum-norm", norm_length=10,
                        rollout_correction="sequence_mask", rollout_correction_max=2.0)),
]
for case in CASES:  # a "dp" case gives one group per rank
    if case["layout"] == "dp":
        case.setdefault("worlds", (2, 4))

OUT_DIRS = {}


@pytest.fixture(scope="module", params=WORLDS)
def results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"ep{world}")
    OUT_DIRS[world] = str(out)
    cases = [dict(c, groups=c["groups"][:world]) if "groups" in c else c for c in CASES]
    return world, run_ep(world, cases, str(out))


def _cases(world):
    return [c["name"] for c in CASES if world in c.get("worlds", (world,))]


@pytest.mark.slow
def test_gradients_equal_the_unsharded_model(results):
    world, runs = results
    for name in _cases(world):
        for rank, run in enumerate(runs[name]):
            rel = relative_l2(run["grads"], run["expected"])
            assert rel <= TOL, (name, rank, rel)
            # the rank really holds a slice: its fused expert parameters are n / E experts long
            lo, hi = run["experts"]
            assert (lo, hi) == (rank * 8 // world, (rank + 1) * 8 // world)
            shapes = [shape for n, shape in run["shapes"].items() if n.endswith("experts.gate_up_proj")]
            assert shapes and all(shape[0] == 8 // world for shape in shapes)
            # an expert slice with a gradient at all (detached and exact both route tokens to every rank here)
            assert any(n.endswith("experts.down_proj") and g.abs().max() > 0 for n, g in run["grads"].items())


@pytest.mark.slow
def test_load_report_counts_every_routed_pair(results):
    """Pairs received over the EP group == pairs routed over it (no pair dropped), and the imbalance is
    max / mean of the received pairs."""
    world, runs = results
    for name in _cases(world):
        reports = [run["ep"] for run in runs[name]]
        received = reports[0]["pairs_received_per_rank"]
        assert all(r["pairs_received_per_rank"] == received for r in reports)
        assert sum(received) == sum(r["pairs_routed"] for r in reports)
        assert [r["pairs_received"] for r in reports] == received
        assert reports[0]["load_imbalance"] == pytest.approx(max(received) / (sum(received) / world))
        assert len({r["dispatches"] for r in reports}) == 1  # the same number of dispatches on every rank
        assert all(r["bytes_sent"] > 0 for r in reports)


@pytest.mark.slow
def test_cp_ranks_agree(results):
    """Under EP on the CP group every rank's non-expert gradients are identical (the CP all-reduce skips the
    experts, which are complete on their owners)."""
    world, runs = results
    for name in [n for n in _cases(world) if n.startswith("cp")]:
        first = runs[name][0]["grads"]
        for run in runs[name][1:]:
            for n, g in run["grads"].items():
                if "experts.gate_up_proj" not in n and "experts.down_proj" not in n:
                    assert torch.equal(g, first[n]), (name, n)


# -- single process ----------------------------------------------------------------------------------------------
def test_dispatch_reference_equals_the_model_block():
    """The plain per-expert loop (dispatch_reference) beside transformers' own MoE block, float64."""
    from glm_models import glm_reference

    model = tiny_glm_moe_dsa(**EP_MODEL)
    block = moe_blocks(model)[0]
    hidden = torch.randn(1, 9, model.config.hidden_size, dtype=torch.float64)
    with glm_reference():
        ours, theirs = moe_forward_reference(block, hidden), block(hidden)
    assert (ours - theirs).norm() / theirs.norm() < 1e-14
    assert dispatch_reference is not None


def test_shard_experts_errors():
    with pytest.raises(ValueError, match="no routed experts"):
        from models import tiny_qwen3_5

        shard_experts(tiny_qwen3_5(), object())


def test_ep_settings_are_checked_at_the_door():
    model = tiny_glm_moe_dsa(**EP_MODEL)
    group = GRPOGroup(torch.arange(12) % 90, [torch.arange(3)], advantages=[1.0])
    with pytest.raises(ValueError, match="'longstraw.ep_size' = 2 needs ep_group"):
        grpo_backward(model, group, longstraw={"ep_size": 2})
    with pytest.raises(ValueError, match="experts are whole"):
        grpo_backward(model, group, longstraw={"ep_size": 2}, ep_group=object())
    with pytest.raises(ValueError, match="ep_group was given"):
        grpo_backward(model, group, ep_group=object())
    with pytest.raises(ValueError, match="'longstraw.ep_size' = 2 with 'cp_size' = 4"):
        grpo_backward(model, group, longstraw={"ep_size": 2, "cp_size": 4})


@pytest.mark.slow
def test_experts_that_the_group_does_not_divide_are_refused(results):
    world, _ = results
    for rank in range(world):
        with open(os.path.join(OUT_DIRS[world], f"indivisible.rank{rank}.txt")) as handle:
            message = handle.read()
        if world == 4:
            assert message.startswith("6 routed experts cannot be split evenly over an EP group of 4 ranks"), message
        else:
            assert message == f"sharded: range({3 * rank}, {3 * rank + 3})"


@pytest.mark.slow
def test_no_stray_files(results):
    world, _ = results
    assert not [f for f in os.listdir(OUT_DIRS[world]) if f.startswith("error.")]


def test_generate_with_sharded_experts_decodes_in_lockstep(results):
    """generate on the sharded model (no dp_group: the ranks decode in lockstep over the EP group), each rank its own
    prompt and sample count, eos stopping samples at different steps, batched and one at a time; and one prompt
    sharded over the same ranks (CP = EP): the same tokens as the unsharded model's generate, log-probs to float64
    rounding (the dispatch sums each token's experts in another order)."""
    world, _ = results
    ranks = [torch.load(os.path.join(OUT_DIRS[world], f"generate.rank{r}.pt")) for r in range(world)]
    for rank, record in enumerate(ranks):
        for name, got in record.items():
            assert got["ids"] == got["ref_ids"], (rank, name, got)
            assert got["logprob_diff"] < TOL, (rank, name, got)
        assert len(record["dp-batched"]["ids"]) == 3 - rank % 2
    lengths = {len(ids) for record in ranks for got in record.values() for ids in got["ids"]}
    assert min(lengths) < 6 and max(lengths) > 1, lengths  # eos ended samples at different steps
    assert all(record["cp"]["ids"] == ranks[0]["cp"]["ids"] for record in ranks)
