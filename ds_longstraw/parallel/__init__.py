"""Process groups and the prompt's layout over them; expert-parallel dispatch.

groups.py   CPContext (the CP process group, its layout of the prompt, traffic counters), as_cp_context, the
            shards and the local-order helpers
experts.py  expert parallelism: routed (token, expert) pairs to the experts' owners by all-to-all and back
Nothing here imports the transaction: ../grpo/cp/ runs the context-parallel schedule over these.
"""

from ds_longstraw.parallel.groups import (
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
