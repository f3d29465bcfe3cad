"""Owned pages of retained prompt state and the tiers they live on (installed as ``ds_longstraw.offload``)."""

from .pages import PagePool, PageKey

__all__ = ["PagePool", "PageKey"]
