"""MlaPageManager: free / used / cached states, LRU eviction of cached pages only."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import BudgetTooSmallError, CacheFullError, IntegrityError
from tokenspeed.cache.keys import keys_to_ints
from tokenspeed.cache.mla_pages import SINK_PAGE, MlaPageManager


def _index(pages: MlaPageManager) -> dict[int, int]:
    """The L1 index as {key: page id}."""
    keys, pids = pages.index.items()
    return dict(zip(keys_to_ints(keys), pids.tolist(), strict=True))


def test_unpinned_pages_are_cached_if_indexed_else_freed():
    pages = MlaPageManager(9)
    ids = pages.allocate(4, None)
    assert SINK_PAGE not in ids
    for i, pid in enumerate(ids[:2]):
        assert pages.register(pid, 100 + i, i)
    pages.unpin(ids)
    assert (pages.num_free, pages.num_cached, pages.num_used) == (6, 2, 0)
    assert pages.lookup([100, 101, 102]) == [ids[0], ids[1], None]
    pages.check_integrity(Counter())


def test_eviction_is_lru_tail_first_and_writes_back_before_reuse():
    pages = MlaPageManager(5)
    ids = pages.allocate(4, None)
    for i, pid in enumerate(ids):
        pages.register(pid, 10 + i, i)
    pages.unpin(ids[2:])  # released first: older
    pages.unpin(ids[:2])
    order = []
    for _ in range(4):
        assert pages.evict(1, lambda p, k, pos: order.append((p, keys_to_ints(k), pos))) == 1
    # Within one release the tail goes first; earlier releases go before later ones.
    assert order == [
        ([ids[3]], [13], [3]),
        ([ids[2]], [12], [2]),
        ([ids[1]], [11], [1]),
        ([ids[0]], [10], [0]),
    ]
    assert pages.num_free == 4
    pages.check_integrity(Counter())


def test_a_write_back_that_raises_leaves_the_victims_cached_and_evictable():
    pages = MlaPageManager(5)
    ids = pages.allocate(4, None)
    for i, pid in enumerate(ids):
        pages.register(pid, 10 + i, i)
    pages.unpin(ids)

    def failing(pids, keys, positions):
        raise RuntimeError("device read failed")

    with pytest.raises(RuntimeError):
        pages.evict(2, failing)
    with pytest.raises(RuntimeError):
        pages.allocate(3, failing)  # 1 free: evicts 2, whose write-back fails
    assert (pages.num_free, pages.num_cached) == (0, 4)
    pages.check_integrity(Counter())
    # Still evictable, least recently used first (the table's tail).
    order = []
    assert pages.evict(4, lambda p, k, pos: order.extend(keys_to_ints(k))) == 4
    assert order == [13, 12, 11, 10]
    pages.check_integrity(Counter())


def test_pinned_pages_are_never_evicted_and_allocation_fails_cleanly():
    pages = MlaPageManager(4)
    held = pages.allocate(2, None)
    pages.register(held[0], 1, 0)
    cached = pages.allocate(1, None)
    pages.register(cached[0], 2, 1)
    pages.unpin(cached)
    with pytest.raises(CacheFullError):
        pages.allocate(3, None)  # 0 free + 1 evictable
    assert pages.num_cached == 1  # nothing was evicted by the failed call
    with pytest.raises(BudgetTooSmallError):
        pages.allocate(4, None)
    assert pages.allocate(1, None)  # evicts the cached page
    assert pages.lookup([1, 2]) == [held[0], None]


def test_sharing_and_double_unpin():
    pages = MlaPageManager(4)
    (pid,) = pages.allocate(1, None)
    pages.register(pid, 7, 0)
    pages.pin([pid])  # a second request shares it
    pages.unpin([pid])
    assert pages.num_used == 1
    pages.unpin([pid])
    assert pages.num_cached == 1
    with pytest.raises(IntegrityError):
        pages.unpin([pid])
    with pytest.raises(IntegrityError):
        pages.register(pid, 8, 0)  # only pages a request holds may be registered


def test_duplicate_key_stays_private():
    pages = MlaPageManager(4)
    a, b = pages.allocate(2, None)
    assert pages.register(a, 5, 0)
    assert not pages.register(b, 5, 0)  # same content computed twice: b stays private
    pages.unpin([a, b])
    assert (pages.num_cached, pages.num_free) == (1, 2)


def test_integrity_catches_wrong_refcounts():
    pages = MlaPageManager(4)
    ids = pages.allocate(2, None)
    pages.check_integrity(Counter(ids))
    with pytest.raises(IntegrityError):
        pages.check_integrity(Counter(ids[:1]))


# ---- batched registration and the LRU queue, against the one-page-at-a-time semantics ---------


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(0, 12), min_size=1, max_size=10),
    preregistered=st.lists(st.integers(0, 12), max_size=4),
    positions=st.lists(st.integers(0, 50), min_size=10, max_size=10),
)
def test_register_at_equals_register_page_by_page(keys, preregistered, positions):
    """Keys may repeat or already name another page (those pages stay private)."""
    batched, single = MlaPageManager(40), MlaPageManager(40)
    for m in (batched, single):
        owners = m.allocate(len(preregistered), None)
        for pid, key in zip(owners, preregistered, strict=True):
            m.register(pid, key, 0)
    pids = batched.allocate(len(keys), None)
    assert single.allocate(len(keys), None).tolist() == pids.tolist()
    batched.register_at(pids, keys, positions[: len(keys)])
    for pid, key, pos in zip(pids, keys, positions, strict=False):
        single.register(pid, key, pos)
    assert _index(batched) == _index(single)
    assert batched.key_of.tolist() == single.key_of.tolist()
    assert np.array_equal(batched.indexed, single.indexed)
    assert np.array_equal(batched.position_of, single.position_of)
    batched.check_integrity(Counter(owners.tolist() + pids.tolist()))


def test_register_at_rejects_a_page_indexed_under_another_key_and_changes_nothing():
    pages = MlaPageManager(8)
    a, b = pages.allocate(2, None)
    pages.register(a, 1, 0)
    before = _index(pages)
    with pytest.raises(IntegrityError):
        pages.register_at([b, a], [2, 3], [1, 2])
    assert _index(pages) == before and not pages.indexed[b] and pages.key_of[b].item() == (0, 0)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "release", "share", "evict"]), st.integers(1, 6)),
        max_size=40,
    )
)
def test_eviction_takes_the_least_recently_used_pages_oldest_first(ops):
    """Random allocations, registrations, shared pins and releases: every eviction takes exactly
    the cached pages with the smallest last-use stamps, in increasing order (the per-page rule)."""
    pages = MlaPageManager(24)
    tables: list[list[int]] = []
    next_key = iter(range(10**6))
    for op, n in ops:
        if op == "alloc" and n <= pages.num_free + pages.num_cached:
            expect = _lru_order(pages)[: max(n - pages.num_free, 0)]
            seen = []
            ids = pages.allocate(n, lambda p, k, pos, seen=seen: seen.extend(p))
            assert seen == expect
            pages.register_many(ids[: n - 1], [next(next_key) for _ in ids[: n - 1]], 0)
            tables.append(ids)
        elif op == "release" and tables:
            pages.unpin(tables.pop(n % len(tables)))
        elif op == "share" and tables:
            shared = [p for p in tables[n % len(tables)] if pages.indexed[p]]
            pages.pin(shared)
            tables.append(shared)
        elif op == "evict":
            expect = _lru_order(pages)[:n]
            seen = []
            assert pages.evict(n, lambda p, k, pos, seen=seen: seen.extend(p)) == len(expect)
            assert seen == expect
        pages.check_integrity(Counter(p for t in tables for p in t))


def test_integrity_check_catches_a_position_out_of_step_with_the_index():
    pages = MlaPageManager(6)
    ids = pages.allocate(2, None)
    pages.register(ids[0], 10, 0)
    refs = Counter(ids.tolist())
    pages.check_integrity(refs)
    pages.position_of[ids[1]] = 1  # not indexed, yet has a chain position
    with pytest.raises(IntegrityError, match="position"):
        pages.check_integrity(refs)
    pages.position_of[ids[1]] = -1
    pages.position_of[ids[0]] = -1  # indexed without a position
    with pytest.raises(IntegrityError, match="position"):
        pages.check_integrity(refs)


def _lru_order(pages: MlaPageManager) -> list[int]:
    cached = np.flatnonzero(pages.evictable)
    return cached[np.argsort(pages.last_use[cached], kind="stable")].tolist()


def test_page_ids_travel_as_int64_arrays_and_a_stale_key_is_caught():
    pages = MlaPageManager(8)
    ids = pages.allocate(3, None)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3]
    pages.register_many(ids, [10, 11, 12], 0)
    pages.unpin(ids)
    victims = []
    pages.evict(2, lambda p, k, pos: victims.append((p.tolist(), keys_to_ints(k), pos.tolist())))
    assert victims == [([3, 2], [12, 11], [2, 1])]  # tail first, as arrays and their keys
    pages.check_integrity(Counter())
    pages.key_of[3] = (12, 0)  # an evicted page that still names its key
    with pytest.raises(IntegrityError):
        pages.check_integrity(Counter())
