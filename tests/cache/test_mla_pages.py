"""MlaPageManager: free / used / cached states, LRU eviction of cached pages only."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenspeed.cache import BudgetTooSmallError, CacheFullError, IntegrityError
from tokenspeed.cache.mla_pages import SINK_PAGE, MlaPageManager


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
        assert pages.evict(1, lambda p, k, pos: order.append((p, k, pos))) == 1
    # Within one release the tail goes first; earlier releases go before later ones.
    assert order == [([ids[3]], [13], [3]), ([ids[2]], [12], [2]),
                     ([ids[1]], [11], [1]), ([ids[0]], [10], [0])]
    assert pages.num_free == 4
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
