"""What a layer retains for later tokens, declared by its architecture adapter (never read off the modules).

Generic code (capture, replay, the prefix pass, the context-parallel schedule, the planner) asks these specs what to
keep and how, so it names no layer type of any family:

  Stream     a per-token tensor on pages: name, per-token shape, dtype, and whether exact mode accumulates its
             gradient on gradient pages (a stream that no loss path reaches, say a gradient-free indexer key, has
             none: no gradient pages are allocated or written for it)
  Carry      a per-sequence tensor carried from one segment to the next (a recurrent state, a conv tail)
  LayerState one layer: its streams, its carry, and how its work combines across context-parallel ranks:
               "lse"          attention over pages; partial results of key shards merge by log-sum-exp
               "affine_scan"  a recurrence whose segment map is affine in the carry; ranks fold summaries in order
               "topk_lse"     sparse attention over a selection of pages (DSA): the ranks' candidates merge into
                              one global top-k, then the selected rows' partials merge by log-sum-exp
               "none"         nothing crosses ranks (the layer retains nothing)
             `select` ("topk_lse" only): the streams the layer's selection scores keys with; empty: the layer
             reuses the selection of the last earlier layer that selects (its other streams are the rows attended)
             `kept`: what exact mode's prefix_keep_attention keeps per token for this layer (its attention output
             and log-sum-exp), so the prefix pass can skip the layer's attention
  SparseGeometry  what a "topk_lse" layer's cross-rank messages carry per query token (the adapter's
             sparse_geometry), so a receiver allocates them without knowing the family

The specs are built from a config alone (no weights), so `longstraw plan` sizes any supported model from the same
source as the transaction.
"""

from dataclasses import dataclass

import torch

from ds_longstraw.offload.kind_costs import AttentionCost, KindCost, ScanCost, SparseCost


@dataclass(frozen=True)
class CombineRule:
    """The static facts of one way a layer's work crosses context-parallel ranks, what the topology and the planner
    decide by before any module runs (the cross-rank code itself is the rule's layer kind, grpo/cp/kinds/):

    zigzag        runs on zigzag shards (two pieces a rank); False: contiguous shards only
    layer_major   exact mode's layer-major prefix pass runs it (else the turns)
    recurrent     a carry folded across ranks in prompt order (the capture may hold the scan's outputs)
    selects       attends a global top-k selection that a later layer may reuse (`select` empty)
    cost          its bytes for the planner and its seconds for the CP time model (offload/kind_costs.py)
    """

    name: str
    zigzag: bool = True
    layer_major: bool = True
    recurrent: bool = False
    selects: bool = False
    cost: KindCost = KindCost()


# name -> its rule; register_combine_rule adds one (a new layer kind: its rule here with its cost, its cross-rank
# code as a grpo/cp/kinds/ layer kind of the same name)
COMBINE_RULES: dict[str, CombineRule] = {}


def register_combine_rule(rule: CombineRule) -> CombineRule:
    """Add `rule` (ValueError where another rule has its name)."""
    if COMBINE_RULES.get(rule.name, rule) != rule:
        raise ValueError(f"combine rule {rule.name!r} is already registered as {COMBINE_RULES[rule.name]}")
    COMBINE_RULES[rule.name] = rule
    return rule


def combine_rule(name: str) -> CombineRule:
    """The registered rule called `name`; ValueError naming the registered ones otherwise."""
    rule = COMBINE_RULES.get(name)
    if rule is None:
        raise ValueError(f"combine rule {name!r} is not registered (registered: {sorted(COMBINE_RULES)})")
    return rule


for _rule in (CombineRule("lse", cost=AttentionCost()), CombineRule("affine_scan", recurrent=True, cost=ScanCost()),
              CombineRule("topk_lse", selects=True, cost=SparseCost()),
              # nothing crosses ranks; the layer-major pass has no layer code for it
              CombineRule("none", layer_major=False)):
    register_combine_rule(_rule)


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple  # of one item: a token for a Stream, a sequence for a Carry
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one item."""
        return _nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class Stream(_Tensor):
    grad: bool = True  # exact mode: d(stream) accumulates on gradient pages
    label: str = ""  # what its bytes are reported as, when not its layer's label

    bytes_per_token = _Tensor.nbytes


@dataclass(frozen=True)
class Carry(_Tensor):
    pass


@dataclass(frozen=True)
class LayerState:
    layer: int
    kind: str  # the family's name for the layer type (reports only)
    label: str  # what its retained bytes are reported as ("attention_kv_pages", "gdn_state", ...)
    streams: tuple = ()  # Stream, token-major pages
    carry: tuple = ()  # Carry, per sequence
    combine: str = "none"
    kept: tuple = ()  # Stream, exact mode's prefix_keep_attention
    select: tuple = ()  # "topk_lse": names of the streams its selection scores (empty: reuses the last selection)

    def __post_init__(self):
        rule = combine_rule(self.combine)
        assert not self.select or (rule.selects and set(self.select) <= set(self.stream_names)), self.select

    @property
    def rule(self) -> CombineRule:
        return combine_rule(self.combine)

    @property
    def reuses_selection(self) -> bool:
        """Whether the layer attends the selection of the last earlier layer that selects (it makes none)."""
        return self.rule.selects and not self.select

    def stream_label(self, stream) -> str:
        return stream.label or self.label

    @property
    def stream_names(self) -> tuple:
        return tuple(s.name for s in self.streams)

    @property
    def row_names(self) -> tuple:
        """The streams attention reads ("topk_lse": those its selection does not score)."""
        return tuple(name for name in self.stream_names if name not in self.select)

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.streams)

    @property
    def carry_bytes(self) -> int:
        return sum(c.nbytes for c in self.carry)

    @property
    def kept_bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.kept)


@dataclass(frozen=True)
class SparseGeometry:
    """What a "topk_lse" layer's exchanges carry per query token (what a receiver allocates): each entry a
    (shape, dtype). selector: what its selection scores keys with (sent to the keys' owners); query: what attention
    over selected rows reads (sent to the rows' owners); out: a partial's output, whose log-sum-exp is out's shape
    without its last dimension, in lse_dtype; candidates are (score in score_dtype, position) pairs, at most topk
    per query."""

    selector: tuple
    query: tuple
    out: tuple
    lse_dtype: torch.dtype
    score_dtype: torch.dtype
    topk: int


def _nbytes(shape, dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def paged_layers(specs) -> list:
    """Layers that keep per-token pages, in order."""
    return [s.layer for s in specs if s.streams]


def carry_layers(specs) -> list:
    """Layers that carry per-sequence state, in order."""
    return [s.layer for s in specs if s.carry]


def stream_names(specs, last_layer=True) -> dict:
    """layer -> the names of its streams, for every paged layer in order (what a stager walks); last_layer False:
    not the last layer's (a capture or prefix pass whose last layer computes only its rows attends no past there,
    grpo/state.PrefixState.last_layer_whole)."""
    last = specs[-1].layer if specs else None
    return {s.layer: s.stream_names for s in specs if s.streams and (last_layer or s.layer != last)}
