"""The "longstraw" block of a DeepSpeed JSON, typed and validated at the door.

Example (inside the DeepSpeed config)::

    "longstraw": {"enabled": true, "prefix_grad": "exact", "capture_chunk": 8192,
                  "offload": {"tier": "nvme", "nvme_path": "/local_nvme/longstraw"}, "cp_size": 8}

Unknown keys and bad values raise ValueError naming the key, before any work starts.
"""

from typing import Annotated, Any, Literal, TypeVar

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import BaseModel, Field, ValidationError, model_validator

BLOCK_NAME = "longstraw"
_Block = TypeVar("_Block", bound=BaseModel)


class AioConfig(DeepSpeedConfigModel):
    """DeepSpeed async I/O settings for the NVMe tier (same names as DeepSpeed's "aio" block)."""

    block_size: int = Field(1048576, gt=0)
    queue_depth: int = Field(8, gt=0)
    intra_op_parallelism: int = Field(1, gt=0)
    single_submit: bool = False
    overlap_events: bool = True


class OffloadConfig(DeepSpeedConfigModel):
    """Where retained prompt state (and exact-mode gradient pages) live.

    kept_attention_tier: where exact mode's kept attention outputs (prefix_keep_attention) live; None: with the
    other pages (`tier`). They are written once during capture and read once per segment by the prefix pass, so
    a slower tier than the K/V pages' costs little."""

    tier: Literal["none", "cpu", "nvme"] = "none"
    kept_attention_tier: Literal["none", "cpu", "nvme"] | None = None
    nvme_path: str | None = None
    host_memory_budget_gb: float | None = Field(None, gt=0)
    staging_depth: int = Field(1, ge=1)
    aio: AioConfig = Field(default_factory=AioConfig)

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadConfig":
        # Whether the directory exists and is writable is checked when the pool is made (offload/nvme_pool.py).
        if self.tier == "nvme" and not self.nvme_path:
            raise ValueError("nvme_path must name a directory when tier = 'nvme'")
        if self.kept_attention_tier == "nvme" and not self.nvme_path:
            raise ValueError("nvme_path must name a directory when kept_attention_tier = 'nvme'")
        return self

    def kept_attention_pool(self) -> "OffloadConfig | None":
        """Settings of a pool of its own for the kept attention outputs, or None when they share the pages' pool."""
        if self.kept_attention_tier in (None, self.tier):
            return None
        return self.model_copy(update={"tier": self.kept_attention_tier})


class LongstrawConfig(DeepSpeedConfigModel):
    """Settings of the GRPO transaction.

    prefix_grad: "detached" treats the captured prompt state as a constant (the paper's semantics);
        "exact" also back-propagates through the prompt (gradients equal full-sequence autograd).
    capture_chunk: prompt tokens per capture chunk (bounds activation memory of capture).
    prefix_block: exact mode only: prompt tokens per autograd segment of the prefix pass (bounds its live graph;
        capture then runs segments of min(capture_chunk, prefix_block) and checkpoints the layers' carry at each
        segment start). None: capture_chunk.
    prefix_recompute: exact mode only: recompute each layer of a prefix-pass segment during its backward (one
        layer's graph alive instead of the segment's, for one more forward of the prompt), under plain autograd
        and the DeepSpeed engine alike. With context parallelism only together with prefix_keep_attention (a
        layer's remote exchanges must not run twice); otherwise the segment's graph stays (bound it with
        prefix_block).
    prefix_keep_attention: exact mode only: keep from capture what makes the prompt's attention more than linear,
        on pages of offload.kept_attention_tier (default: the pages' tier), reported as retained
        "kept_attention_pages", so the prefix pass never recomputes it. qwen3_5 keeps each token's attention output
        and log-sum-exp ((H D + H) values per token per full-attention layer: (H/K)/2 times the K/V pages under
        GQA), and the prefix pass's forward then costs what the linear layers cost; under context parallelism each
        rank keeps its own tokens' result, merged over every rank's keys, so the prefix pass also skips the remote
        partials (no query leaves the rank in its forward; its backward still sends them to the earlier ranks for
        their keys' gradients). glm_moe_dsa keeps each full indexer layer's selection (index_topk int32 positions
        per token), and the prefix pass scores no prompt key again; one rank only so far. "auto" (the default):
        keep where the kept streams are a selection, on one rank (offload/auto.keeps_attention: GLM yes, Qwen no).
    prefix_keep_graph: exact mode on one rank only: capture runs its first segments WITH autograd and keeps their
        graph, while what that graph saves stays within a budget, so the prefix pass runs no forward for them
        (grpo/kept_graph.py): where the whole prompt's graph fits, the exact step does the work of full-sequence
        autograd and no more, at the prompt's graph and one member's (flat in G, but the prompt's graph is what
        the transaction otherwise never holds). Later segments are captured without a graph and recomputed as
        before. False (the default): none, so the live graph stays one segment's and exact mode's peak within the
        detached step's plus the gradient pages; "fits": within prefix_graph_budget_gb, or KEEP_GRAPH_FRACTION of
        the memory the rank may still take when capture starts (offload/auto.graph_budget); True: every segment's,
        unbounded. ("fits", not "auto": DeepSpeed's config model reads "auto" as the key's default.) Not under
        context parallelism, under a lockstep that pads the calls (ZeRO-3 data parallelism,
        expert parallelism), for a shared document's groups or for a capture reused from generate: those capture
        without a graph.
    prefix_graph_budget_gb: the budget of prefix_keep_graph "fits" in GiB (0: keep none); None: the rule above.
    replay_block: response tokens per replay block (bounds attention score memory of one replay step).
    member_span_capture: a member whose untrained span (response_masks False: a tool output, an observation)
        reaches this many tokens runs in steps (grpo/member_steps.py): a forward without a graph over its response,
        then its steps last to first with autograd, each captured span a step of replay_block tokens, so its graph
        is one step's instead of the whole response's; the gradient is unchanged (the member's own context stays
        exact in both modes). None: every member is replayed whole.
    shared_prefix_min: grpo_backward_shared captures the leading span the step's prompts share (a document several
        questions ask of) once, where it reaches this many tokens and the groups do not say it themselves
        (GRPOGroup.shared_prefix); below it each group captures its whole prompt. Default 1024: one replay
        block's tokens, below which a capture costs about what the tree's bookkeeping saves. None: only where said.
    page_tokens: tokens per page of retained per-token state.
    cp_size: context-parallel ranks the prompt is sharded over; cp_attention: how queries meet remote pages.
    cp_layout: under context parallelism, how the prompt's tokens are laid out over the ranks: "zigzag" (the prompt
        cut into 2 cp_size segments, rank r owning segments r and 2 cp_size - 1 - r: every rank's causal attention
        work is equal, and the capture's page exchange runs on all ranks at once), "contiguous" (one shard per rank:
        the last rank reads every earlier key; the layout before zigzag, kept for comparison), or "auto" (the
        default: zigzag where the schedule runs it, that is with cp_attention "lse", for both families; contiguous
        under Ulysses).
    cp_scan: under context parallelism, how a Gated DeltaNet layer's capture crosses ranks: "one_pass" (the delta rule
        runs once over the shard and its outputs wait for the exchange, [o(0) | q~] over the shard in the model's
        dtype, the planner's "gdn_scan" workspace), "two_pass" (nothing waits: the layer runs again from its true
        initial state, projections included) or "auto" (the default: one_pass where those bytes for the largest
        shard are at most SCAN_HOLD_FRACTION of the device's total memory, or off CUDA; else two_pass; the rule
        reads the prompt, the model and the device type's total memory, so every rank of a job of one GPU type
        decides alike).
    cp_prefix: under context parallelism, how exact mode's prefix pass runs: "layer_major" (every rank at once,
        layer by layer top to bottom, grpo/cp/prefix_layers.py: each rank keeps layer inputs over its shard from
        capture, every prefix_inputs_every-th, on offload.tier, reported as retained "layer_inputs"), "turns" (the
        prompt's segments right to left, one owner at a time while the others answer its requests,
        grpo/cp/prefix_turns.py: memory one chunk's graph; the schedule before layer-major, kept for comparison) or
        "auto" (the default: layer_major where the layer inputs it adds on the pages' tier are at most 1.5x the
        state the transaction keeps there anyway and, on CUDA, what it holds across a layer over the largest
        shard is at most a quarter of the CP group's smallest GPU; offload/auto.layer_major_fits: Qwen3.6-27B and
        GLM-5.2 at their recipes' shapes; turns otherwise).
    prefix_inputs_every: exact mode's layer-major CP prefix pass only: capture keeps the input of every k-th layer
        (layers 0, k, 2k, ...), and the pass recomputes the others of a group of k layers from it, over the shard
        and with the layers' exchanges, into a pool of offload.tier that lives for the group: ceil(L / k) + k - 1
        layers' inputs on the tier instead of L, for about one more forward of the prompt. 1: every layer's; "auto"
        (the default): the smallest k whose added bytes fit the cp_prefix "auto" rule, else the k that adds the
        fewest (offload/auto.inputs_every_for; `longstraw plan` shows the k it takes).
    cp_replay: under context parallelism, who replays the members and how they reach the prompt's pages:
        "spread" (rank r replays members m with m mod cp_size = r; queries travel to the pages' owners and partials
        back, grpo/cp/spread.py: 0.3-0.6x the replicated replay's CPU time summed over ranks, BENCHMARKS.md),
        "gathered" (the same members, but the whole prompt's pages are all-gathered on every rank once and each rank
        replays as one process does, with no exchange per layer and block; exact mode sums the pages' gradients
        back once: grpo/cp/gathered.py), "replicated" (every rank every member, the same bits everywhere; the
        schedule before the spread, kept for comparison) or "auto" (the default: gathered where the whole prompt's
        pages, with their gradient pages in exact mode, take at most GATHER_FRACTION of the device's total memory
        (off CUDA: GATHER_HOST_BYTES), else spread: offload/auto.replay_schedule, decided per prompt).
    ep_size: expert-parallel ranks a MoE layer's routed experts are sharded over (ds_longstraw.shard_experts); with
        cp_size > 1 they are the CP group's ranks (ep_size = cp_size).
    """

    enabled: bool = True
    prefix_grad: Literal["detached", "exact"] = "detached"
    capture_chunk: int = Field(4096, gt=0)
    prefix_block: int | None = Field(None, gt=0)
    prefix_recompute: bool = True
    prefix_keep_attention: bool | Literal["auto"] = "auto"
    prefix_keep_graph: bool | Literal["fits"] = False
    prefix_graph_budget_gb: float | None = Field(None, ge=0)
    replay_block: int = Field(1024, gt=0)
    member_span_capture: int | None = Field(1024, gt=0)
    shared_prefix_min: int | None = Field(1024, gt=0)
    page_tokens: int = Field(1024, gt=0)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    cp_size: int = Field(1, ge=1)
    cp_attention: Literal["lse", "ulysses"] = "lse"
    cp_layout: Literal["auto", "zigzag", "contiguous"] = "auto"
    cp_scan: Literal["auto", "one_pass", "two_pass"] = "auto"
    cp_prefix: Literal["auto", "layer_major", "turns"] = "auto"
    prefix_inputs_every: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    cp_replay: Literal["auto", "gathered", "spread", "replicated"] = "auto"
    ep_size: int = Field(1, ge=1)
    progress: bool = False
    kernels: Literal["auto", "reference"] = "auto"

    @model_validator(mode="after")
    def _ep_over_the_cp_group(self) -> "LongstrawConfig":
        if self.ep_size > 1 and self.cp_size > 1 and self.ep_size != self.cp_size:
            raise ValueError(f"'{BLOCK_NAME}.ep_size' = {self.ep_size} with 'cp_size' = {self.cp_size}: under context "
                             "parallelism the experts are sharded over the CP group (set ep_size = cp_size)")
        return self

    @model_validator(mode="after")
    def _graph_budget_for_fits(self) -> "LongstrawConfig":
        if self.prefix_graph_budget_gb is not None and self.prefix_keep_graph != "fits":
            raise ValueError(f"'{BLOCK_NAME}.prefix_graph_budget_gb' = {self.prefix_graph_budget_gb} with "
                             f"'prefix_keep_graph' = {self.prefix_keep_graph!r}: the budget is that of \"fits\" "
                             "(True keeps every segment's graph, False none)")
        return self

    @property
    def prefix_recompute_runs(self) -> bool:
        """Whether the prefix pass recomputes each layer in backward (prefix_recompute) here: a recomputed layer runs
        its forward twice, so that forward must make no remote exchange: one rank, or the attention kept from
        capture (no rank then sends a forward request). It depends on settings alone, the same on every rank, as
        ZeRO-3 lockstep needs: a recomputed layer gathers its weights again in backward, so real segments and
        padding iterations must be recomputed alike on every rank."""
        return self.prefix_recompute and (self.cp_size == 1 or self.prefix_keep_attention is True)

    @property
    def segment_tokens(self) -> int:
        """Prompt tokens per capture forward: capture_chunk, capped by prefix_block in exact mode (whose
        prefix pass recomputes one such segment at a time with autograd, from the carry checkpointed at its
        start)."""
        if self.prefix_grad == "exact" and self.prefix_block is not None:
            return min(self.capture_chunk, self.prefix_block)
        return self.capture_chunk


def describe_errors(error: ValidationError, block: str) -> str:
    """pydantic's errors as one line naming each key of `block` (and the value it was given)."""
    parts = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if not key or message.startswith(f"'{block}."):  # a check across keys, or one that names its key itself
            parts.append(message)
        elif item["type"] == "missing":
            parts.append(f"'{block}.{key}' is required")
        else:
            parts.append(f"'{block}.{key}' = {item.get('input')!r}: {message}")
    return "; ".join(parts)


def parse_block(model: type[_Block], value: _Block | dict[str, Any], block: str, noun: str = "block") -> _Block:
    """A dict (the JSON / YAML block) or an instance of `model` -> a validated instance (ValueError naming the key
    otherwise)."""
    if isinstance(value, model):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"the '{block}' block must be a dict, got {type(value).__name__}")
    try:
        return model(**value)
    except ValidationError as error:
        raise ValueError(f"invalid '{block}' {noun}: {describe_errors(error, block)}") from None


def parse_config(longstraw: LongstrawConfig | dict[str, Any] | None) -> LongstrawConfig:
    """Turn a dict (the JSON block), a LongstrawConfig or None into a validated LongstrawConfig."""
    return LongstrawConfig() if longstraw is None else parse_block(LongstrawConfig, longstraw, BLOCK_NAME)
