"""The "auto" settings' rules, one each, asked alike by the transaction (grpo/topology.py, the CP capture) and by
the planner (offload/plan.py, tools/planner.py), so that what the planner predicts is what runs:

  cp_scan              holds_scan / scan_holds       hold a GDN layer's outputs across the CP exchange
  cp_prefix            prefix_schedule               exact mode's CP prefix pass: "layer_major" or "turns"
                       (layer_major_fits, layer_major_prefix)
  prefix_inputs_every  inputs_every_for              the layer inputs the layer-major pass keeps
  cp_layout            layout_for                    "zigzag" or "contiguous" shards
  prefix_keep_attention keeps_attention              what exact mode's prefix pass takes from capture
  cp_replay            replay_schedule               "gathered" or "spread" pages for the CP replay
  prefix_keep_graph    graph_budget                  the bytes of graph exact mode's capture may keep

Each is a function of the model's per-token shape (offload/plan.ModelShape, which the transaction builds from its
adapter: models/model_shape.py), the settings and what is known of the device (the smallest total memory of a CP
group's devices), so every rank decides alike. Below them, what the rules weigh: the bytes the layer-major pass
adds per token, on the pages' tier and on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ds_longstraw.offload.state_shape import ModelShape

# "prefix_keep_attention": "auto" keeps where a layer's kept stream is its top-k selection (glm_moe_dsa's full
# indexer layers): 4 B per selected row (index_topk per token, 1.9x the latent pages at GLM-5.2, flat in G) against
# scoring every earlier key and sorting again in the prefix pass's forward, the largest part of that forward at 8K
# tokens and beyond (BENCHMARKS.md). A dense attention's kept output and LSE (qwen3_5: (H D + H) values per token,
# 3x the K/V pages at Qwen3.6-27B) saves less per byte and stays asked-for. Under context parallelism the sparse
# layers keep nothing yet (grpo/cp/kinds/sparse/selection.check_sparse), so "auto" keeps on one rank only.
def keeps_attention(keep: bool | str, prefix_grad: str, cp_size: int, selects: bool) -> bool:
    """Whether capture keeps the specs' kept streams for the prefix pass: prefix_keep_attention (True, False or
    "auto") for a model with (`selects`) or without top-k selecting layers; only exact mode has a prefix pass."""
    if prefix_grad != "exact":
        return False
    if keep != "auto":
        return bool(keep)
    return cp_size == 1 and selects


def gdn_scan_outputs(shape: ModelShape, tokens_per_rank: int) -> int:
    """Bytes a context-parallel rank holds of one layer's outputs while its capture waits for the layer's exchange:
    the largest its kinds hold (KindCost.capture_held; the Gated DeltaNet scan's [o(0) | q~] for each token)."""
    return max((cost.capture_held(shape, tokens_per_rank) for cost in shape.kind_costs.values()), default=0)


# "cp_scan": "auto" holds the GDN scan's outputs across the CP exchange where they take at most this fraction of
# the device's total memory (holds_scan, which the capture asks too).
SCAN_HOLD_FRACTION = 0.25


def holds_scan(cp_scan: str, held_bytes: int, device_memory: int | None) -> bool:
    """Whether the GDN capture holds its outputs (`held_bytes` for the largest shard) across the exchange:
    "one_pass", or "auto" where they fit SCAN_HOLD_FRACTION of the device's memory (always when there is no device
    memory to bound them: off CUDA, or not known). The capture (grpo/cp/capture.py) and the plan both ask this."""
    if cp_scan != "auto":
        return cp_scan == "one_pass"
    return device_memory is None or held_bytes <= SCAN_HOLD_FRACTION * device_memory


def scan_holds(shape: ModelShape, tokens_per_rank: int, cp_scan: str, gpu_memory: int | None) -> bool:
    """holds_scan for a rank of `tokens_per_rank` captured tokens of `shape`."""
    return holds_scan(cp_scan, gdn_scan_outputs(shape, tokens_per_rank), gpu_memory)


# "cp_prefix": "auto" runs the layer-major pass where both memories it adds to hold:
# - on the pages' tier (host or NVMe, where the longest prompt is decided), the layer inputs kept from capture and
#   a group's recomputed ones are at most LAYER_MAJOR_STATE_RATIO times what the transaction keeps per rank and
#   token anyway (pages, gradient pages, carry checkpoints, kept attention): the longest prompt that fits then
#   shrinks to at most 1 / (1 + 1.5) = 40% of what the turns allow, for a prefix pass about cp_size times shorter;
# - on the device, what the pass holds across one layer over the rank's shard (layer_major_workspace) takes at most
#   LAYER_MAJOR_DEVICE_FRACTION of the device's memory, as "cp_scan": "auto" bounds the scan's held outputs (no
#   bound off CUDA, where the device's memory is the host's). GLM-5.2's absorbed attention holds q, out and d(out)
#   of 64 heads x 576 a token: 15 GiB a rank at 2M tokens on 32 GPUs, which fits a quarter of a 96 GB H20.
# "prefix_inputs_every": "auto" takes the smallest k (the fewest recomputed layers) whose added bytes per token,
# those held on the device included, fit LAYER_MAJOR_STATE_RATIO, else the k that adds the fewest: Qwen3.6-27B's
# inputs (64 layers x 5,120 values a token) are 4.4x its state kept, and k = 4 (16 kept + 3 recomputed) fits;
# no k fits for GLM-5.2, whose fewest are at k = 13.
LAYER_MAJOR_STATE_RATIO = 1.5
LAYER_MAJOR_DEVICE_FRACTION = 0.25


def layer_major_tier_bytes(shape: ModelShape, every: int) -> int:
    """Bytes per rank and token the layer-major prefix pass adds on the pages' tier: the layer inputs kept every
    `every` layers and a group's recomputed ones."""
    return layer_inputs_bytes(shape, 1, every) + recomputed_inputs_bytes(shape, 1, every)


def layer_major_added(shape: ModelShape, every: int) -> int:
    """Bytes per rank and token the layer-major prefix pass adds in all: on the pages' tier, and what it holds on
    the device across a layer (what "auto" weighs to choose prefix_inputs_every)."""
    return layer_major_tier_bytes(shape, every) + layer_major_workspace(shape, 1)


def retained_per_token(shape: ModelShape, segment_tokens: int, keep_attention: bool = False) -> float:
    """What the transaction keeps per rank and token in exact mode anyway (the ratio's denominator)."""
    return (shape.bytes_per_token + shape.grad_bytes_per_token + shape.carry_total / segment_tokens
            + (shape.kept_bytes_per_token if keep_attention else 0))


def inputs_every_for(shape: ModelShape, segment_tokens: int, keep_attention: bool = False,
                     every: int | str = "auto") -> int:
    """prefix_inputs_every as it runs: `every` itself, or for "auto" the smallest k (the fewest recomputed layers)
    whose added bytes (layer_major_added) fit LAYER_MAJOR_STATE_RATIO, else the k that adds the fewest (then
    ceil(L / k) + k - 1 layers' inputs, about 2 sqrt(L)). A function of the model and settings alone: every rank
    decides alike."""
    if every != "auto":
        return every
    layers = max(sum(shape.combine_counts.values()), 1)
    allowed = LAYER_MAJOR_STATE_RATIO * retained_per_token(shape, segment_tokens, keep_attention)
    fitting = [k for k in range(1, layers + 1) if layer_major_added(shape, k) <= allowed]
    return fitting[0] if fitting else min(range(1, layers + 1), key=lambda k: (layer_major_added(shape, k), k))


def layer_major_fits(shape: ModelShape, segment_tokens: int, keep_attention: bool = False, every: int | str = "auto",
                     tokens_per_rank: int | None = None, device_memory: int | None = None) -> bool:
    """The "auto" rule above: the added bytes per token on the pages' tier at prefix_inputs_every `every` ("auto":
    inputs_every_for) within LAYER_MAJOR_STATE_RATIO of the transaction's own, and, where both the rank's captured
    tokens and the device's memory are known, what the pass holds on the device within LAYER_MAJOR_DEVICE_FRACTION
    of it. Without them the tier's rule alone decides (the CP layout, chosen before a prompt is seen, asks that).
    A function of the model, the settings, the prompt's length and the device: every rank decides alike."""
    every = inputs_every_for(shape, segment_tokens, keep_attention, every)
    tier = layer_major_tier_bytes(shape, every) <= LAYER_MAJOR_STATE_RATIO * retained_per_token(shape, segment_tokens,
                                                                                           keep_attention)
    if tokens_per_rank is None or device_memory is None:
        return tier
    return tier and layer_major_workspace(shape, tokens_per_rank) <= LAYER_MAJOR_DEVICE_FRACTION * device_memory


def layer_major_prefix(shape: ModelShape, cp: int, prefix_grad: str, cp_prefix: str = "auto",
                       segment_tokens: int = 4096, keep_attention: bool = False, every: int | str = "auto",
                       tokens_per_rank: int | None = None, device_memory: int | None = None) -> bool:
    """Whether exact mode's CP prefix pass runs layer-major for this model over `cp` ranks (prefix_schedule, which
    topology.resolve_prefix asks too)."""
    if cp < 2 or shape.not_layer_major:  # one rank runs no CP pass; make_plan refuses "layer_major" where blocked
        return False
    return prefix_schedule(prefix_grad, cp_prefix, False, lambda: layer_major_fits(
        shape, segment_tokens, keep_attention, every, tokens_per_rank, device_memory)) == "layer_major"


def layer_inputs_bytes(shape: ModelShape, tokens_per_rank: int, every: int = 1) -> int:
    """The layer inputs over a rank's shard that capture keeps for the layer-major prefix pass (state.input_pool:
    hidden_size values per token and layer in the model's dtype): of layers 0, every, 2 every, ...
    (prefix_inputs_every); and with each such base that reuses a selection made by a layer whose input is not kept,
    that selection (select_topk int32 positions a token: state.selection_bases)."""
    layers = sum(shape.combine_counts.values())
    bases = [b for b in range(0, layers, every) if b in shape.reusing
             and max((layer for layer in shape.selecting if layer < b), default=0) % every]
    return tokens_per_rank * (shape.hidden_size * shape.dtype_bytes * -(-layers // every)
                              + len(bases) * shape.select_topk * 4)


def recomputed_inputs_bytes(shape: ModelShape, tokens_per_rank: int, every: int = 1) -> int:
    """What the layer-major prefix pass's recompute of a group's inputs holds on the pages' tier while the group
    runs: every - 1 layers' inputs over the shard (prefix_layers.recompute_inputs)."""
    return tokens_per_rank * shape.hidden_size * shape.dtype_bytes * (min(every, sum(shape.combine_counts.values()))
                                                                      - 1)


def layer_major_workspace(shape: ModelShape, tokens_per_rank: int) -> int:
    """What the layer-major prefix pass holds on the device across one layer (grpo/cp/prefix_layers.py): d(output)
    and d(input) [T, C] in the model's dtype, and the largest layer kind's own (KindCost.layer_major_held:
    attention's q, out, d(out) and lse, GDN's d(o) and d(z)). An estimate of the larger tensors, not of every
    temporary."""
    hidden = 2 * shape.hidden_size * shape.dtype_bytes
    own = max((cost.layer_major_held(shape) for cost in shape.kind_costs.values()), default=0)
    return tokens_per_rank * (hidden + own)


def layout_for(blockers: Sequence[str], selects: bool, prefix: Callable[[], str | None]) -> str:
    """"cp_layout": "auto": zigzag shards (every rank's share of causal attention alike) unless something does not
    run on them (`blockers`, the topology's list), or the model attends a top-k selection (`selects`) whose exact
    prefix pass takes the turns (`prefix()`: prefix_schedule's answer on the pages' tier alone, asked only for
    such a model, as the layout is chosen before a prompt is seen). A turn per zigzag piece costs such a model more
    than the balanced capture saves (BENCHMARKS.md, "glm_moe_dsa under context parallelism": 1.25x one process's
    prefix pass on zigzag shards, 0.78x on contiguous ones, at CP 2)."""
    return "contiguous" if blockers or (selects and prefix() == "turns") else "zigzag"


def prefix_schedule(prefix_grad: str, cp_prefix: str, blocked: bool, fits: Callable[[], bool]) -> str | None:
    """How exact mode's CP prefix pass runs: None in detached mode (no prefix pass); cp_prefix itself where it is
    not "auto"; for "auto" the turns where some layer cannot run layer-major (`blocked`), else layer_major where
    it fits (`fits`: layer_major_fits of the model and settings, asked only here: the transaction builds the
    model's shape from its adapter for it)."""
    if prefix_grad != "exact":
        return None
    if cp_prefix != "auto":
        return cp_prefix
    if blocked:
        return "turns"
    return "layer_major" if fits() else "turns"


# "cp_replay": "auto" gathers the whole prompt's pages on every rank for the replay (grpo/cp/gathered.py) where they
# and, in exact mode, their gradient pages take at most this fraction of the device's total memory: 2.5 GB of an 80
# GB H100, 26K tokens of GLM-5.2's pages (93 KiB a token; 13K in exact mode) and 38K of Qwen3.6-27B's (64 KiB; 19K).
# Gathering moves the prompt's pages once; the spread replay moves each replayed token's queries at every layer and
# its partials back (GLM-5.2: 64 heads x 576 values of query against 1.2 KB of a layer's page per token, some 60
# times more), in several collectives per layer and block. So within this budget gathering moves fewer bytes and
# waits less (BENCHMARKS.md "The CP replay gathered"); beyond it the sharded pages are what context parallelism is
# for. A short prompt in a job sized for long ones is the case it serves.
GATHER_FRACTION = 1 / 32
# Off CUDA (CPU ranks: the device is the host) no device memory bounds it: a fixed 1 GiB per rank.
GATHER_HOST_BYTES = 1 << 30


def gathered_bytes(shape: ModelShape, prompt_tokens: int, prefix_grad: str) -> int:
    """Bytes a rank holds while the replay runs over the whole prompt's gathered pages (a prompt of `prompt_tokens`
    ids, all but the last captured): every paged layer's streams, and in exact mode their gradient pages."""
    per_token = shape.bytes_per_token + (shape.grad_bytes_per_token if prefix_grad == "exact" else 0)
    return max(prompt_tokens - 1, 0) * per_token


def replay_schedule(cp_replay: str, held_bytes: int, device_memory: int | None) -> str:
    """The CP replay a prompt runs: cp_replay as given, or "auto": "gathered" where `held_bytes` (gathered_bytes)
    fit GATHER_FRACTION of the device's memory (GATHER_HOST_BYTES where none is known), else "spread". The
    topology (grpo/topology.py) and the planner both ask this."""
    if cp_replay != "auto":
        return cp_replay
    limit = GATHER_HOST_BYTES if device_memory is None else GATHER_FRACTION * device_memory
    return "gathered" if held_bytes <= limit else "spread"


# "prefix_keep_graph": "fits" (asked for: the default keeps none, so the live graph stays one segment's) lets exact
# mode's capture keep its graph (grpo/kept_graph.py) up to this fraction of the memory the rank may still take when
# capture starts (grpo/memory.free_device_bytes: the GPU's free memory; off CUDA the host's available memory over the
# node's ranks): the rest is left to what runs while that graph lives (one member's replay graph, the pages, their
# gradient pages, the prefix pass over the segments not kept). Every kept byte saves a forward of its tokens in the
# prefix pass: at 8K tokens of the small GLM shape that forward and the per-layer recompute are 0.3x the step
# (BENCHMARKS.md). At Qwen3.6-27B's width a token's graph is some 31 MiB (LoRA, bf16: arch/qwen3_5_graph.py), so on
# an 80 GB GPU this keeps a prompt's first few hundred tokens; on small models it keeps short prompts whole.
KEEP_GRAPH_FRACTION = 1 / 4


def graph_budget(keep: bool | str, budget_gb: float | None, prefix_grad: str, free_bytes: int | None) -> int | None:
    """The bytes of autograd graph exact mode's capture may keep (prefix_keep_graph, prefix_graph_budget_gb): 0
    none (detached mode, False), None no bound (True), else prefix_graph_budget_gb or KEEP_GRAPH_FRACTION of
    `free_bytes`, the memory the rank may still take ("fits" needs it)."""
    if prefix_grad != "exact" or keep is False:
        return 0
    if keep is True:
        return None
    if budget_gb is not None:
        return int(budget_gb * (1 << 30))
    if free_bytes is None:
        raise ValueError("prefix_keep_graph 'fits' needs the memory the rank may still take")
    return int(KEEP_GRAPH_FRACTION * free_bytes)
