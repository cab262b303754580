"""LocalHostCache: byte budget with LRU, verification on read, metadata-only mode."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.cache import CacheConfigError, HostCache, LocalHostCache, ObjectKind
from tokenspeed.cache.l2.base import HostObject

from ..helpers import tiny_geometry

PAGE, CKPT = ObjectKind.PAGE, ObjectKind.CHECKPOINT


def _bound(capacity_pages: int, *, metadata_only: bool = False) -> tuple[LocalHostCache, int]:
    g = tiny_geometry()
    capacity = capacity_pages * g.mla_page_bytes
    l2 = LocalHostCache(capacity_bytes=capacity, metadata_only=metadata_only)
    l2.bind(g, metadata_only=metadata_only)
    return l2, g.mla_page_bytes


def _page(key: int, nbytes: int, fill: int | None = None) -> HostObject:
    payload = torch.full((nbytes,), key % 251 if fill is None else fill, dtype=torch.uint8)
    return HostObject(PAGE, key, key, nbytes, payload)


def test_roundtrip_returns_the_stored_bytes_and_copies_on_put():
    l2, n = _bound(4)
    obj = _page(7, n)
    assert l2.put([obj]) == 1
    obj.payload.fill_(0)  # the tier kept its own copy
    (got,) = l2.get(PAGE, [7], [7])
    assert torch.equal(got, torch.full((n,), 7, dtype=torch.uint8))
    assert l2.contains(PAGE, [7, 8]) == [True, False]
    assert l2.contains(CKPT, [7]) == [False]


def test_lru_eviction_within_the_byte_budget():
    l2, n = _bound(3)
    l2.put([_page(k, n) for k in (1, 2, 3)])
    l2.get(PAGE, [1], [1])  # 1 becomes most recently used
    l2.put([_page(4, n)])
    assert l2.contains(PAGE, [1, 2, 3, 4]) == [True, False, True, True]
    s = l2.stats()
    assert (s.objects, s.bytes, s.evictions) == (3, 3 * n, 1)
    l2.check_integrity()


def test_existing_key_is_kept_and_oversized_objects_are_dropped():
    l2, n = _bound(2)
    l2.put([_page(1, n)])
    assert l2.put([_page(1, n, fill=99)]) == 1  # same key = same content: not rewritten
    assert l2.get(PAGE, [1], [1])[0][0] == 1
    big = HostObject(CKPT, 5, 8, 3 * n, torch.zeros(3 * n, dtype=torch.uint8))
    assert l2.put([big]) == 0 and l2.stats().dropped_writes == 1


def test_corrupted_or_mismatched_objects_are_misses():
    l2, n = _bound(4)
    l2.put([_page(1, n), _page(2, n)])
    l2.corrupt_for_test(PAGE, 1)
    assert l2.get(PAGE, [1], [1]) == [None]  # CRC mismatch
    assert l2.get(PAGE, [2], [3]) == [None]  # stored for another position
    s = l2.stats()
    assert s.corrupt == 2 and s.objects == 0  # rejected objects are dropped
    l2.check_integrity()


def test_prefix_and_last_present():
    l2, n = _bound(8)
    l2.put([_page(k, n) for k in (1, 2, 3, 5)])
    assert l2.prefix_present(PAGE, [1, 2, 3, 4, 5]) == 3
    assert l2.prefix_present(PAGE, [9, 1]) == 0
    assert l2.last_present(PAGE, [1, 2, 4, 6]) == 1
    assert l2.last_present(PAGE, [6, 7]) == -1
    assert l2.remove(PAGE, [1, 9]) == 1 and l2.contains(PAGE, [1]) == [False]


def test_metadata_only_keeps_sizes_not_bytes():
    l2, n = _bound(2, metadata_only=True)
    assert l2.put([HostObject(PAGE, k, k, n) for k in (1, 2, 3)]) == 3
    assert l2.contains(PAGE, [1, 2, 3]) == [False, True, True]
    (got,) = l2.get(PAGE, [2], [2])
    assert got is not None and got.numel() == 0
    assert l2.stats().bytes == 2 * n
    l2.check_integrity()


def test_payload_contract_is_enforced():
    l2, n = _bound(2)
    with pytest.raises(AssertionError):
        l2.put([HostObject(PAGE, 1, 1, n, torch.zeros(n - 1, dtype=torch.uint8))])
    with pytest.raises(CacheConfigError):
        LocalHostCache(capacity_bytes=0)
    assert isinstance(l2, HostCache)
