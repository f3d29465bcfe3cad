"""The tier plan: retained bytes per rank, what each tier needs of GPU, host and NVMe, and what fits.

Per rank (the largest CP shard, ceil((context - 1) / cp) captured tokens):
  pages          per-token state of every layer (the specs' streams)   tier none: GPU; cpu: host; nvme: disk
  gradient pages exact mode, as much again for streams with a gradient  with the pages
  kept attention exact mode with prefix_keep_attention: the specs' kept streams per token
                 with the pages, or on offload.kept_attention_tier
  layer inputs   exact mode's layer-major CP prefix pass: the input per token of every      with the pages
                 prefix_inputs_every-th layer, and the rest of a group's while it runs
  carry          per sequence (a recurrent state, a conv tail)          always GPU
  checkpoints    exact mode: the whole carry per chunk start            with the pages (tier none: GPU);
                 off the device two of them staged on the GPU (one read ahead)
  staging        (depth + 1) staged layers of pages, plus (exact mode) one layer's page gradients in float32
                 during backward (a sparse attention's: its rows laid out and their gradients, both float32;
                 detached mode computes no gradient for the pages)                               GPU
  host staging   nvme: (depth + 1) layers of landing buffers + the 64 MiB write queue        host
  workspace      the kernels' scratch, the largest of (they never run at once):                 GPU
                 log-probs   a replay block's vocabulary chunk of float32 logits, probabilities and their
                             gradient, plus d(hidden) in float32 (kernels/logprobs/chunked.py)
                 attention   flash's float32 dq accumulator and lse over a capture chunk's queries, and
                             the dK/dV of one backward call's keys (kernels/attention.LIBRARY_KEY_BLOCK)
                 delta rule  the chunk kernel's float32 scratch: the capture's forward over a capture chunk,
                             forward + backward over a replay block (exact mode: over a capture chunk too)
                 prefix selections (exact mode where the prefix pass recomputes each layer in backward: one rank,
                             or prefix_keep_attention; a model with top-k selecting layers) the attention's scratch
                             plus a capture chunk's selections, int32 [chunk, select_topk] per selecting layer,
                             which the segment keeps from its forward for its layers' recompute
                             (arch/glm_moe_dsa.forward_segment)
                 layer-major (exact mode under context parallelism) what the layer-major prefix pass holds across
                             a layer: d(output) and d(input) over the shard, and the layer kind's own
                             (layer_major_workspace)
                 gdn scan    (context parallelism) a Gated DeltaNet layer's outputs over the rank's shard, held
                             until the cross-rank exchange gives its initial state ([o(0) | q~], (dv + dk) per
                             value head and token, the model's dtype; grpo/cp/kinds/scan/capture.py), plus the capture
                             chunk's scratch of that augmented run
  replay graph   one replayed member's autograd graph: the family's bytes per response token (all     GPU
                 layers and the head) times the longest response, plus its per-member state
                 (arch/qwen3_5_graph.py; LoRA on a frozen body or every weight trained: `trains`); the
                 kernels' scratch runs inside it, so the two add up
  gradients      trains "full": the trained weights' gradients, as large as the weights' share         GPU
  gathered pages (context parallelism, cp_replay "gathered", or "auto" where they fit: offload/auto.replay_schedule)
                 the whole prompt's pages, in exact mode with their gradient pages, on each GPU      GPU
                 while the replay runs (grpo/cp/gathered.py)
The GPU budget for all of this is the GPU memory minus the weights' share (default estimate: ZeRO-3 shards the
parameters over all GPUs at `weight_bytes` each) minus a reserve for the allocator and what is not modelled
(default 10%). Host memory per rank is the node's memory times `host_fraction`, split over the node's GPUs.
What is not modelled: the replay graph of a family that declares none (glm_moe_dsa so far: the plan says so),
the capture's and the prefix pass's layer activations beyond the workspace, MoE dispatch buffers, the optimizer
state, fragmentation. The estimates of retained bytes are exact for the code's layouts; tests check
them against measured captures.

Rollouts (`rollout_figures`, when the plan is given the samples' new tokens): generate decodes G samples from
the captured prompt, whose pages stay where the tier puts them; each sample keeps its own
  carry          a copy of the prompt's per-sequence carry                                    GPU
  rows           its response's rows of every paged layer (the page streams per token), the whole
                 max_new_tokens allocated up front                                            GPU
and every step's logits [G, vocab] (the head's dtype, then float64 for sampling) on the GPU. Every CP rank decodes
every sample, so none of this is sharded. With `rollout.zero3_weights: whole` each rank also holds the whole
weights (routed experts: its EP slice) instead of its ZeRO-3 share while decoding. The kernels' training
workspace is not live while decoding.

Routed experts (a model with a MoEShape), `moe_figures`:
  weights        ZeRO-3 only: every parameter / gpus. Expert parallelism over `ep` ranks: the routed experts / ep
                 (each rank holds its slice whole, outside ZeRO) + the other parameters / gpus (ZeRO-3)
  ZeRO-3 gather  without EP a MoE block is gathered whole (every routed expert, router, shared expert) on each
                 call: each capture chunk makes one call per MoE layer; with EP only the router and shared expert
  all-to-all    per MoE layer and token: its k routed pairs' hidden vectors out and the results back,
                 2 k hidden dtype_bytes, of which (ep - 1) / ep leaves the rank under UNIFORM routing (a token's
                 pairs spread evenly over the EP ranks); the capture's forward sends that for each of the rank's
                 prompt tokens; every further pass over a token (replay, exact mode's prefix pass, a backward
                 returning gradients) sends as much again
"""

from dataclasses import dataclass, field

from ds_longstraw.offload.auto import (
    gathered_bytes,
    inputs_every_for,
    layer_inputs_bytes,
    layer_major_prefix,
    layer_major_workspace,
    recomputed_inputs_bytes,
    replay_schedule,
    scan_holds,
)
from ds_longstraw.offload.kind_costs import delta_rule_floats  # the gated delta rule's scratch (and its chunk)
from ds_longstraw.offload.state_shape import ModelShape

GiB = 2**30
_WRITE_QUEUE = 64 << 20
TIERS = ("none", "cpu", "nvme")


@dataclass
class Cluster:
    """The machines a plan is made for: GPUs and their memory, the CP and EP degrees, each node's host memory and
    NVMe (a running job's parallelism is parallel.parallelism.Parallelism; a prompt's shard layout over the
    CP ranks is the "cp_layout" setting)."""

    gpus: int = 1
    cp: int = 1
    ep: int = 1  # expert-parallel size (under context parallelism: the CP size, as the engine shards them)
    gpus_per_node: int = 1
    gpu_memory: int | None = None  # bytes per GPU
    host_memory: int | None = None  # bytes per node
    nvme_free: int | None = None  # bytes per node (None: not known, assumed enough)
    weights_per_rank: int | None = None  # bytes; None: ZeRO-3 estimate
    weight_bytes: float = 2.0  # per parameter, for that estimate
    reserve_fraction: float = 0.10
    host_fraction: float = 0.80


@dataclass
class Plan:
    shape: ModelShape
    context: int
    group_size: int
    prefix_grad: str
    cluster: Cluster
    capture_chunk: int
    cp_scan: str = "auto"  # longstraw.cp_scan: whether the GDN capture holds its outputs across the exchange
    cp_prefix: str = "auto"  # longstraw.cp_prefix: exact mode's CP prefix pass, layer-major or in turns
    cp_replay: str = "auto"  # longstraw.cp_replay as given
    replay: str = "one rank"  # as it runs for this prompt: "gathered", "spread", "replicated" (CP), or "one rank"
    gathered_pages: int = 0  # "gathered": the whole prompt's pages (exact: and their gradients) on each GPU in replay
    keep_attention: bool = False  # longstraw.prefix_keep_attention
    inputs_every: int = 1  # longstraw.prefix_inputs_every, as it runs (inputs_every_for)
    inputs_every_asked: int | str = "auto"  # as given
    tokens_per_rank: int = 0
    retained: dict = field(default_factory=dict)  # category -> bytes per rank
    weights_per_rank: int = 0
    moe: dict = field(default_factory=dict)  # moe_figures (empty: no routed experts)
    gpu_budget: int | None = None
    host_budget: int | None = None
    nvme_budget: int | None = None
    needs: dict = field(default_factory=dict)  # tier -> {"gpu", "host", "nvme"} bytes
    fits: dict = field(default_factory=dict)  # tier -> bool (None: unknown budget)
    depth: dict = field(default_factory=dict)  # tier -> staging depth
    tier: str | None = None
    max_context: dict = field(default_factory=dict)  # tier -> prompt tokens (None: no bound known)
    workspace: dict = field(default_factory=dict)  # kernel -> bytes (kernel_workspace)
    rollout: dict = field(default_factory=dict)  # rollout_figures (empty: no rollout sized)
    response_tokens: int = 1024  # the longest member's response: what its replay graph scales with
    tool_tokens: int = 0  # the untrained span (a tool output) inside that member
    member_span_capture: int | None = 1024  # the longstraw block's: spans of at least this many tokens run in steps
    member_steps: bool = False  # whether the span runs in steps (member_replay): then the graph is the actions'
    tool_rows: int = 0  # bytes of the span's rows and their gradients in steps, counted in replay_graph
    tool_carries: int = 0  # bytes of the carries kept at its steps' starts, counted in replay_graph
    groups_per_document: int = 1  # groups whose prompts share this context's document (grpo_backward_shared)
    trains: str = "lora"  # "lora" (adapters on a frozen body) or "full" (every weight)
    replay_graph: int | None = 0  # bytes of one member's graph (replay_graph_bytes); None: not known for the family
    trained_grads: int = 0  # "full": the trained weights' gradients on this rank (their share, as the weights')


# The replay block the workspace is counted for (the longstraw block's default replay_block), the log-prob
# kernel's vocabulary chunk (kernels/logprobs.VOCAB_CHUNK) and the keys per library attention backward call
# (kernels/attention.LIBRARY_KEY_BLOCK); offload stands apart from kernels, a test ties them.
REPLAY_BLOCK = 1024
VOCAB_CHUNK = 8192
LIBRARY_KEY_BLOCK = 16384


def kernel_workspace(shape: ModelShape, capture_chunk: int, replay_block: int = REPLAY_BLOCK,
                     prefix_grad: str = "detached") -> dict:
    """Bytes of scratch each kernel takes on the GPU at its largest call (module docstring); float32 throughout.
    Detached mode runs the delta rule's backward over replay blocks only; exact mode also over capture chunks."""
    f32 = 4
    chunk = min(shape.vocab_size, VOCAB_CHUNK)
    tokens = max(capture_chunk, replay_block)
    backward_tokens = tokens if prefix_grad == "exact" else replay_block
    delta = max(capture_chunk * delta_rule_floats(shape.delta_head_dims, backward=False),
                backward_tokens * delta_rule_floats(shape.delta_head_dims, backward=True))
    return {
        "logprobs": replay_block * (3 * chunk + shape.hidden_size) * f32,
        # dq and lse, plus one library backward call's dK/dV over its keys (the pages' dtype): flash makes them per
        # query head, then sums each group into its KV head
        "attention": shape.attention_heads * tokens * (shape.attention_head_dim + 1) * f32
        + 2 * (shape.attention_heads + shape.attention_kv_heads) * LIBRARY_KEY_BLOCK * shape.attention_head_dim
        * shape.dtype_bytes * (shape.attention_kv_heads > 0),
        "delta_rule": shape.delta_heads * delta * f32,
    }


def prefix_selection_bytes(shape: ModelShape, segment_tokens: int) -> int:
    """What a prefix-pass segment keeps of its selections for its layers' recompute in backward: int32 positions
    [segment_tokens, select_topk] per selecting layer (recomputing them instead costs each layer's indexer scores
    over every earlier key again, the largest part of the layer's recompute at long context)."""
    return segment_tokens * shape.select_topk * 4 * len(shape.selecting)


def phase_workspace(shape: ModelShape, capture_chunk: int, prefix_grad: str, cp: int, tokens_per_rank: int,
                    cp_scan: str = "auto", gpu_memory: int | None = None, cp_prefix: str = "auto",
                    keep_attention: bool = False, inputs_every: int = 1) -> dict:
    """kernel_workspace, plus (context parallelism, Gated DeltaNet layers, where the capture holds its outputs:
    scan_holds) the scan's held outputs together with the augmented run's scratch over a capture chunk: its value
    width is dv + dk (dk = dv in the families here, so 1.5 x delta_head_dims). "two_pass" holds nothing across the
    exchange. With the layer-major prefix pass (layer_major_prefix), what it holds across a layer
    ("layer_major_prefix"). Where exact mode's prefix pass recomputes each layer and the model selects (top-k
    layers), the attention's scratch beside the segment's kept selections ("prefix_selections")."""
    workspace = kernel_workspace(shape, capture_chunk, prefix_grad=prefix_grad)
    if prefix_grad == "exact" and (cp == 1 or keep_attention) and shape.selecting:
        workspace["prefix_selections"] = workspace["attention"] + prefix_selection_bytes(shape, capture_chunk)
    if layer_major_prefix(shape, cp, prefix_grad, cp_prefix, capture_chunk, keep_attention, inputs_every,
                          tokens_per_rank, gpu_memory):
        workspace["layer_major_prefix"] = layer_major_workspace(shape, tokens_per_rank)
    if cp > 1:
        holds = scan_holds(shape, tokens_per_rank, cp_scan, gpu_memory)
        for cost in shape.kind_costs.values():
            workspace.update(cost.capture_workspace(shape, tokens_per_rank, capture_chunk, holds))
    return workspace




def zigzag_chunks(context: int, cp: int, capture_chunk: int) -> int:
    """The most capture chunks a rank has under context parallelism's zigzag layout (the default for families with
    a carry, parallel/groups.shard_pieces): rank r owns segments r and 2 cp - 1 - r of 2 cp, each chunked on its
    own (up to one chunk more than its tokens alone would need)."""
    base, extra = divmod(max(context - 1, 0), 2 * cp)
    sizes = [base + (1 if s < extra else 0) for s in range(2 * cp)]
    return max(-(-sizes[r] // capture_chunk) + -(-sizes[2 * cp - 1 - r] // capture_chunk) for r in range(cp))


def captured_tokens_per_rank(context: int, cp: int) -> int:
    return -(-max(context - 1, 0) // cp)


def retained_per_rank(shape: ModelShape, context: int, cp: int, prefix_grad: str, capture_chunk: int,
                      keep_attention: bool = False, cp_prefix: str = "auto", inputs_every: int = 1,
                      gpu_memory: int | None = None) -> dict:
    """Bytes each rank keeps, by category (the keys match PrefixState.retained_bytes() where they overlap).
    gpu_memory: the device's memory, which bounds the layer-major pass under "auto" (layer_major_fits)."""
    tokens = captured_tokens_per_rank(context, cp)
    out = {key: per_token * tokens for key, per_token in shape.page_bytes_per_token.items()}
    out.update(shape.carry_bytes)
    chunks = -(-tokens // capture_chunk) if cp == 1 or not shape.carry_total else zigzag_chunks(context, cp,
                                                                                               capture_chunk)
    exact = prefix_grad == "exact"
    # Rank 0's first chunk starts from a zero state and keeps no checkpoint; other ranks checkpoint every chunk.
    out["carry_checkpoints"] = shape.carry_total * max(chunks - (1 if cp == 1 else 0), 0) if exact else 0
    out["gradient_pages"] = shape.grad_bytes_per_token * tokens if exact else 0
    out["kept_attention_pages"] = shape.kept_per_rank(cp)[1] * tokens if exact and keep_attention else 0
    layer_major = layer_major_prefix(shape, cp, prefix_grad, cp_prefix, capture_chunk, keep_attention, inputs_every,
                                     tokens, gpu_memory)
    out["layer_inputs"] = layer_inputs_bytes(shape, tokens, inputs_every) if layer_major else 0
    # the group's recomputed inputs, on the pages' tier while the group runs
    out["recomputed_inputs"] = recomputed_inputs_bytes(shape, tokens, inputs_every) if layer_major else 0
    return out


_WHERE = {"none": "gpu", "cpu": "host", "nvme": "nvme"}


TRAINS = ("lora", "full")


def replay_graph_bytes(shape: ModelShape, response_tokens: int, trains: str) -> int | None:
    """Bytes one replayed member's autograd graph keeps on the device until its backward (the family's per-token
    and per-member figures: arch/qwen3_5_graph.py), or None where the family declares none. Only one member's graph
    is alive at a time: this is what the transaction bounds the live graph to."""
    if trains not in TRAINS:
        raise ValueError(f"trains must be one of {TRAINS}, got {trains!r}")
    if response_tokens < 1:
        raise ValueError(f"response_tokens must be >= 1, got {response_tokens}")
    if trains not in shape.replay_graph:
        return None
    per_token, per_member = shape.replay_graph[trains]
    return response_tokens * per_token + per_member


# A member's untrained span of at least member_span_capture tokens runs in steps (grpo/member_steps.py): the span cut
# into steps as long as the member's longest action region, at least MIN_CAPTURED_STEP and at most replay_block.
MIN_CAPTURED_STEP = 256


def captured_step(longest_region: int, replay_block: int = REPLAY_BLOCK) -> int:
    """Tokens per step of a captured span whose member's longest action region is `longest_region` tokens: its
    graph is then the actions' (what its replay without the span would keep)."""
    return min(replay_block, max(MIN_CAPTURED_STEP, longest_region))


def member_replay(shape: ModelShape, response_tokens: int, tool_tokens: int, span_capture: int | None,
                  replay_block: int = REPLAY_BLOCK) -> dict[str, int | bool]:
    """What one member's replay holds beside the kernels: {"steps": whether it runs in steps, "graph_tokens": the
    tokens its graph spans, "tool_rows": the bytes of its tool span's rows and their gradients, "tool_carries": the
    carry kept at each step's start (in steps: one per step of the span and one for the actions after it; the
    first step's is the prompt's)}. response_tokens: its trained (action) tokens; tool_tokens: its untrained
    span."""
    if tool_tokens < 0:
        raise ValueError(f"tool_tokens must be >= 0, got {tool_tokens}")
    steps = span_capture is not None and tool_tokens >= span_capture
    if not steps:
        return {"steps": False, "graph_tokens": response_tokens + tool_tokens, "tool_rows": 0, "tool_carries": 0}
    step = captured_step(response_tokens, replay_block)
    return {"steps": True, "graph_tokens": max(response_tokens, step),
            "tool_rows": 2 * tool_tokens * sum(shape.page_bytes_per_token.values()),
            "tool_carries": (-(-tool_tokens // step) + 1) * shape.carry_total}


def _needs(shape: ModelShape, tokens: int, retained: dict[str, int], tier: str, depth: int,
           kept_tier: str | None = None, workspace: int = 0) -> dict[str, int]:
    needs = _page_needs(shape, tokens, retained, tier, depth, kept_tier)
    needs["gpu"] += workspace
    if kept_tier not in (None, tier):  # kept attention outputs on a tier of their own
        needs[_WHERE[kept_tier]] += retained["kept_attention_pages"]
    return needs


def _page_backward_bytes(shape: ModelShape, tokens: int, layer: int) -> int:
    """What one layer's backward holds for its pages in float32 (exact mode): a dense attention's dK/dV of the
    layer; a top-k selecting model's sparse attention, the rows it lays out and their gradients, [rows,
    attention_head_dim] twice, at most every row (kernels/sparse_mla/selected_rows.py: only the selected rows where
    at most three quarters are)."""
    dense = layer * 4 // shape.dtype_bytes
    if shape.selecting:
        return max(dense, 2 * tokens * shape.attention_head_dim * 4)
    return dense


def _page_needs(shape: ModelShape, tokens: int, retained: dict[str, int], tier: str, depth: int,
                kept_tier: str | None) -> dict[str, int]:
    # state and gradient pages, and the layer-major prefix pass's layer inputs (on the pages' tier)
    pages = (sum(v for k, v in retained.items() if k.endswith("_pages")) + retained.get("layer_inputs", 0)
             + retained.get("recomputed_inputs", 0))
    if kept_tier not in (None, tier):
        pages -= retained["kept_attention_pages"]
    layer = shape.staged_layer_bytes_per_token * tokens
    exact = retained["gradient_pages"] > 0
    backward = _page_backward_bytes(shape, tokens, layer) if exact else 0
    checkpoints = retained["carry_checkpoints"]
    carry = shape.carry_total
    if tier == "none":
        return {"gpu": pages + carry + checkpoints + backward, "host": 0, "nvme": 0}
    # Off the device the carry checkpoints live with the pages, and the prefix pass holds two on the device: the
    # segment's own and the next one's, read ahead.
    ahead = 2 * carry if checkpoints else 0
    staging = (depth + 1) * layer + backward + ahead
    if tier == "cpu":
        return {"gpu": carry + staging, "host": pages + checkpoints, "nvme": 0}
    return {"gpu": carry + staging, "host": (depth + 1) * layer + ahead + _WRITE_QUEUE,
            "nvme": pages + checkpoints}


def _fits(needs: dict[str, int], plan: Plan) -> bool:
    for key, budget in (("gpu", plan.gpu_budget), ("host", plan.host_budget), ("nvme", plan.nvme_budget)):
        if needs[key] and budget is not None and needs[key] > budget:
            return False
    return True


def _depth_for(tier: str) -> int:
    # Host copies are fast next to a layer's compute: one layer ahead hides them. NVMe reads are slower and
    # burstier: two ahead where it fits.
    return {"none": 1, "cpu": 1, "nvme": 2}[tier]


def make_plan(shape: ModelShape, context: int, group_size: int, prefix_grad: str, cluster: Cluster,
              capture_chunk: int = 4096, keep_attention: bool = False, kept_tier: str | None = None,
              cp_scan: str = "auto", cp_prefix: str = "auto", inputs_every: int | str = "auto",
              response_tokens: int = 1024, trains: str = "lora", tool_tokens: int = 0,
              member_span_capture: int | None = 1024, cp_replay: str = "auto") -> Plan:
    if prefix_grad not in ("detached", "exact"):
        raise ValueError(f"prefix_grad must be 'detached' or 'exact', got {prefix_grad!r}")
    if cluster.cp < 1 or cluster.gpus % cluster.cp:
        raise ValueError(f"cp = {cluster.cp} must divide gpus = {cluster.gpus}")
    if context < 2 or group_size < 1:
        raise ValueError(f"context must be >= 2 and group size >= 1, got {context} and {group_size}")
    if cp_scan not in ("auto", "one_pass", "two_pass"):
        raise ValueError(f"cp_scan must be 'auto', 'one_pass' or 'two_pass', got {cp_scan!r}")
    if cp_prefix not in ("auto", "layer_major", "turns"):
        raise ValueError(f"cp_prefix must be 'auto', 'layer_major' or 'turns', got {cp_prefix!r}")
    if cp_prefix == "layer_major" and prefix_grad == "exact" and cluster.cp > 1 and not layer_major_prefix(
            shape, cluster.cp, prefix_grad, cp_prefix):
        raise ValueError(f"cp_prefix 'layer_major' does not run for {shape.family} (layers that combine by "
                         f"{list(shape.not_layer_major)})")
    if cp_replay not in ("auto", "gathered", "spread", "replicated"):
        raise ValueError(f"cp_replay must be 'auto', 'gathered', 'spread' or 'replicated', got {cp_replay!r}")
    if inputs_every != "auto" and (not isinstance(inputs_every, int) or inputs_every < 1):
        raise ValueError(f"inputs_every must be 'auto' or at least 1, got {inputs_every!r}")
    asked, inputs_every = inputs_every, inputs_every_for(shape, capture_chunk, keep_attention, inputs_every)
    member = member_replay(shape, response_tokens, tool_tokens, member_span_capture)
    graph = replay_graph_bytes(shape, member["graph_tokens"], trains)
    plan = Plan(shape, context, group_size, prefix_grad, cluster, capture_chunk, cp_scan=cp_scan, cp_prefix=cp_prefix,
                keep_attention=keep_attention, inputs_every=inputs_every, inputs_every_asked=asked,
                response_tokens=response_tokens, trains=trains, tool_tokens=tool_tokens,
                member_span_capture=member_span_capture, cp_replay=cp_replay,
                member_steps=member["steps"], tool_rows=member["tool_rows"], tool_carries=member["tool_carries"],
                replay_graph=None if graph is None else graph + member["tool_rows"] + member["tool_carries"])
    plan.tokens_per_rank = captured_tokens_per_rank(context, cluster.cp)
    if cluster.cp > 1:  # the replay's schedule for this prompt, as the topology resolves it (resolve_replay)
        gathered = gathered_bytes(shape, context, prefix_grad)
        plan.replay = replay_schedule(cp_replay, gathered, cluster.gpu_memory)
        plan.gathered_pages = gathered if plan.replay == "gathered" else 0
    if keep_attention and not shape.kept_bytes_per_token:
        raise ValueError(f"prefix_keep_attention: {shape.family} models declare no attention outputs to keep")
    plan.retained = retained_per_rank(shape, context, cluster.cp, prefix_grad, capture_chunk, keep_attention, cp_prefix,
                                      inputs_every, cluster.gpu_memory)
    check_expert_layout(shape, cluster)
    plan.moe = moe_figures(shape, cluster, plan.tokens_per_rank, capture_chunk)
    plan.workspace = phase_workspace(shape, capture_chunk, prefix_grad, cluster.cp, plan.tokens_per_rank, cp_scan,
                                     cluster.gpu_memory, cp_prefix, keep_attention, inputs_every)
    estimate = plan.moe["weights_per_rank_ep"] if cluster.ep > 1 else int(shape.params * cluster.weight_bytes
                                                                         / cluster.gpus)
    plan.weights_per_rank = cluster.weights_per_rank if cluster.weights_per_rank is not None else estimate
    plan.trained_grads = plan.weights_per_rank if trains == "full" else 0
    if cluster.gpu_memory is not None:
        plan.gpu_budget = int(cluster.gpu_memory * (1 - cluster.reserve_fraction)) - plan.weights_per_rank
    if cluster.host_memory is not None:
        plan.host_budget = int(cluster.host_memory * cluster.host_fraction / cluster.gpus_per_node)
    if cluster.nvme_free is not None:
        plan.nvme_budget = cluster.nvme_free // cluster.gpus_per_node
    for tier in TIERS:
        depth = _depth_for(tier)
        # a gathered replay's pages are on the GPU while the replay runs, beside what it keeps (counted with it)
        workspace = _live_beside_pages(plan) + plan.gathered_pages
        needs = _needs(shape, plan.tokens_per_rank, plan.retained, tier, depth, kept_tier, workspace)
        if tier == "nvme" and not _fits(needs, plan):
            depth = 1
            needs = _needs(shape, plan.tokens_per_rank, plan.retained, tier, depth, kept_tier, workspace)
        plan.depth[tier], plan.needs[tier] = depth, needs
        plan.fits[tier] = _fits(needs, plan)
        bounds = [_max_context(shape, prefix_grad, cluster, capture_chunk, plan, tier, d, keep_attention, kept_tier)
                  for d in sorted({_depth_for(tier), 1})]  # a longer prompt may fit with a shallower read-ahead
        plan.max_context[tier] = None if None in bounds else max(bounds)
    plan.tier = recommended_tier(plan)
    return plan


# The kernels whose scratch is live while a member's graph is (the replay runs them with autograd); the other
# workspaces belong to the capture or the prefix pass, when no member's graph is alive.
REPLAY_KERNELS = ("logprobs", "attention", "delta_rule")


def _live(workspace: dict, replay_graph: int | None, trained_grads: int) -> int:
    """The most the step holds on the device beside the pages and the carry: the largest phase's scratch, where a
    replay's is its member's graph plus the kernels that run inside it; training every weight, their gradients
    throughout."""
    replay = (replay_graph or 0) + max(workspace.get(kernel, 0) for kernel in REPLAY_KERNELS)
    return max(max(workspace.values()), replay) + trained_grads


def _live_beside_pages(plan: Plan) -> int:
    return _live(plan.workspace, plan.replay_graph, plan.trained_grads)


def recommended_tier(plan: Plan) -> str | None:
    """The first tier (fastest first) where the transaction fits and, when rollouts are sized (plan.rollout),
    decoding them fits too with the weights served per call."""
    decodes = plan.rollout["per_call"]["fits"] if plan.rollout else {}
    return next((t for t in TIERS if plan.fits[t] and decodes.get(t) is not False), None)


def decode_state_bytes(samples: int, new_tokens: int, carry_bytes: int, bytes_per_token: int, vocab_size: int,
                       dtype_bytes: int) -> tuple:
    """(the samples' own state, a step's logits) in bytes while `samples` decode up to `new_tokens` tokens (module
    docstring): each sample's copy of the per-sequence carry and its response rows, allocated whole up front; the
    logits [samples, vocab] in the head's dtype and in float64. rollout_figures and the engine's "auto"
    zero3_weights (rollout_step.decoding_bytes) both count with it."""
    return samples * (carry_bytes + bytes_per_token * new_tokens), samples * vocab_size * (dtype_bytes + 8)


def rollout_figures(plan: Plan, new_tokens: int) -> dict:
    """Bytes per rank of decoding the plan's G samples of up to `new_tokens` tokens from its captured prompt
    (module docstring), and what the GPU then holds under each tier, with the weights as ZeRO-3 shares them and
    gathered whole; the longest response that fits the GPU budget under each."""
    shape, cluster, g = plan.shape, plan.cluster, plan.group_size
    if new_tokens < 1:
        raise ValueError(f"new tokens must be >= 1, got {new_tokens}")
    rows_per_token = shape.bytes_per_token
    samples, logits = decode_state_bytes(g, new_tokens, shape.carry_total, rows_per_token, shape.vocab_size,
                                         shape.dtype_bytes)
    if plan.moe and cluster.ep > 1:  # the EP slice is already whole; gathering makes the rest whole
        whole = plan.moe["routed_weights_per_rank_ep"] + int((shape.params - plan.moe["routed_params"])
                                                            * cluster.weight_bytes)
    else:
        whole = int(shape.params * cluster.weight_bytes)
    out = {"new_tokens": new_tokens, "carry_per_sample": shape.carry_total,
           "rows_per_sample": rows_per_token * new_tokens, "samples": samples, "logits": logits,
           "whole_weights_extra": max(whole - plan.weights_per_rank, 0)}
    workspace = _live_beside_pages(plan)  # none of the training step's scratch is live while decoding
    budget = plan.gpu_budget
    for weights in ("per_call", "whole"):  # rollout.zero3_weights
        extra = out["whole_weights_extra"] if weights == "whole" else 0
        figures = out[weights] = {"gpu": {}, "fits": {}, "longest": {}}  # by tier
        for tier in TIERS:
            prompt = plan.needs[tier]["gpu"] - workspace  # the capture's share of the tier's GPU needs
            figures["gpu"][tier] = prompt + samples + logits + extra
            figures["fits"][tier] = None if budget is None else figures["gpu"][tier] <= budget
            room = None if budget is None else budget - prompt - logits - extra - g * shape.carry_total
            figures["longest"][tier] = (None if room is None or not rows_per_token
                                        else max(room // (g * rows_per_token), 0))
    return out


def check_expert_layout(shape: ModelShape, cluster: Cluster) -> None:
    """ValueError for an expert-parallel size the engine would refuse (engine/expert_slices.py: EP groups of `ep`
    consecutive ranks, the CP group under context parallelism, an even split of every layer's experts)."""
    ep = cluster.ep
    if ep < 1:
        raise ValueError(f"--ep {ep}: the expert-parallel size must be >= 1")
    if ep == 1:
        return
    if shape.moe is None:
        raise ValueError(f"--ep {ep}: {shape.name} ({shape.family}) has no routed experts to shard; use --ep 1")
    if cluster.cp > 1 and ep != cluster.cp:
        raise ValueError(f"--ep {ep} with --cp {cluster.cp}: under context parallelism the experts are sharded over "
                         f"the CP group ('longstraw.ep_size' = 'longstraw.cp_size'), so --ep must equal --cp (--cp "
                         "defaults to every GPU)")
    if cluster.gpus % ep:
        raise ValueError(f"--ep {ep} must divide --gpus {cluster.gpus} (EP groups of consecutive ranks)")
    if shape.moe.experts % ep:
        raise ValueError(f"--ep {ep} must divide the {shape.moe.experts} routed experts of a MoE layer")


def moe_figures(shape: ModelShape, cluster: Cluster, tokens_per_rank: int, capture_chunk: int) -> dict:
    """Weights per rank with and without expert parallelism, ZeRO-3's gather of a MoE block, and the EP
    all-to-all's bytes (see the module docstring); {} for a model without routed experts. Bytes are in the
    weights' `weight_bytes` per parameter and the model's dtype_bytes per activation element."""
    moe = shape.moe
    if moe is None:
        return {}
    ep, wb = cluster.ep, cluster.weight_bytes
    routed = moe.routed_params * moe.layers
    calls = -(-tokens_per_rank // capture_chunk) * moe.layers  # one gather per MoE layer and capture chunk
    out = {"ep": ep, "experts": moe.experts, "experts_per_token": moe.experts_per_token, "layers": moe.layers,
           "routed_params": routed,
           "weights_per_rank_zero3": int(shape.params * wb / cluster.gpus),
           # None without EP: the routed experts are then ZeRO-3's like every other parameter
           "weights_per_rank_ep": int(routed * wb / ep + (shape.params - routed) * wb / cluster.gpus) if ep > 1
           else None,
           "routed_weights_per_rank_ep": int(routed * wb / ep) if ep > 1 else None,
           "zero3_gather_bytes_per_moe_call": int(moe.block_params * wb),
           "zero3_gather_bytes_per_moe_call_ep": int((moe.block_params - moe.routed_params) * wb),
           "capture_moe_calls": calls,
           "zero3_gather_bytes_capture": int(calls * moe.block_params * wb),
           "zero3_gather_bytes_capture_ep": int(calls * (moe.block_params - moe.routed_params) * wb)}
    pair_bytes = moe.hidden_size * shape.dtype_bytes  # one hidden vector, one way
    both_ways = 2 * moe.experts_per_token * pair_bytes
    leaving = both_ways * (ep - 1) / ep  # uniform routing: (ep - 1) / ep of the pairs live on other ranks
    out.update({"alltoall_bytes_per_layer_token": both_ways, "leaving_fraction": (ep - 1) / ep,
                "alltoall_leaving_bytes_per_layer_token": leaving,
                "alltoall_leaving_bytes_capture": leaving * moe.layers * tokens_per_rank})
    return out


def _max_context(shape: ModelShape, prefix_grad: str, cluster: Cluster, chunk: int, plan: Plan, tier: str, depth: int,
                 keep_attention: bool = False, kept_tier: str | None = None, limit: int = 1 << 40) -> int | None:
    """Longest prompt whose needs fit the budgets (binary search; None when no budget bounds it)."""
    if all(b is None for b in (plan.gpu_budget, plan.host_budget, plan.nvme_budget)):
        return None

    def ok(context: int) -> bool:
        retained = retained_per_rank(shape, context, cluster.cp, prefix_grad, chunk, keep_attention, plan.cp_prefix,
                                     plan.inputs_every, cluster.gpu_memory)
        tokens = captured_tokens_per_rank(context, cluster.cp)
        workspace = _live(phase_workspace(shape, chunk, prefix_grad, cluster.cp, tokens, plan.cp_scan,
                                          cluster.gpu_memory, plan.cp_prefix, keep_attention, plan.inputs_every),
                          plan.replay_graph, plan.trained_grads)
        return _fits(_needs(shape, tokens, retained, tier, depth, kept_tier, workspace), plan)

    if not ok(2):
        return 0
    if ok(limit):
        return None
    lo, hi = 2, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
