"""Owned pages of retained prompt state and the tiers they live on (installed as ``ds_longstraw.offload``)."""

from .factory import make_pool
from .host_pool import HostPagePool
from .io_engine import PageFileError
from .nvme_pool import NvmePagePool
from .page_table import PageEntry, PageTable
from .pages import PagePool
from .staged_past import ChainedPast, StagedPast, node_past, staged_saves
from .stager import Stager
from .states import PageState

__all__ = ["HostPagePool", "NvmePagePool", "PageEntry", "PageFileError", "PagePool", "PageState", "PageTable",
           "ChainedPast", "StagedPast", "Stager", "make_pool", "node_past", "staged_saves"]
