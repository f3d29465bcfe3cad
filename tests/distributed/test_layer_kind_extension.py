"""A new layer kind is one folder: a kind registered from this file, no file of the package touched, runs under
CP 2 in float64 and equals full-sequence autograd.

The kind, "counted_lse", is attention with its calls counted: its rule registered in arch/specs.COMBINE_RULES with
attention's cost (offload/kind_costs.AttentionCost: the bytes the planner and the "auto" rules weigh), its
adapter contract (arch/contract.KIND_CONTRACTS) the attention layers', its cross-rank code AttentionKind's with every
call written to a log per rank. The qwen3_5 family's attention layers are declared with it (a family entry whose
specs say "counted_lse"), so capture, replay, the layer-major prefix pass and the turns' page server can only run
these layers through the registry: the log proves each phase asked the kind, the gradients that its math is whole.
Registration happens in the forked ranks alone, so this process's registries stay as they were.

Tolerance: relative L2 <= 1e-8 over all parameter gradients, as test_cp_transaction.py (CP changes only the
association order of float64 sums, ~1e-10; a lost dq share or a missing dK/dV shows at 1e-3).
"""

import dataclasses
import os

import pytest
import torch
from cp_scripts.harness import fork_ranks, make_group, worker
from grads import relative_l2
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOObjective

COUNTED = "counted_lse"
TOL = 1e-8
MODEL = dict(layers=5, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                                    "linear_attention"])
CASES = [
    # layer-major prefix pass; every 3rd layer's input kept: the kind forwards layers 1 and 3 to recompute 2's and 4's
    dict(name="kind-layer-major", prompt_len=23, response_lens=[5, 3], mode="exact", chunk=4, page=3, block=3,
         prefix="layer_major", inputs_every=3, model=MODEL),
    # the turns (the kind answers the page requests) with each rank replaying its own members (its spread view)
    dict(name="kind-turns-spread", prompt_len=21, response_lens=[4, 2, 3], mode="exact", chunk=5, page=4, block=2,
         prefix="turns", cp_replay="spread", seed=3, model=MODEL),
]


def _register_counted_kind(log_dir, rank):
    """In a forked rank: the counted kind, its rule and contract, and qwen3_5's attention layers declared with it."""
    from ds_longstraw.arch import FAMILIES, Qwen35Adapter
    from ds_longstraw.arch.contract import KIND_CONTRACTS, DenseAttentionLayers
    from ds_longstraw.arch.specs import CombineRule, register_combine_rule
    from ds_longstraw.grpo.cp.kinds import register_kind
    from ds_longstraw.grpo.cp.kinds.attention import AttentionKind
    from ds_longstraw.offload.kind_costs import AttentionCost

    log = os.path.join(log_dir, f"kind.rank{rank}.txt")

    def counted(method):
        def call(self, *args, **kwargs):
            spec = next((a for a in args if hasattr(a, "combine")), None)
            layer = spec.layer if spec is not None else getattr(args[-1], "layer", "-")
            with open(log, "a") as handle:
                handle.write(f"{method} {layer}\n")
            return getattr(AttentionKind, method)(self, *args, **kwargs)
        return call

    methods = ("capture", "forward", "backward", "answer", "replay_pages")
    Counted = type("CountedAttentionKind", (AttentionKind,),
                   {"name": COUNTED, **{method: counted(method) for method in methods}})
    register_combine_rule(CombineRule(COUNTED, cost=AttentionCost()))
    KIND_CONTRACTS[COUNTED] = DenseAttentionLayers
    register_kind(Counted())

    def counted_specs(specs):
        return [dataclasses.replace(s, combine=COUNTED) if s.combine == "lse" else s for s in specs]

    class CountedAdapter(Qwen35Adapter):
        def __init__(self, model):
            super().__init__(model)
            self.specs = counted_specs(self.specs)

    family = FAMILIES["qwen3_5_text"]
    counted_family = dataclasses.replace(family, adapter=CountedAdapter,
                                         state_specs=lambda config, dtype: counted_specs(family.state_specs(config,
                                                                                                            dtype)))
    for model_type in family.model_types:
        FAMILIES[model_type] = counted_family


def _rank(rank, world, cases, out_dir):
    _register_counted_kind(out_dir, rank)
    worker(rank, world, cases, out_dir)


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("layer_kind"))
    fork_ranks(2, _rank, (CASES, out_dir), out_dir, what="the counted layer kind")
    return out_dir


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_a_kind_registered_from_a_test_equals_full_sequence_autograd(ranks_out, case):
    model = tiny_qwen3_5(**MODEL)
    group = make_group(case["prompt_len"], case["response_lens"], seed=case.get("seed", 0))
    with float64_model():
        ref_grads, (ref_loss, _, _) = reference_step(model, group, GRPOObjective().group_loss,
                                                     full_sequence_logprobs)
    for rank in range(2):
        result = torch.load(os.path.join(ranks_out, f"{case['name']}.rank{rank}.pt"))
        error = relative_l2(result["grads"], ref_grads)
        assert error <= TOL, f"rank {rank}: relative L2 {error:.3e}"
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)


def test_every_phase_asked_the_registered_kind(ranks_out):
    """Capture, the layer-major pass's backward and forward (recomputed inputs), the turns' page answers and the
    replay's view all went through the counted kind, on both ranks, at the attention layers (1 and 3) only."""
    for rank in range(2):
        with open(os.path.join(ranks_out, f"kind.rank{rank}.txt")) as handle:
            calls = [line.split() for line in handle]
        phases = {method for method, _ in calls}
        assert phases == {"capture", "forward", "backward", "answer", "replay_pages"}, (rank, phases)
        layers = {layer for method, layer in calls if method in ("capture", "forward", "backward", "answer")}
        assert layers == {"1", "3"}, (rank, layers)
