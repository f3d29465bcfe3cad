"""Predicted seconds per phase of the context-parallel schedules, for `longstraw plan` (a model, not a measurement).

What the prediction is made from (one H200, bf16; BENCHMARKS.md):
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

A family whose layers attend a global top-k selection ("topk_lse", glm_moe_dsa) is `predict_sparse`'s, from the
H200 Triton figures ("The Triton kernels on the H200"): the DSA selection of 1,024 queries over 16K keys (32
indexer heads of 128, k = 2,048) took 2.2 ms, so Q per (query, key) pair and selecting layer; the sparse absorbed
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
replay, kernel efficiency at other shapes, and any other family (`predict` returns None without both attention
and Gated DeltaNet layers, `predict_sparse` without selecting layers).
"""

from dataclasses import dataclass

H200_TFLOPS = 989.0
# The fit through BENCHMARKS.md's two H200 points (t(65,536) = 0.97 s, t(262,144) = 5.12 s, 4 layers)
_L1, _T1, _L2, _T2 = 65536, 0.97, 262144, 5.12
ATTENTION_S_PER_L2 = (_T2 - _T1 * _L2 / _L1) / (_L2 * _L2 - _L1 * _L2)  # b
LINEAR_S_PER_TOKEN_LAYER = (_T1 - ATTENTION_S_PER_L2 * _L1 * _L1) / _L1 / 4  # a / 4
RECURRENCE_S_PER_TOKEN = 1.05e-3 / 8192  # R: fla's forward, Qwen3.6-27B's 48 value heads
IN_PROJ_SHARE = 16480 / (16480 + 5120 + 3 * 17408)  # P / (a / 4)


# The sparse family's figures (see the module docstring)
SELECT_S_PER_PAIR = 2.2e-3 / (1024 * 16384)  # Q, at SELECT_WIDTH
SELECT_WIDTH = 32 * 128  # indexer heads x indexer head dim
SPARSE_S_PER_QUERY = 16.8e-3 / 1024  # S, at SPARSE_WIDTH
SPARSE_BACKWARD_S_PER_QUERY = 46.2e-3 / 1024  # S' (forward + backward), at SPARSE_WIDTH
SPARSE_WIDTH = 64 * (512 + 64) * 2048  # heads x (latent + rope) x rows a query
QWEN_LAYER_PARAMS = (7.6 * 2**30 / 2 - 2 * 248320 * 5120) / 4  # one Qwen3.6-27B layer of the benchmarked four
DENSE_S_PER_PARAM_TOKEN = LINEAR_S_PER_TOKEN_LAYER / QWEN_LAYER_PARAMS  # D


@dataclass(frozen=True)
class PhaseSeconds:
    capture: float
    prefix: float | None  # None: the schedule has no such prefix pass for this family


def predict(layers: int, attention_layers: int, scan_layers: int, context: int, cp: int, gpu_tflops: float,
            inputs_every: int = 1) -> dict:
    """{"before": PhaseSeconds (contiguous shards, two-pass GDN scan, prefix in turns), "now": PhaseSeconds (zigzag,
    one pass, prefix layer-major), "turns_prefix": seconds (the prefix in turns on the zigzag layout)} per rank.
    attention_layers: the layers that combine across ranks by "lse" (full attention), scan_layers: by "affine_scan"
    (Gated DeltaNet); None without both (a family this model does not describe). inputs_every: the layer-major
    pass recomputes the inputs of all but every inputs_every-th layer, (k - 1) / k of a forward more."""
    if not attention_layers or not scan_layers:
        return None
    scale = H200_TFLOPS / gpu_tflops
    tokens = context / cp
    linear = LINEAR_S_PER_TOKEN_LAYER * layers * tokens
    attention = ATTENTION_S_PER_L2 * attention_layers * context * context
    projections = IN_PROJ_SHARE * LINEAR_S_PER_TOKEN_LAYER
    scan = scan_layers * tokens
    before = linear + attention * (2 * cp - 1) / cp ** 2 + (2 * RECURRENCE_S_PER_TOKEN + projections) * scan
    now = linear + attention / cp + RECURRENCE_S_PER_TOKEN * scan
    turns = 3 * (LINEAR_S_PER_TOKEN_LAYER * layers * context + attention)
    recompute = (inputs_every - 1) / inputs_every * (linear + attention / cp)
    layer_major = 3 * (linear + attention / cp) + 2 * RECURRENCE_S_PER_TOKEN * scan + recompute
    return {"before": PhaseSeconds(before * scale, turns * scale), "now": PhaseSeconds(now * scale,
                                                                                       layer_major * scale),
            "turns_prefix": turns * scale}


def predict_sparse(layers: int, select_layers: int, active_params: float, context: int, cp: int, gpu_tflops: float,
                   select_width: int, sparse_width: int, inputs_every: int = 1) -> dict:
    """{"before": PhaseSeconds (contiguous shards, prefix in turns), "now": PhaseSeconds (zigzag, prefix
    layer-major), "turns_prefix": seconds} per rank for a family whose `layers` attend a global top-k selection
    that `select_layers` of them make (None without any). active_params: the dense parameters a prompt token runs
    through (the routed experts at k of their count; no embeddings or head); select_width: indexer heads x head
    dim; sparse_width: heads x (latent + rope) x rows a query; inputs_every: the layer-major pass recomputes the
    inputs of all but every inputs_every-th layer, (k - 1) / k of a capture more."""
    if not select_layers:
        return None
    scale = H200_TFLOPS / gpu_tflops
    tokens = context / cp
    dense = DENSE_S_PER_PARAM_TOKEN * active_params
    pair = SELECT_S_PER_PAIR * select_width / SELECT_WIDTH * select_layers
    width = sparse_width / SPARSE_WIDTH * layers
    per_token = (dense + SPARSE_S_PER_QUERY * width) * tokens
    before = per_token + pair * context * context * (2 * cp - 1) / (2 * cp * cp)
    now = per_token + pair * context * context / (2 * cp)
    turns = 3 * dense * context + SPARSE_BACKWARD_S_PER_QUERY * width * context + pair * context * context / 2
    recompute = (inputs_every - 1) / inputs_every * now
    layer_major = ((3 * dense + SPARSE_BACKWARD_S_PER_QUERY * width) * tokens + pair * context * context / (2 * cp)
                   + recompute)
    return {"before": PhaseSeconds(before * scale, turns * scale), "now": PhaseSeconds(now * scale,
                                                                                       layer_major * scale),
            "turns_prefix": turns * scale}
