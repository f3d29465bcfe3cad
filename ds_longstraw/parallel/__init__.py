"""Context parallelism: explicit process groups, attention across ranks' pages, the prefix pass in turns.

groups.py        CPContext (the CP process group, its layout of the prompt, traffic counters), as_cp_context
cp_attention.py  (out, lse) partials across ranks: capture (pages or queries travel), replay (all-gather), grads
cp_sparse.py     the "topk_lse" combine: a global top-k selection from every rank's candidates, the selected rows'
                 partials computed where the rows live, merged by log-sum-exp
ulysses.py       the capture's head/sequence all-to-all alternative for attention
capture.py       layer-major capture of a sharded prompt (each layer's combine from its spec)
prefix.py        exact mode's prefix pass, ranks in turn, remote pages served by their owners
spread.py        the replay spread over the CP group (each rank its own members: queries out, partials back)
experts.py       expert parallelism: routed (token, expert) pairs to the experts' owners by all-to-all and back
The transaction runs over these through ../topology.py (ContextParallel); a family's own cross-rank math (the
Gated DeltaNet state scan) lives with its adapter in ../arch/.
"""

from .groups import (
    CP_LAYOUTS,
    CPContext,
    as_cp_context,
    local_spans,
    segments_in_order,
    shard_bounds,
    shard_pieces,
    visible_prefix,
)

__all__ = ["CP_LAYOUTS", "CPContext", "as_cp_context", "local_spans", "segments_in_order", "shard_bounds",
           "shard_pieces", "visible_prefix"]
