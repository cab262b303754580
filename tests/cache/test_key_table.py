"""KeyTable: batched lookups, inserts and deletes give exactly a dictionary's answers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import IntegrityError
from tokenspeed.cache.key_table import COMPILED, INTERPRETED, KeyTable
from tokenspeed.cache.keys import keys_from_ints, keys_to_ints

KERNELS = pytest.mark.parametrize("kernels", [COMPILED, INTERPRETED], ids=["compiled", "python"])

# Keys whose low words share a few values: many keys with one home slot, so probe runs wrap
# around the table and deletions have entries to shift back.
_keys = st.builds(lambda lo, hi: lo | (hi << 64), st.integers(0, 40), st.integers(0, 3))
_op = st.tuples(
    st.sampled_from(["setdefault", "delete", "lookup"]),
    st.lists(_keys, max_size=24),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=30))
def test_batches_equal_a_dictionary_called_key_by_key(ops):
    for kernels in (COMPILED, INTERPRETED):
        table, ref = KeyTable(kernels=kernels), {}
        counter = 0
        for op, ints in ops:
            keys = keys_from_ints(ints)
            if op == "setdefault":
                values = np.arange(counter, counter + len(ints), dtype=np.int64)
                counter += len(ints)
                got = table.setdefault(keys, values)
                want = [ref.setdefault(k, v) for k, v in zip(ints, values.tolist(), strict=True)]
            elif op == "delete":
                got = table.delete(keys)
                want = [ref.pop(k, -1) for k in ints]
            else:
                got = table.lookup(keys)
                want = [ref.get(k, -1) for k in ints]
            assert got.dtype == np.int64 and got.tolist() == want
            assert len(table) == len(ref)
            table.check_integrity()
        keys, values = table.items()
        assert dict(zip(keys_to_ints(keys), values.tolist(), strict=True)) == ref


@KERNELS
def test_growth_keeps_every_entry_and_deletion_leaves_no_tombstones(kernels):
    table = KeyTable(kernels=kernels)
    first = table.capacity
    ints = [(i * 7919) | (i << 64) for i in range(5000)]
    table.setdefault(keys_from_ints(ints), np.arange(5000))
    assert table.capacity > first and 2 * len(table) <= table.capacity
    assert table.lookup(keys_from_ints(ints)).tolist() == list(range(5000))
    cap = table.capacity
    # Churn: delete and re-insert many times the table size; it never needs to grow.
    for round_ in range(8):
        gone = ints[round_ * 500 : (round_ + 1) * 500]
        assert table.delete(keys_from_ints(gone)).min() >= 0
        assert table.lookup(keys_from_ints(gone)).max() == -1
        table.setdefault(keys_from_ints(gone), np.arange(500))
    assert table.capacity == cap and len(table) == 5000
    table.check_integrity()


@KERNELS
def test_single_keys_and_bad_input(kernels):
    table = KeyTable(kernels=kernels)
    arr = keys_from_ints([5, 1 << 100])
    table.setdefault(arr, np.array([3, 4]))
    assert table.get(5) == 3 and table.get(arr[1]) == 4 and table.get(6) is None
    assert (1 << 100) in table and 7 not in table
    with pytest.raises(ValueError):
        table.setdefault(keys_from_ints([9]), np.array([-1]))
    with pytest.raises(ValueError):
        table.setdefault(keys_from_ints([9, 10]), np.array([1]))
    with pytest.raises(TypeError):
        table.lookup(np.zeros(3, dtype=np.uint64))
    assert table.lookup(arr[::-1]).tolist() == [4, 3]  # a strided view is read correctly
    assert len(table.lookup(arr[:0])) == 0 and len(table) == 2


def test_integrity_check_catches_each_kind_of_damage():
    def loaded() -> KeyTable:
        t = KeyTable()
        t.setdefault(keys_from_ints(range(1, 30)), np.arange(29))
        t.check_integrity()
        return t

    t = loaded()
    t._live += 1  # the count drifts
    with pytest.raises(IntegrityError):
        t.check_integrity()
    t = loaded()
    # Move the entry of key 3 (home slot 3) past an empty slot: lookups would miss it.
    row = t._tab[3].copy()
    t._tab[3, 2] = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
    t._tab[40] = row
    with pytest.raises(IntegrityError):
        t.check_integrity()
    t = loaded()
    t._tab[35] = t._tab[5]  # key 5 stored twice
    t._live += 1
    with pytest.raises(IntegrityError):
        t.check_integrity()


@settings(max_examples=150, deadline=None)
@given(
    owners=st.lists(st.integers(-1, 1), min_size=1, max_size=40),
    queries=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 12), st.booleans()), max_size=6),
)
def test_lookup_near_a_key_column_gives_the_plain_answers(owners, queries):
    """Values index a column of keys; slots owned by other kinds hold decoys with the same
    keys (a neighbour is taken only when it is this table's): runs forwards, backwards, absent
    keys and arbitrary slots all answer as a plain lookup does."""
    n = len(owners)
    ints = [1000 + v % 17 for v in range(n)]  # keys repeat across slots of different owners
    column = keys_from_ints(ints)
    owner = np.array(owners, dtype=np.int8)
    for kernels in (COMPILED, INTERPRETED):
        table = KeyTable(kernels=kernels)
        members = [v for v in range(n) if owners[v] == 1]
        keys = keys_from_ints([ints[v] for v in members])
        got = table.setdefault(keys, np.array(members, dtype=np.int64))
        # A key owned twice keeps its first slot: make the column say so for the others.
        owner_now = owner.copy()
        owner_now[[v for v, g in zip(members, got.tolist(), strict=True) if g != v]] = 0
        for start, length, backwards in queries:
            picked = list(range(start, min(start + length, n)))
            if backwards:
                picked = picked[::-1]
            query = keys_from_ints([ints[v] for v in picked] + [5])  # and one absent key
            plain = table.lookup(query)
            assert table.lookup(query, (column, owner_now, 1)).tolist() == plain.tolist()


@settings(max_examples=100, deadline=None)
@given(
    present=st.lists(st.booleans(), max_size=30),
    order=st.sampled_from(["forward", "backward", "shuffled"]),
)
def test_prefix_and_last_present_stop_early_with_the_plain_answers(present, order):
    n = len(present)
    ints = [7000 + i for i in range(n)]
    column = keys_from_ints(ints)
    stored = [i for i in range(n) if present[i]]
    slots = {"forward": stored, "backward": stored[::-1], "shuffled": sorted(stored, key=hash)}
    for kernels in (COMPILED, INTERPRETED):
        table = KeyTable(kernels=kernels)
        table.setdefault(keys_from_ints([ints[i] for i in stored]), np.array(stored))
        owner = np.array([1 if p else 0 for p in present], dtype=np.int8)
        query = keys_from_ints([ints[i] for i in slots[order]] + ints)  # then every key
        plain = table.lookup(query)
        absent = np.flatnonzero(plain < 0)
        want_prefix = int(absent[0]) if len(absent) else len(plain)
        assert table.prefix(query, (column, owner, 1)) == want_prefix
        found = np.flatnonzero(plain >= 0)
        assert table.last_present(query) == (int(found[-1]) if len(found) else -1)
    assert table.prefix(query[:0], (column, owner, 1)) == 0 and table.last_present(query[:0]) == -1
