"""make_pool: the page pool an `offload` config block asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .host_pool import HostPagePool
from .nvme_pool import NvmePagePool
from .pages import PagePool

if TYPE_CHECKING:
    import torch


def _budget_bytes(offload_config: Any) -> int | None:
    gb = getattr(offload_config, "host_memory_budget_gb", None)
    return None if gb is None else int(gb * 2**30)


def make_pool(offload_config: Any, page_tokens: int, device: torch.device | str | None = None,
              rank: int = 0) -> PagePool | HostPagePool | NvmePagePool:
    """A pool for one rank's retained state: tier "none" keeps pages on the compute device, "cpu" in host
    memory, "nvme" in files under `nvme_path`. `offload_config` is an OffloadConfig (or None for "none")."""
    tier = "none" if offload_config is None else offload_config.tier
    depth = 1 if offload_config is None else offload_config.staging_depth
    if tier == "none":
        return PagePool(page_tokens, device=device, rank=rank, staging_depth=depth)
    if tier == "cpu":
        return HostPagePool(page_tokens, device=device, rank=rank, staging_depth=depth,
                            host_budget_bytes=_budget_bytes(offload_config))
    if tier == "nvme":
        return NvmePagePool(page_tokens, device=device, rank=rank, staging_depth=depth,
                            nvme_path=offload_config.nvme_path, aio_config=offload_config.aio,
                            host_budget_bytes=_budget_bytes(offload_config))
    raise ValueError(f"offload.tier must be 'none', 'cpu' or 'nvme', got {tier!r}")
