"""The page state machine: which moves a page (or a staged copy of pages) may make, checked on every move.

A page of a host or NVMe tier lives through

    FREE --first token--> FILLING --page sealed, copy/write submitted--> IN_FLIGHT --done and verified--> RESIDENT
                             ^                                                                            |
                             +--------------- gradient page re-opened to accumulate more -----------------+
    any state but IN_FLIGHT --release--> RELEASED

A page is never released while I/O on its buffer is in flight: the owner drains the I/O first (a buffer freed
under a running write would be written to disk as garbage, or read into freed memory).

A staged copy (pages read back to the compute device for one layer's turn) lives through
FREE -> IN_FLIGHT -> RESIDENT -> RELEASED, and may be released straight from IN_FLIGHT only by its owner after
waiting (the stager drops a read-ahead that the walk no longer needs).

Transitions are checked with a raised AssertionError, not `assert`, so they stay checked under `python -O`: a
wrong move is a bug in this package, never a user error.
"""

from enum import Enum
from typing import Any


class PageState(Enum):
    FREE = "free"
    FILLING = "filling"
    IN_FLIGHT = "in flight"
    RESIDENT = "resident"
    RELEASED = "released"


_S = PageState

PAGE_TRANSITIONS = {
    _S.FREE: {_S.FILLING, _S.RELEASED},
    _S.FILLING: {_S.IN_FLIGHT, _S.RELEASED},
    _S.IN_FLIGHT: {_S.RESIDENT},
    _S.RESIDENT: {_S.FILLING, _S.RELEASED},
    _S.RELEASED: set(),
}

STAGING_TRANSITIONS = {
    _S.FREE: {_S.IN_FLIGHT, _S.RELEASED},
    _S.IN_FLIGHT: {_S.RESIDENT, _S.RELEASED},
    _S.RESIDENT: {_S.RELEASED},
    _S.RELEASED: set(),
}


def advance(item: Any, new: PageState, transitions: dict[PageState, set[PageState]] = PAGE_TRANSITIONS) -> None:
    """Move `item.state` to `new`; raise AssertionError (naming the item) on a move the table forbids."""
    old = item.state
    if new not in transitions[old]:
        raise AssertionError(f"illegal page transition {old.value} -> {new.value} for {item!r}")
    item.state = new
