"""What the plan and the "auto" rules need of a model: its per-token and per-sequence bytes by label, its layers'
kinds and combines, what the kernels' workspaces scale with. Built from the architecture's layer-state specs by
models/model_shape.py (a transformers config, or the adapter of a running model)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEShape:
    """A model's routed experts, as the plan needs them (the architecture's expert_shape)."""

    experts: int  # routed experts per MoE layer
    experts_per_token: int  # k: routed (token, expert) pairs per token
    hidden_size: int  # the vector a pair sends
    layers: int  # MoE layers
    routed_params: int  # per MoE layer: the routed experts' parameters
    block_params: int  # per MoE layer: the whole block's (router, routed and shared experts)


@dataclass
class ModelShape:
    """What the plan needs of a model: bytes by label (the keys of PrefixState.retained_bytes()), built from the
    architecture's layer-state specs (ds_longstraw.models.model_shape)."""

    name: str
    family: str
    dtype_bytes: int
    page_bytes_per_token: dict = field(default_factory=dict)  # label -> bytes per token, all layers of it
    page_layers: dict = field(default_factory=dict)  # label -> layers that keep it
    grad_bytes_per_token: int = 0  # exact mode: streams whose gradient accumulates on gradient pages
    staged_layer_bytes_per_token: int = 0  # the largest layer's pages: one staged layer
    carry_bytes: dict = field(default_factory=dict)  # label -> bytes per sequence, all layers of it
    carry_layers: dict = field(default_factory=dict)  # label -> layers that carry it
    kept_bytes_per_token: int = 0  # exact mode's prefix_keep_attention, all layers
    kept_layers: int = 0
    # of those, the last layer's: a one-rank capture runs that layer for its rows alone and keeps none of it
    # (grpo/state.PrefixState.last_layer_whole)
    kept_last_bytes_per_token: int = 0
    layer_counts: dict = field(default_factory=dict)  # the family's layer kinds -> layers
    combine_counts: dict = field(default_factory=dict)  # how layers cross CP ranks (the specs' combine) -> layers
    # the combines among them that exact mode's layer-major prefix pass does not run (arch/specs.CombineRule)
    not_layer_major: tuple = ()
    params: int = 0
    moe: MoEShape | None = None  # None: no routed experts
    # what the kernels' workspaces scale with (0: the model has no such layer)
    vocab_size: int = 0
    hidden_size: int = 0
    attention_heads: int = 0
    attention_head_dim: int = 0  # per query head as the kernel sees it (absorbed MLA: latent + rope)
    attention_kv_heads: int = 0  # key/value heads of paged dense attention (0: none, e.g. absorbed MLA)
    delta_heads: int = 0  # gated delta rule value heads
    delta_head_dims: int = 0  # key + value head dims
    selecting: tuple = ()  # the layers that make a top-k selection (the others of their family reuse it)
    reusing: tuple = ()  # the layers that reuse the last selection made below them
    select_topk: int = 0  # rows a query attends under a top-k selection (0: no such layer)
    index_width: int = 0  # the selection's scorer: indexer heads x head dim
    # a replayed member's autograd graph: {"lora" | "full": (bytes per response token, bytes per member)}, the
    # family's (arch.replay_graph); empty where the family declares none
    replay_graph: dict = field(default_factory=dict)
    # combine rule -> its cost under context parallelism (offload/kind_costs.py), for the rules of combine_counts
    # that declare one (arch/specs.CombineRule.cost)
    kind_costs: dict = field(default_factory=dict)

    def kept_per_rank(self, cp: int) -> tuple[int, int]:
        """(layers, bytes per token) of the attention each rank keeps for exact mode's prefix pass
        (prefix_keep_attention): on one rank not the last layer's."""
        if cp == 1 and self.kept_last_bytes_per_token:
            return self.kept_layers - 1, self.kept_bytes_per_token - self.kept_last_bytes_per_token
        return self.kept_layers, self.kept_bytes_per_token

    @property
    def select_layers(self) -> int:
        return len(self.selecting)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.page_bytes_per_token.values())

    @property
    def carry_total(self) -> int:
        return sum(self.carry_bytes.values())

    @property
    def active_params(self) -> float:
        """The parameters a prompt token runs through: all but the embeddings and the head (untied), the routed
        experts at k of their count."""
        dense = self.params - 2 * self.vocab_size * self.hidden_size
        if self.moe:
            moe = self.moe
            dense -= moe.layers * moe.routed_params * (1 - moe.experts_per_token / moe.experts)
        return dense
