"""Layer kinds: each way a layer's work crosses context-parallel ranks, one folder each (base.py says the contract).

attention/   "lse"          attention over pages, partials merged by log-sum-exp
scan/        "affine_scan"  a recurrence folded across ranks in prompt order
sparse/      "topk_lse"     sparse attention over a global top-k selection
"""

from ds_longstraw.grpo.cp.kinds import attention, scan, sparse  # noqa: F401  (each registers its kind)
from ds_longstraw.grpo.cp.kinds.base import (
    KINDS,
    CaptureFrame,
    LayerKind,
    LayerMajorFrame,
    PageRequest,
    ShardFrame,
    kind_of,
    kinds_in,
    register_kind,
    unregister_kind,
    unrun,
)

__all__ = ["KINDS", "CaptureFrame", "LayerKind", "LayerMajorFrame", "PageRequest", "ShardFrame", "kind_of",
           "kinds_in", "register_kind", "unregister_kind", "unrun"]
