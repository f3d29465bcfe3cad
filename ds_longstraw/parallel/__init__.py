"""Context parallelism: explicit process groups, attention across ranks' pages, the GDN state scan.

groups.py        CPContext (the CP process group, shard bounds, traffic counters), as_cp_context
cp_attention.py  (out, lse) partials across ranks: capture (pages or queries travel), replay (all-gather), grads
gdn_scan.py      Gated DeltaNet segment transitions [B | P], the exclusive combine, conv tails across ranks
capture.py       layer-major capture of a sharded prompt
prefix.py        exact mode's prefix pass, ranks in turn, remote pages served by their owners
transaction.py   the CP transaction (grpo_backward dispatches here when cp_size > 1)
"""

from .groups import CPContext, as_cp_context, shard_bounds

__all__ = ["CPContext", "as_cp_context", "shard_bounds"]
