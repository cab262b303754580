"""LocalHostCache: byte budget with LRU, verification on read, metadata-only mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import CacheConfigError, HostCache, IntegrityError, LocalHostCache, ObjectKind
from tokenspeed.cache.keys import KEY_DTYPE, keys_from_ints, keys_to_ints
from tokenspeed.cache.l2.base import HostObject
from tokenspeed.cache.l2.local import _clear_slots, _store_new

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
    assert l2.contains(PAGE, [7, 8]).tolist() == [True, False]
    assert l2.contains(CKPT, [7]).tolist() == [False]


def test_lru_eviction_within_the_byte_budget():
    l2, n = _bound(3)
    l2.put([_page(k, n) for k in (1, 2, 3)])
    l2.get(PAGE, [1], [1])  # 1 becomes most recently used
    l2.put([_page(4, n)])
    assert l2.contains(PAGE, [1, 2, 3, 4]).tolist() == [True, False, True, True]
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
    assert l2.remove(PAGE, [1, 9]) == 1 and l2.contains(PAGE, [1]).tolist() == [False]


def test_metadata_only_keeps_sizes_not_bytes():
    l2, n = _bound(2, metadata_only=True)
    assert l2.put([HostObject(PAGE, k, k, n) for k in (1, 2, 3)]) == 2  # 3 evicted 1
    assert l2.contains(PAGE, [1, 2, 3]).tolist() == [False, True, True]
    (got,) = l2.get(PAGE, [2], [2])
    assert got is not None and got.numel() == 0
    assert l2.stats().bytes == 2 * n
    l2.check_integrity()


@pytest.mark.parametrize("metadata_only", [False, True])
@pytest.mark.parametrize("call", ["put", "put_many"])
def test_a_write_that_evicts_its_own_objects_reports_only_the_survivors(call, metadata_only):
    l2, n = _bound(3, metadata_only=metadata_only)

    def write(keys):
        if call == "put_many":
            payloads = None if metadata_only else [_page(k, n).payload for k in keys]
            return l2.put_many(PAGE, keys, keys, payloads)
        return l2.put(
            [
                HostObject(PAGE, k, k, n, None if metadata_only else _page(k, n).payload)
                for k in keys
            ]
        )

    # Five pages into room for three: the last three evict the first two.
    assert write([1, 2, 3, 4, 5]) == 3
    assert l2.contains(PAGE, [1, 2, 3, 4, 5]).tolist() == [False, False, True, True, True]
    # A present object counts (touched: it is the newest) until later ones of the call evict it.
    assert write([3, 6, 7, 8]) == 3
    assert l2.contains(PAGE, [3, 4, 5, 6, 7, 8]).tolist() == [False] * 3 + [True] * 3
    # Evicting only older objects: every object of the call is stored.
    assert write([9, 10]) == 2
    assert l2.contains(PAGE, [7, 8, 9, 10]).tolist() == [False, True, True, True]
    s = l2.stats()
    assert (s.puts, s.evictions, s.objects) == (10, 7, 3)  # writes count; evictions undo none
    l2.check_integrity()


def test_a_mixed_write_counts_the_survivors_of_each_kind():
    l2, n = _bound(4, metadata_only=True)  # 4 pages; a checkpoint takes more than 2
    ck = l2.object_bytes(CKPT)
    assert 2 * n < ck <= 3 * n
    objs = [HostObject(PAGE, 1, 0, n), HostObject(PAGE, 2, 1, n), HostObject(CKPT, 2, 8, ck)]
    assert l2.put(objs) == 2  # the checkpoint evicted page 1
    assert (l2.contains(PAGE, [1, 2]).tolist(), l2.contains(CKPT, [2]).tolist()) == (
        [False, True],
        [True],
    )
    l2.check_integrity()


def test_payload_contract_is_enforced():
    l2, n = _bound(2)
    with pytest.raises(AssertionError):
        l2.put([HostObject(PAGE, 1, 1, n, torch.zeros(n - 1, dtype=torch.uint8))])
    with pytest.raises(CacheConfigError):
        LocalHostCache(capacity_bytes=0)
    assert isinstance(l2, HostCache)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(capacity_bytes=True),  # a bool is not a byte count
        dict(capacity_bytes=1 << 20, metadata_only="no"),  # truthy strings are not flags
        dict(capacity_bytes=1 << 20, checksum="no"),
        dict(capacity_bytes=1 << 20, pin_memory=0),
    ],
)
def test_construction_refuses_bools_as_sizes_and_non_bool_flags(kwargs):
    with pytest.raises(CacheConfigError):
        LocalHostCache(**kwargs)


# ---- batched paths (put_many, prefix_present, the metadata-only get) against the per-object
# semantics, written out as a plain reference model ---------------------------------------------


class _ReferenceL2:
    """The tier's contract one object at a time: a dict per kind and one LRU order."""

    def __init__(self, capacity: int, nbytes: dict) -> None:
        self.capacity, self.nbytes = capacity, nbytes
        self.stores = {PAGE: {}, CKPT: {}}
        self.lru: dict = {}  # insertion-ordered: (kind, key) -> None
        self.bytes = self.evictions = self.puts = self.hits = self.misses = 0

    def put(self, kind, keys, positions) -> int:
        """Objects stored one by one; returns how many of them are stored at the end (a later
        one may evict an earlier one), counted per key given."""
        for key, pos in zip(keys, positions, strict=True):
            store = self.stores[kind]
            if key in store:
                self.lru[(kind, key)] = self.lru.pop((kind, key))
                continue
            while self.bytes + self.nbytes[kind] > self.capacity:
                k, old = next(iter(self.lru))
                del self.lru[(k, old)]
                self.stores[k].pop(old)
                self.bytes -= self.nbytes[k]
                self.evictions += 1
            store[key] = pos
            self.lru[(kind, key)] = None
            self.bytes += self.nbytes[kind]
            self.puts += 1
        return sum(key in self.stores[kind] for key in keys)

    def get(self, kind, keys, positions) -> list[bool]:
        out = []
        for key, pos in zip(keys, positions, strict=True):
            store = self.stores[kind]
            if key not in store:
                self.misses += 1
                out.append(False)
            elif store[key] != pos:  # rejected and dropped
                self.misses += 1
                del store[key], self.lru[(kind, key)]
                self.bytes -= self.nbytes[kind]
                out.append(False)
            else:
                self.hits += 1
                self.lru[(kind, key)] = self.lru.pop((kind, key))
                out.append(True)
        return out

    def remove(self, kind, keys) -> int:
        gone = [k for k in keys if k in self.stores[kind]]
        for k in dict.fromkeys(gone):
            del self.stores[kind][k], self.lru[(kind, k)]
            self.bytes -= self.nbytes[kind]
        return len(set(gone))

    def prefix_present(self, kind, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.stores[kind]:
            n += 1
        return n


_chains = st.lists(st.integers(0, 5), min_size=1, max_size=4)  # chain ids: shared prefixes


def _call(name: str, max_len: int):
    """(op, chain, first page, pages, with checkpoint) for one call kind."""
    return st.tuples(
        st.just(name),
        st.integers(0, 3),
        st.integers(0, 11),
        st.integers(1, max_len),
        st.booleans(),
    )


_op = st.one_of(
    _call("put_many", 8),
    _call("put", 4),
    _call("get", 8),
    _call("present", 8),  # get_present: the same read without payloads
    _call("remove", 3),
    _call("prefix", 12),
    # Tail first (write-back order), and a write that names a key twice.
    _call("put_many_rev", 12),
    _call("get_rev", 12),
    _call("put_many_dup", 8),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40), capacity_pages=st.integers(3, 30))
def test_batched_paths_match_the_per_object_model(ops, capacity_pages):
    """Four chains of 12 page keys (chains 0-2 share their first 4 pages, like a system prompt);
    every call on a slice of a chain (either direction), checkpoints mixed in, writes that evict
    their own objects or repeat a key: answers, counters, LRU evictions and integrity agree with
    the reference model."""
    l2, n = _bound(capacity_pages, metadata_only=True)
    ck = l2.object_bytes(CKPT)
    ref = _ReferenceL2(l2.capacity_bytes, {PAGE: n, CKPT: ck})
    chains = [[(0 if c < 3 and i < 4 else c + 1) * 100 + i for i in range(12)] for c in range(4)]
    for op, chain, start, length, checkpoint in ops:
        keys = chains[chain][start : start + length]
        positions = list(range(start, start + len(keys)))
        kind = CKPT if checkpoint and op != "prefix" else PAGE
        if op.endswith("_rev"):
            op, keys, positions = op[:-4], keys[::-1], positions[::-1]
        elif op == "put_many_dup":
            op, keys, positions = "put_many", keys + keys[:2], positions + positions[:2]
        if op == "put_many":
            assert l2.put_many(kind, keys, positions) == ref.put(kind, keys, positions)
        elif op == "put":
            nbytes = ck if kind is CKPT else n
            objs = [HostObject(kind, k, p, nbytes) for k, p in zip(keys, positions, strict=True)]
            assert l2.put(objs) == ref.put(kind, keys, positions)
        elif op in ("get", "present"):
            if chain == 3:
                positions = [p + 1 for p in positions]  # stored elsewhere: rejected
            if op == "get":
                got = [g is not None for g in l2.get(kind, keys, positions)]
            else:
                got = l2.get_present(kind, keys, positions).tolist()
            assert got == ref.get(kind, keys, positions)
        elif op == "remove":
            assert l2.remove(kind, keys) == ref.remove(kind, keys)
        else:
            assert l2.prefix_present(PAGE, keys) == ref.prefix_present(PAGE, keys)
            whole = chains[chain]
            assert l2.prefix_present(PAGE, whole) == ref.prefix_present(PAGE, whole)
        for k in (PAGE, CKPT):
            assert l2.contains(k, [key for c in chains for key in c]).tolist() == [
                key in ref.stores[k] for c in chains for key in c
            ]
            few = keys[:7]  # a few keys (checkpoints, short writes)
            assert l2.contains(k, few).tolist() == [key in ref.stores[k] for key in few]
        s = l2.stats()
        assert (s.objects, s.bytes, s.evictions, s.puts, s.hits, s.misses) == (
            len(ref.lru),
            ref.bytes,
            ref.evictions,
            ref.puts,
            ref.hits,
            ref.misses,
        )
        l2.check_integrity()


def test_contains_counts_every_key_asked_about_short_or_long():
    l2, _ = _bound(64, metadata_only=True)
    l2.put_many(PAGE, list(range(20)), list(range(20)))
    before = l2.stats().lookups
    assert l2.contains(PAGE, [3, 99, 5]).tolist() == [True, False, True]
    assert l2.contains(PAGE, list(range(15, 30))).tolist() == [k < 20 for k in range(15, 30)]
    assert l2.stats().lookups == before + 3 + 15


def test_integrity_check_catches_a_stored_object_missing_from_its_key_table():
    l2, _ = _bound(8, metadata_only=True)
    l2.put_many(PAGE, [1, 2, 3], [0, 1, 2])
    l2.check_integrity()
    l2._pages.delete(keys_from_ints([2]))  # bypass the bookkeeping: the slot still holds 2
    l2._mutations += 1
    with pytest.raises(IntegrityError):
        l2.check_integrity()


def _loaded() -> LocalHostCache:
    l2, _ = _bound(8, metadata_only=True)
    l2.put_many(PAGE, [1, 2, 3, 4], [0, 1, 2, 3])
    l2.put([HostObject(CKPT, 4, 8, l2.object_bytes(CKPT))])
    l2.check_integrity()
    return l2


@pytest.mark.parametrize(
    "damage",
    [
        "stamp",  # a stored object drops out of the LRU order
        "slot key",  # a slot names another key than its store entry
        "free slot",  # a slot in use is also on the free list
        "bytes",  # the byte count drifts
        "table value",  # the key table names another slot than the one holding the key
        "free slot out of range",  # the free list names a slot that does not exist
    ],
)
def test_integrity_check_catches_broken_slot_bookkeeping(damage):
    l2 = _loaded()
    slot = l2._pages.get(2)
    if damage == "stamp":
        l2._lru.stamp[slot] = -1
    elif damage == "slot key":
        l2._keys[slot] = (99, 0)
    elif damage == "free slot":
        l2._push_free(np.array([slot]))
    elif damage == "bytes":
        l2._bytes += 1
    elif damage == "free slot out of range":
        # -1 in place of the last slot (free): numpy reads -1 as that slot
        top = l2._free_top
        last = len(l2._pos) - 1
        assert last in l2._free_stack[:top].tolist()
        l2._free_stack[:top][l2._free_stack[:top] == last] = -1
    else:
        l2._pages.delete(keys_from_ints([2]))
        l2._pages.setdefault(keys_from_ints([2]), np.array([l2._pages.get(3)]))
    l2._mutations += 1
    with pytest.raises(IntegrityError):
        l2.check_integrity()


def test_presence_version_moves_with_stores_and_evictions_not_with_reads():
    l2, _ = _bound(2, metadata_only=True)
    v0 = l2.presence_version()
    l2.put_many(PAGE, [1, 2], [0, 1])
    v1 = l2.presence_version()
    l2.get(PAGE, [1, 2], [0, 1])
    l2.put_many(PAGE, [1], [0])  # already there: a touch
    assert l2.presence_version() == v1 != v0
    l2.put_many(PAGE, [3], [2])  # evicts the least recently used: 2
    assert l2.presence_version() != v1
    assert l2.contains(PAGE, [1, 2, 3]).tolist() == [True, False, True]


# ---- runs: pages written as consecutive pages of one chain answer prefix checks as a whole ------
def _chains(n_chains: int, length: int, shared: int) -> list[list[int]]:
    """Real chained keys: every chain starts with the same `shared` pages, then its own."""
    from tokenspeed.cache import KeyChain

    out = []
    for c in range(n_chains):
        chain = KeyChain(4)
        chain.append_tokens([1] * (4 * shared) + [c + 2] * (4 * (length - shared)))
        out.append(chain.keys.tolist())
    return out


@settings(max_examples=150, deadline=None)
@given(
    writes=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 15), st.integers(1, 10), st.booleans()),
        max_size=14,
    ),
    queries=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15)), min_size=1, max_size=6),
    capacity_pages=st.integers(4, 40),
)
def test_prefix_checks_over_chain_runs_equal_the_key_by_key_answer(writes, queries, capacity_pages):
    """Chains sharing their first pages; stretches written as runs (or not), evictions that
    break runs, queries starting anywhere: prefix_present answers as the plain per-key check."""
    l2, _ = _bound(capacity_pages, metadata_only=True)
    chains = _chains(3, 16, shared=5)
    for c, start, length, as_chain in writes:
        keys = chains[c][start : start + length]
        l2.put_many(PAGE, keys, list(range(start, start + len(keys))), chain=as_chain)
        l2.check_integrity()
    for c, start in queries:
        keys = chains[c][start:]
        present = l2.contains(PAGE, keys).tolist()
        expect = present.index(False) if False in present else len(keys)
        assert l2.prefix_present(PAGE, keys) == expect


def test_a_run_vouches_for_its_pages_only_while_all_are_there():
    l2, _ = _bound(64, metadata_only=True)
    (chain,) = _chains(1, 20, shared=0)
    l2.put_many(PAGE, chain, list(range(20)), chain=True)
    assert len(np.flatnonzero(l2._runs.run_of >= 0)) == 20  # one run holds them all
    assert l2.prefix_present(PAGE, chain) == 20
    l2.remove(PAGE, [chain[7]])  # the run is dropped as a whole; its other pages stay
    assert len(np.flatnonzero(l2._runs.run_of >= 0)) == 0
    assert l2.prefix_present(PAGE, chain) == 7
    l2.check_integrity()


def test_new_objects_fill_their_columns_unless_a_key_repeats():
    keys = keys_from_ints([11, 12, 13])
    pos, sizes = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    key_col, kind_of = np.zeros(8, dtype=KEY_DTYPE), np.full(8, -1, dtype=np.int8)
    slots = np.array([-1, 4, -1], dtype=np.int64)  # the middle object is already stored
    new, taken = np.array([0, 2]), np.array([6, 5])
    positions = np.array([30, 31, 32], dtype=np.int64)
    columns = (pos, sizes, key_col, kind_of, slots)
    # setdefault found the second new key under another slot: a repeat, nothing is written.
    assert not _store_new(np.array([6, 1]), taken, new, keys[new], positions, 9, 1, *columns)
    assert not pos.any() and not sizes.any() and (kind_of == -1).all()
    assert slots.tolist() == [-1, 4, -1]
    assert _store_new(taken, taken, new, keys[new], positions, 9, 1, *columns)
    assert slots.tolist() == [6, 4, 5]
    assert (pos[6], pos[5], sizes[6], sizes[5], kind_of[6], kind_of[5]) == (30, 32, 9, 9, 1, 1)
    assert keys_to_ints(key_col[[6, 5]]) == [11, 13]


def test_released_slots_are_cleared_and_pushed_on_the_free_stack():
    key_col = keys_from_ints(range(1, 9))
    kind_of = np.zeros(8, dtype=np.int8)
    sizes = np.arange(10, 18, dtype=np.int64)
    free_stack = np.full(8, -1, dtype=np.int64)
    freed = _clear_slots(np.array([5, 2], dtype=np.int64), key_col, kind_of, sizes, free_stack, 3)
    assert freed == 15 + 12
    assert free_stack.tolist() == [-1, -1, -1, 5, 2, -1, -1, -1]
    assert keys_to_ints(key_col) == [1, 2, 0, 4, 5, 0, 7, 8]
    assert kind_of.tolist() == [0, 0, -1, 0, 0, -1, 0, 0]
