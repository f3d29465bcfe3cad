"""Page bookkeeping in plain Python, without hardware: the page table, the page state machine, read tickets, the
stager's window, and the buffer cache. Each test walks the bookkeeping step by step and asserts the counts."""

import pytest
import torch

from ds_longstraw.offload import PageState, PageTable, Stager
from ds_longstraw.offload.buffers import BufferCache
from ds_longstraw.offload.states import STAGING_TRANSITIONS, advance
from ds_longstraw.offload.tiered import ReadTicket

S = PageState


@pytest.mark.parametrize("tokens,page", [(0, 4), (1, 4), (4, 4), (17, 4), (63, 5), (111, 7)])
def test_page_table_covers_every_token_once(tokens, page):
    table = PageTable(page, rank=3)
    table.add_stream(2, "k", "state", tokens)
    entries = table.entries(2, "k")
    assert len(entries) == -(-tokens // page)
    covered = [t for e in entries for t in range(e.start, e.end)]
    assert covered == list(range(tokens))
    assert all(e.rank == 3 and e.layer == 2 and e.state is S.FREE for e in entries)


@pytest.mark.parametrize("a,b", [(0, 0), (0, 1), (3, 9), (5, 10), (9, 10), (0, 10), (4, 5)])
def test_page_table_lookup_returns_exactly_the_overlapping_pages(a, b):
    table = PageTable(5)
    table.add_stream(0, "v", "state", 10)
    found = table.lookup(0, "v", a, b)
    expected = [e for e in table.entries(0, "v") if e.start < b and e.end > a]
    assert found == expected


def test_page_table_rejects_bad_ranges_and_duplicates():
    table = PageTable(4)
    table.add_stream(0, "k", "state", 10)
    with pytest.raises(ValueError, match="outside stream"):
        table.lookup(0, "k", 3, 11)
    with pytest.raises(ValueError, match="already"):
        table.add_stream(0, "k", "state", 10)
    with pytest.raises(ValueError, match="kind"):
        table.add_stream(0, "k", "moments", 10)
    with pytest.raises(KeyError, match="no stream"):
        table.lookup(1, "k", 0, 1)
    with pytest.raises(ValueError, match="page_tokens"):
        PageTable(0)


def test_page_life_cycle_counts():
    """free -> filling -> in flight -> resident -> released, with the table's counts after each step."""
    table = PageTable(4)
    table.add_stream(0, "k", "state", 10)  # pages of 4, 4, 2 tokens
    a, b, c = table.entries(0, "k")
    assert table.counts() == {S.FREE: 3}
    advance(a, S.FILLING)
    advance(b, S.FILLING)
    assert table.counts() == {S.FREE: 1, S.FILLING: 2}
    advance(a, S.IN_FLIGHT)
    assert table.counts() == {S.FREE: 1, S.FILLING: 1, S.IN_FLIGHT: 1}
    with pytest.raises(AssertionError, match="in flight -> released"):
        table.release_all()  # never release a page whose I/O is running
    advance(a, S.RESIDENT)
    advance(a, S.FILLING)  # a gradient page re-opened to accumulate more
    advance(a, S.IN_FLIGHT)
    advance(a, S.RESIDENT)
    table.release_all()
    assert table.counts() == {S.RELEASED: 3}


@pytest.mark.parametrize("old,new", [(S.FREE, S.RESIDENT), (S.FREE, S.IN_FLIGHT), (S.FILLING, S.RESIDENT),
                                     (S.IN_FLIGHT, S.FILLING), (S.IN_FLIGHT, S.RELEASED), (S.RELEASED, S.FREE),
                                     (S.RESIDENT, S.IN_FLIGHT)])
def test_forbidden_transitions_raise(old, new):
    table = PageTable(4)
    table.add_stream(1, "k", "grad", 4)
    entry = table.entries(1, "k", "grad")[0]
    entry.state = old
    with pytest.raises(AssertionError, match="illegal page transition"):
        advance(entry, new)
    assert entry.state is old


def test_read_ticket_states():
    calls = []
    ticket = ReadTicket("test read", lambda: calls.append(1) or torch.ones(2))
    assert ticket.state is S.IN_FLIGHT
    assert torch.equal(ticket.result(), torch.ones(2)) and ticket.state is S.RESIDENT
    ticket.result()
    assert calls == [1]  # waited once
    ticket.release()
    assert ticket.state is S.RELEASED
    with pytest.raises(AssertionError, match="released"):
        ticket.result()
    dropped = ReadTicket("dropped in flight", lambda: calls.append(2) or torch.zeros(1))
    dropped.release()  # completes the transfer before letting go of it
    assert calls == [1, 2] and dropped.state is S.RELEASED
    item = ReadTicket("x", lambda: None)
    item.state = S.RESIDENT
    with pytest.raises(AssertionError):
        advance(item, S.IN_FLIGHT, STAGING_TRANSITIONS)


class _FakePool:
    """Counts reads; results are tagged tensors (copies, as a host or NVMe tier returns)."""

    copies_on_read = True
    staging_depth = 1

    def __init__(self):
        self.issued = []
        self.tickets = []

    def begin_read(self, layer, name, start, end):
        self.issued.append((layer, name, start, end))
        ticket = ReadTicket(f"{layer}{name}", lambda: torch.full((end - start,), float(layer)))
        self.tickets.append(ticket)
        return ticket


def _live(pool):
    return sum(t.state is not S.RELEASED for t in pool.tickets)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_stager_reads_ahead_and_releases_behind(depth):
    pool = _FakePool()
    layers = [3, 7, 11, 15, 19]
    stager = Stager(pool, layers, names=("k",), depth=depth)
    for layer in layers:
        got = stager.get(layer, 0, 6)["k"]
        assert torch.equal(got, torch.full((6,), float(layer)))
        # this layer plus `depth` ahead (fewer at the end): never more than depth + 1 staged layers
        assert _live(pool) == min(depth + 1, len(layers) - layers.index(layer))
    assert len(pool.issued) == len(layers)  # each layer read exactly once on a forward walk
    assert stager.peak_staged <= depth + 1
    # Backward walks the layers in reverse: the read-ahead follows the direction.
    for layer in reversed(layers[:-1]):
        stager.get(layer, 0, 6)
        assert _live(pool) <= depth + 1
    issued_back = [layer for layer, *_ in pool.issued[len(layers):]]
    assert sorted(set(issued_back)) == sorted(set(layers[:-1]))
    stager.close()
    assert _live(pool) == 0


def test_stager_wraps_for_repeated_walks():
    pool = _FakePool()
    layers = [1, 5, 9]
    stager = Stager(pool, layers, names=("k", "v"), depth=1, wrap=True)
    for _ in range(3):  # three replay blocks
        for layer in layers:
            stager.get(layer, 0, 4)
    # Every walk reads each layer once; the wrap reads the first layer of the next walk ahead (the last walk's
    # wrap read goes unused): 3 + 1 layers on the first walk, 3 on each later one, for k and v.
    assert len(pool.issued) == 2 * (4 + 3 + 3)
    assert _live(pool) <= 2 * 2
    stager.close()


def test_stager_drops_read_ahead_of_another_range():
    pool = _FakePool()
    stager = Stager(pool, [0, 4, 8], names=("k",), depth=1)
    for layer in (0, 4, 8):  # capture chunk 1 attends to tokens [0, 5)
        stager.get(layer, 0, 5)
    stager.get(0, 0, 9)  # chunk 2 restarts the walk with a longer range
    assert pool.issued == [(0, "k", 0, 5), (4, "k", 0, 5), (8, "k", 0, 5), (0, "k", 0, 9), (4, "k", 0, 9)]
    assert _live(pool) == 2  # layer 0 and the read-ahead of layer 4 for [0, 9); every [0, 5) copy released
    stager.close()


def test_stager_owner_of_tracks_only_live_copies():
    pool = _FakePool()
    stager = Stager(pool, [0, 1], names=("k",), depth=0)
    k0 = stager.get(0, 0, 3)["k"]
    assert stager.owner_of(k0) == ((0, 0, 3), "k")
    assert stager.owner_of(k0[1:]) == ((0, 0, 3), "k")  # views share the storage
    assert stager.owner_of(torch.zeros(3)) is None
    stager.close()


def test_buffer_cache_reuses_and_bounds():
    frees = []
    cache = BufferCache(1024, alloc=lambda n: torch.empty(n, dtype=torch.uint8), free=frees.append,
                        max_cached_bytes=4096)
    a = cache.take(100)
    assert a.numel() == 1024
    cache.give(a)
    b = cache.take(1000)
    assert b is a  # reused
    c = cache.take(3000)
    assert c.numel() == 3072 and cache.bytes_held() == 4096
    with pytest.raises(AssertionError, match="twice"):
        cache.give(torch.empty(1024, dtype=torch.uint8))
    cache.give(b)
    cache.give(c)
    d = cache.take(5000)  # nothing cached fits: a new buffer
    cache.give(d)  # over the bound: the oldest cached buffers are freed
    assert sum(x.numel() for x in frees) >= 1024
    cache.close()
    assert cache.bytes_held() == 0
