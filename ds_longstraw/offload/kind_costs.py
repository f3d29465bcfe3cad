"""What one layer kind costs under context parallelism: its bytes for the planner and its seconds for cp_time.

A combine rule (arch/specs.CombineRule) carries its cost; the model's shape (models/model_shape.py) carries the
costs of the rules its layers use (ModelShape.kind_costs), so the planner (offload/plan.py, offload/auto.py) and the
time model (tools/cp_time.py) loop over a model's kinds and ask each, naming none:

  layer_major_held    bytes per token the layer-major prefix pass holds on the device across one layer of the kind
                      (beside d(output) and d(input), which every layer holds)
  capture_workspace   what the kind's capture holds on the device across its cross-rank exchange, by label
  seconds             one H200's seconds per rank for the kind's layers in each phase (KindSeconds)

The built-in kinds: AttentionCost ("lse"), ScanCost ("affine_scan"), SparseCost ("topk_lse"). A new kind gives its
rule one of these (say a sliding-window layer: attention's bytes) or its own subclass.

The seconds are one H200's in bf16, fitted to BENCHMARKS.md's figures: tools/cp_time.py's docstring says which
figures and the whole model, term by term; the constants below are those figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_longstraw.offload.state_shape import ModelShape

H200_TFLOPS = 989.0
# The fit through BENCHMARKS.md's two H200 points (t(65,536) = 0.97 s, t(262,144) = 5.12 s, 4 layers)
_L1, _T1, _L2, _T2 = 65536, 0.97, 262144, 5.12
ATTENTION_S_PER_L2 = (_T2 - _T1 * _L2 / _L1) / (_L2 * _L2 - _L1 * _L2)  # b
LINEAR_S_PER_TOKEN_LAYER = (_T1 - ATTENTION_S_PER_L2 * _L1 * _L1) / _L1 / 4  # a / 4
RECURRENCE_S_PER_TOKEN = 1.05e-3 / 8192  # R: fla's forward, Qwen3.6-27B's 48 value heads
IN_PROJ_SHARE = 16480 / (16480 + 5120 + 3 * 17408)  # P / (a / 4)

SELECT_S_PER_PAIR = 2.2e-3 / (1024 * 16384)  # Q, at SELECT_WIDTH
SELECT_WIDTH = 32 * 128  # indexer heads x indexer head dim
SPARSE_S_PER_QUERY = 16.8e-3 / 1024  # S, at SPARSE_WIDTH
SPARSE_BACKWARD_S_PER_QUERY = 46.2e-3 / 1024  # S' (forward + backward), at SPARSE_WIDTH
SPARSE_WIDTH = 64 * (512 + 64) * 2048  # heads x (latent + rope) x rows a query
QWEN_LAYER_PARAMS = (7.6 * 2**30 / 2 - 2 * 248320 * 5120) / 4  # one Qwen3.6-27B layer of the benchmarked four
DENSE_S_PER_PARAM_TOKEN = LINEAR_S_PER_TOKEN_LAYER / QWEN_LAYER_PARAMS  # D

# The chunked gated delta rule's chunk (kernels/gated_delta; offload stands apart from kernels, a test ties them)
DELTA_CHUNK = 64


def delta_rule_floats(head_dims: int, backward: bool, chunk: int = DELTA_CHUNK) -> int:
    """float32 values of the chunked gated delta rule's scratch per token per value head, s = dk + dv: the
    chunk's per-token rows (a multiple of s), its [c, c] matrices (of c) and its per-chunk states
    (dk dv / c <= s^2 / 4c), forward alone or forward + backward. The multiples are fitted as upper bounds to
    fresh-process peaks of the project's kernel at (dk = dv = 128, c = 64), (64, 64) and (64, 32): 1.1x to 1.3x
    above them, as a peak moves by about 5% from run to run; tests/unit/test_planner.py measures a shape again. fla's
    kernel (CUDA) keeps less: this counts the kernel every device has."""
    s = head_dims
    if backward:
        return 16 * s + s * s // chunk + 32 * chunk
    return 8 * s + s * s // (2 * chunk) + 12 * chunk


@dataclass(frozen=True)
class Phases:
    """Where the seconds are asked: `layers` of the kind in `shape`, a prompt of `context` tokens over `cp`
    ranks."""

    shape: ModelShape
    layers: int
    context: int
    cp: int

    @property
    def tokens(self) -> float:
        return self.context / self.cp


@dataclass(frozen=True)
class KindSeconds:
    """One H200's seconds per rank for a kind's layers, per phase and schedule:
    capture_before  contiguous shards (and the GDN scan's two passes)
    capture_now     zigzag shards, one pass
    turns           exact mode's prefix pass in turns (the ranks one after the other: the whole prompt's)
    layer_major     exact mode's layer-major prefix pass, every rank at once on its share
    recompute       what the layer-major pass's recompute of a layer's input costs, at (k - 1) / k of it with
                    prefix_inputs_every k"""

    capture_before: float
    capture_now: float
    turns: float
    layer_major: float
    recompute: float

    def __add__(self, other: KindSeconds) -> KindSeconds:
        return KindSeconds(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple:
        return (self.capture_before, self.capture_now, self.turns, self.layer_major, self.recompute)


@dataclass(frozen=True)
class KindCost:
    """The cost of one combine rule's layers (module docstring); the base keeps nothing and predicts no seconds."""

    def layer_major_held(self, shape: ModelShape) -> int:
        return 0

    def capture_workspace(self, shape: ModelShape, tokens_per_rank: int, capture_chunk: int,
                          holds: bool) -> dict[str, int]:
        """holds: whether the capture holds a recurrent kind's outputs across the exchange (offload/auto.scan_holds,
        which asks capture_held)."""
        return {}

    def capture_held(self, shape: ModelShape, tokens_per_rank: int) -> int:
        """Bytes of the kind's outputs the capture may hold across its exchange ("cp_scan"'s rule weighs them)."""
        return 0

    def seconds(self, at: Phases) -> KindSeconds | None:
        """None: no time model for the kind."""
        return None


def _attention_held(shape: ModelShape) -> int:
    """q, out and d(out) [H D] in the model's dtype with lse [H] in float32 (float64 in float64 models)."""
    acc = 8 if shape.dtype_bytes == 8 else 4
    return 3 * shape.attention_heads * shape.attention_head_dim * shape.dtype_bytes + shape.attention_heads * acc


@dataclass(frozen=True)
class AttentionCost(KindCost):
    """"lse": attention over pages. Per layer: the 27B fit's per-token work a / 4 over the rank's tokens, and its
    causal attention b L^2, of which contiguous shards give the last rank (2N - 1) / N^2 and zigzag shards 1 / N.
    The turns run the whole prompt's recompute and backward, about 3x its forward; layer-major 3x a rank's share."""

    def layer_major_held(self, shape: ModelShape) -> int:
        return _attention_held(shape)

    def seconds(self, at: Phases) -> KindSeconds:
        cp = at.cp
        linear = LINEAR_S_PER_TOKEN_LAYER * at.layers * at.tokens
        attention = ATTENTION_S_PER_L2 * at.layers * at.context * at.context
        now = linear + attention / cp
        return KindSeconds(capture_before=linear + attention * (2 * cp - 1) / cp ** 2, capture_now=now,
                           turns=3 * (LINEAR_S_PER_TOKEN_LAYER * at.layers * at.context + attention),
                           layer_major=3 * now, recompute=now)


@dataclass(frozen=True)
class ScanCost(KindCost):
    """"affine_scan": a recurrence folded across ranks (Gated DeltaNet). Bytes: the capture's held outputs
    [o(0) | q~] over the shard with the augmented run's scratch over a capture chunk (its value width dv + dk, dk =
    dv in the families here: 1.5 x delta_head_dims); the layer-major pass's d(o) and d(z) [Hv dv]. Seconds per
    layer: a / 4 per token, and the recurrence R: before, each layer ran the delta rule three times over (augmented
    + plain) and its input projections twice (+ 2R + P); one pass + R; the layer-major pass adds the state
    adjoint's summary, a recurrence over [dS | X] of about twice the rule's cost (+ 2R)."""

    def layer_major_held(self, shape: ModelShape) -> int:
        return 2 * shape.delta_heads * (shape.delta_head_dims // 2) * shape.dtype_bytes

    def capture_held(self, shape: ModelShape, tokens_per_rank: int) -> int:
        """[o(0) | q~] for each of the rank's tokens (a rank whose pieces do not start the prompt; the one that does
        holds dk less per head for that piece)."""
        return tokens_per_rank * shape.delta_heads * shape.delta_head_dims * shape.dtype_bytes

    def capture_workspace(self, shape: ModelShape, tokens_per_rank: int, capture_chunk: int,
                          holds: bool) -> dict[str, int]:
        if not (holds and shape.delta_heads):
            return {}
        augmented = shape.delta_head_dims + shape.delta_head_dims // 2
        return {"gdn_scan": self.capture_held(shape, tokens_per_rank) + shape.delta_heads * 4 * capture_chunk
                * delta_rule_floats(augmented, backward=False)}

    def seconds(self, at: Phases) -> KindSeconds:
        linear = LINEAR_S_PER_TOKEN_LAYER * at.layers * at.tokens
        scan = at.layers * at.tokens
        projections = IN_PROJ_SHARE * LINEAR_S_PER_TOKEN_LAYER
        return KindSeconds(capture_before=linear + (2 * RECURRENCE_S_PER_TOKEN + projections) * scan,
                           capture_now=linear + RECURRENCE_S_PER_TOKEN * scan,
                           turns=3 * LINEAR_S_PER_TOKEN_LAYER * at.layers * at.context,
                           layer_major=3 * linear + 2 * RECURRENCE_S_PER_TOKEN * scan, recompute=linear)


@dataclass(frozen=True)
class SparseCost(KindCost):
    """"topk_lse": sparse attention over a global top-k selection (DSA). Bytes: attention's (absorbed MLA's q, out
    and d(out)). Seconds: the dense work D x the active parameters a token runs through (its share per layer), the
    sparse attention S per query and layer (S' forward + backward), and the selection's scoring Q per (query, key)
    pair and selecting layer: contiguous shards give the last rank L^2 (2N - 1) / (2 N^2) of the pairs, zigzag
    L^2 / (2N); the turns the whole prompt's L^2 / 2 (the selection is recomputed, never differentiated: the indexer
    takes no gradient). The recompute of a layer's input runs the capture again, its selection included."""

    def layer_major_held(self, shape: ModelShape) -> int:
        return _attention_held(shape)

    def seconds(self, at: Phases) -> KindSeconds:
        shape, cp, context = at.shape, at.cp, at.context
        all_layers = max(sum(shape.combine_counts.values()), 1)
        dense = DENSE_S_PER_PARAM_TOKEN * shape.active_params * at.layers / all_layers
        pair = SELECT_S_PER_PAIR * shape.index_width / SELECT_WIDTH * len(shape.selecting)
        width = shape.attention_heads * shape.attention_head_dim * shape.select_topk / SPARSE_WIDTH * at.layers
        per_token = (dense + SPARSE_S_PER_QUERY * width) * at.tokens
        pairs = context * context
        now = per_token + pair * pairs / (2 * cp)
        return KindSeconds(capture_before=per_token + pair * pairs * (2 * cp - 1) / (2 * cp * cp), capture_now=now,
                           turns=3 * dense * context + SPARSE_BACKWARD_S_PER_QUERY * width * context
                           + pair * pairs / 2,
                           layer_major=(3 * dense + SPARSE_BACKWARD_S_PER_QUERY * width) * at.tokens
                           + pair * pairs / (2 * cp), recompute=now)
