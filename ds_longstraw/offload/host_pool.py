"""The host tier: pages in (pinned where possible) host memory, read back to the compute device on demand.

Each stream is one host arena reserved at its full length (pinning is expensive per allocation, so one per
stream rather than one per page); the page table tracks its pages through the state machine. Copies in both
directions are synchronous here: a page is RESIDENT as soon as its copy returns, and a read returns a fresh
tensor on the compute device. What is not done: asynchronous device copies on a side stream (the stager still
issues reads one layer ahead, but on CUDA the copy itself runs when issued).
"""

import torch

from .page_table import PageEntry
from .pinning import host_empty, host_zeros
from .states import PageState, advance
from .tiered import ReadTicket, StreamInfo, TieredPagePool


class HostPagePool(TieredPagePool):
    tier = "cpu"

    def __init__(self, page_tokens: int, device: torch.device | str | None = None, rank: int = 0,
                 staging_depth: int = 1, host_budget_bytes: int | None = None) -> None:
        super().__init__(page_tokens, device, rank, staging_depth)
        self.host_budget_bytes = host_budget_bytes
        self._arenas: dict[tuple, torch.Tensor] = {}
        self.pinned = True  # all arenas pinned so far

    def _create_stream(self, info: StreamInfo, kind: str) -> None:
        nbytes = info.tokens * info.token_bytes
        if self.host_budget_bytes is not None and self.host_bytes() + nbytes > self.host_budget_bytes:
            raise ValueError(
                f"offload.host_memory_budget_gb = {self.host_budget_bytes / 2**30:.3f} GiB is too small: the host tier "
                f"holds {self.host_bytes()} B and stream ({info.layer}, {info.name!r}, {kind}) needs {nbytes} B more "
                f"(raise the budget, or use offload.tier = 'nvme')")
        make = host_zeros if kind == "grad" else host_empty
        arena, pinned = make((info.tokens, *info.shape), info.dtype)
        self.pinned = self.pinned and (pinned or nbytes == 0)
        self._arenas[(info.layer, info.name, kind)] = arena

    def host_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._arenas.values())

    def _write_state(self, info: StreamInfo, start: int, values_cpu: torch.Tensor) -> None:
        arena = self._arenas[(info.layer, info.name, "state")]
        end = start + values_cpu.shape[0]
        arena[start:end].copy_(values_cpu)
        for entry in self.table.lookup(info.layer, info.name, start, end):
            if entry.state is not PageState.FILLING:  # FREE, or RESIDENT: re-opened by an append after flush()
                advance(entry, PageState.FILLING)
            entry.filled = min(end, entry.end) - entry.start
            if entry.filled == entry.end - entry.start:
                self._seal(entry)

    @staticmethod
    def _seal(entry: PageEntry) -> None:
        advance(entry, PageState.IN_FLIGHT)
        advance(entry, PageState.RESIDENT)  # the host copy above was synchronous

    def _read(self, info: StreamInfo, kind: str, start: int, end: int) -> ReadTicket:
        arena = self._arenas[(info.layer, info.name, kind)]
        out = torch.empty((end - start, *info.shape), dtype=info.dtype, device=self.device)
        out.copy_(arena[start:end])
        return ReadTicket(f"tokens [{start}, {end}) of ({info.layer}, {info.name!r}, {kind}) from host", lambda: out)

    def _accumulate_grad(self, info: StreamInfo, start: int, grad_cpu: torch.Tensor) -> None:
        arena = self._arenas[(info.layer, info.name, "grad")]
        end = start + grad_cpu.shape[0]
        for entry in self.table.lookup(info.layer, info.name, start, end, "grad"):
            advance(entry, PageState.FILLING)  # FREE -> FILLING, or RESIDENT -> FILLING (re-opened)
        arena[start:end].add_(grad_cpu)
        for entry in self.table.lookup(info.layer, info.name, start, end, "grad"):
            entry.filled = entry.end - entry.start
            self._seal(entry)

    def _accumulate_grad_rows(self, info: StreamInfo, rows: torch.Tensor, grad_cpu: torch.Tensor) -> None:
        """The rows added where they lie in the arena (no dense span); only the pages holding one are re-opened."""
        arena = self._arenas[(info.layer, info.name, "grad")]
        arena.index_add_(0, rows, grad_cpu)
        for page in torch.unique_consecutive(rows // self.page_tokens).tolist():
            first = page * self.page_tokens
            for entry in self.table.lookup(info.layer, info.name, first, min(info.tokens, first + self.page_tokens),
                                           "grad"):
                advance(entry, PageState.FILLING)
                entry.filled = entry.end - entry.start
                self._seal(entry)

    def _flush(self) -> None:
        for entry in self.table.all_entries():
            if entry.state is PageState.FILLING:
                self._seal(entry)

    def _free(self) -> None:
        self._arenas.clear()
