"""Predicted seconds per phase of the context-parallel schedules, for `longstraw plan` (a model, not a measurement).

Each layer kind predicts its own layers' seconds (offload/kind_costs.py: the cost its combine rule carries); a
model's prediction is their sum, scaled to the GPU. What the kinds' figures are made from (one H200, bf16;
BENCHMARKS.md):
  - "GRPO steps of the Qwen3.6-27B layer shape": 4 layers of the 27B (3 Gated DeltaNet + 1 full attention, hidden
    5,120) took 0.97 s at 65,536 and 5.12 s at 262,144 prompt tokens. A fit t(L) = a L + b L^2 through the two
    points gives a (every layer's per-token work, 4 layers) and b (one attention layer's causal attention per L^2).
  - "Gated delta rule": fla's forward over 8,192 tokens of Qwen3.6-27B's GDN heads took 1.05 ms: R per token and
    GDN layer, the recurrence alone.
  - the GDN layer's input projections (q, k, v, z, a, b) are their share of its matmul FLOPs, P = IN_PROJ_SHARE of
    a layer's per-token work (5,120 -> 16,480 of a layer's 5,120 -> 16,480 + 6,144 -> 5,120 + its MLP's
    3 x 5,120 x 17,408).
Scaled to another GPU by the ratio of dense bf16 peaks (`H200_TFLOPS / gpu_tflops`). Per rank, at context L over
N ranks (T = L / N tokens each), with the model's own layer counts:
  capture  linear  a/4 x layers x T                                         (the same in both schedules)
           attention b x attention_layers x L^2 x share: contiguous shards' last rank (2N-1)/N^2, zigzag 1/N
           GDN     before: each layer ran the delta rule three times over (augmented pass + plain pass) and its
                   input projections twice: + (2R + P) x scan_layers x T; one pass: + R x scan_layers x T (the
                   augmented run costs about twice the plain rule)
  prefix   (exact) recompute + backward of the whole prompt, about 3x its forward.
           before: in turns the ranks work one after the other, so it costs what one GPU's pass over L costs (an
           upper bound: within a turn the page owners' share of the attention overlaps the owner's, which this
           leaves out; at CP 2 on CPU that made it 0.5x);
           now: layer-major, every rank at once: 3x a rank's zigzag share, plus per GDN layer the state adjoint's
           summary, a recurrence over [dS | X] of about twice the rule's cost: + 2R x scan_layers x T; with
           prefix_inputs_every k, the recompute of the other layers' inputs: + (k - 1) / k of a rank's forward.

Layers that attend a global top-k selection ("topk_lse", glm_moe_dsa) are modelled from the H200 Triton figures
("The Triton kernels on the H200"): the DSA selection of 1,024 queries over 16K keys (32 indexer heads of 128,
k = 2,048) took 2.2 ms, so Q per (query, key) pair and selecting layer; the sparse absorbed
MLA (64 heads, latent 512 + rope 64, 2,048 rows a query) 16.8 ms forward and 46.2 ms forward + backward for 1,024
queries, so S and S' per query and layer; both scaled linearly to other widths. The dense work (projections, the
experts a token is routed to, norms) is D per active parameter and token: the 27B fit's a / 4 over one Qwen3.6-27B
layer's parameters (its 4 benchmarked layers weigh 7.6 GiB in bf16 with the embeddings and head).
  capture  (D x active + S x layers) x T + Q x selecting layers x the rank's causal pairs: contiguous shards' last
           rank L^2 (2N - 1) / (2 N^2), zigzag L^2 / (2N)
  prefix   (exact) in turns, so the whole prompt's: 3 D x active x L + S' x layers x L + Q x selecting layers x L^2 / 2
           (the selection is recomputed, never differentiated: the indexer takes no gradient); layer-major, every
           rank at once on its zigzag share: 3 D x active x T + S' x layers x T + Q x selecting layers x L^2 / (2N);
           with prefix_inputs_every k, + (k - 1) / k of a rank's zigzag capture (the recompute of the other layers'
           inputs runs the capture's layers again, their selections included)
What it leaves out: communication (the exchanges overlap compute only in part; the experts' all-to-all), the
replay, kernel efficiency at other shapes, and any layer kind without a time model (`predict` returns None where
one of the model's kinds has none).
"""

from dataclasses import dataclass

from ds_longstraw.offload.kind_costs import (  # noqa: F401  (the figures, read here by the planner and its tests)
    ATTENTION_S_PER_L2,
    DENSE_S_PER_PARAM_TOKEN,
    H200_TFLOPS,
    IN_PROJ_SHARE,
    LINEAR_S_PER_TOKEN_LAYER,
    RECURRENCE_S_PER_TOKEN,
    KindSeconds,
    Phases,
)
from ds_longstraw.offload.state_shape import ModelShape


@dataclass(frozen=True)
class PhaseSeconds:
    capture: float
    prefix: float | None  # None: the schedule has no such prefix pass for this family


def predict(shape: ModelShape, context: int, cp: int, gpu_tflops: float, inputs_every: int = 1) -> dict | None:
    """{"before": PhaseSeconds (contiguous shards, two-pass GDN scan, prefix in turns), "now": PhaseSeconds (zigzag,
    one pass, prefix layer-major), "turns_prefix": seconds (the prefix in turns on the zigzag layout)} per rank:
    the sum of the model's layer kinds' seconds (KindCost.seconds), scaled by the GPUs' peaks; None where a kind
    has no time model or the model no layers. inputs_every: the layer-major pass recomputes the inputs of all but
    every inputs_every-th layer, (k - 1) / k of their forward more."""
    if not shape.combine_counts or unmodelled(shape):
        return None
    total = KindSeconds(0.0, 0.0, 0.0, 0.0, 0.0)
    for rule, layers in shape.combine_counts.items():
        total = total + _seconds(shape, rule, Phases(shape, layers, context, cp))
    scale = H200_TFLOPS / gpu_tflops
    layer_major = total.layer_major + (inputs_every - 1) / inputs_every * total.recompute
    return {"before": PhaseSeconds(total.capture_before * scale, total.turns * scale),
            "now": PhaseSeconds(total.capture_now * scale, layer_major * scale), "turns_prefix": total.turns * scale}


def unmodelled(shape: ModelShape) -> list[str]:
    """The combine rules of the model's layers whose kind has no time model."""
    return sorted(rule for rule, layers in shape.combine_counts.items()
                  if _seconds(shape, rule, Phases(shape, layers, 2, 1)) is None)


def _seconds(shape: ModelShape, rule: str, at: Phases) -> KindSeconds | None:
    cost = shape.kind_costs.get(rule)
    return None if cost is None else cost.seconds(at)
