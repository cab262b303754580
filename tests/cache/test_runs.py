"""RunIndex: chain slices resolve through the runs of earlier batched writes, either direction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import IntegrityError
from tokenspeed.cache.runs import RunIndex, _common


def _index(runs: list[list[int]]) -> tuple[RunIndex, dict[int, int]]:
    """Runs of keys stored at fresh slots (a key already stored belongs to an earlier run)."""
    index, store = RunIndex(), {}
    index.grow(1000)
    for keys in runs:
        slots = np.full(len(keys), -1, dtype=np.int64)
        for j, key in enumerate(keys):
            if key not in store:
                store[key] = slots[j] = len(store)
        index.add(list(keys), slots)
    return index, store


def test_slices_resolve_forwards_backwards_and_across_runs():
    chain = list(range(100, 140))
    index, store = _index([chain[:25], chain[20:], [7, 8, 9]])
    want = [store[k] for k in chain]
    assert index.slots(store, chain).tolist() == want
    assert index.slots(store, chain[::-1]).tolist() == want[::-1]  # write-back order
    assert index.prefix(store, [*chain, 1, 2]) == 40
    assert index.slots(store, [100, 5, 101]).tolist() == [store[100], -1, store[101]]
    index.check_integrity(_keys_of(store), _used(store))


def test_an_object_that_left_is_probed_again_not_vouched_for():
    chain = list(range(50, 80))
    index, store = _index([chain])
    gone = store.pop(60)
    index.forget(np.array([gone]))
    assert index.prefix(store, chain) == 10
    got = index.slots(store, chain).tolist()
    assert got[10] == -1 and got[11] == store[61]
    store[60] = 999  # stored again, outside any run
    assert index.prefix(store, chain) == 30
    with pytest.raises(IntegrityError):  # a live offset whose slot is not in use
        index.check_integrity(_keys_of(store), np.zeros(1000, dtype=bool))


def test_common_prefix_is_exact_even_where_a_run_joins_chains():
    assert _common([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # equal again after the break: not a chain
    assert _common([1, 2, 3, 4, 5], [1, 2, 3, 4, 6]) == 4
    assert _common([1, 5, 3, 4, 5], [1, 2, 3, 4, 5]) == 1
    assert _common([1], [1]) == 1


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 30), st.booleans()), min_size=1, max_size=6
    ),
    gone=st.lists(st.integers(0, 59), max_size=20),
    query=st.tuples(st.integers(0, 50), st.integers(0, 40), st.booleans()),
)
def test_walks_agree_with_probing_every_key(runs, gone, query):
    chain = list(range(1000, 1060))
    index, store = _index(
        [chain[a : a + n][::-1] if rev else chain[a : a + n] for a, n, rev in runs]
    )
    _forget_then_check_a_walk(index, store, chain, gone, query)


def test_a_batch_after_the_last_slot_of_a_run_continues_it():
    # A history published turn by turn: each turn names the page before it, and the history
    # stays one run, so a walk over it is one segment. A batch after a slot inside a run, or
    # with no slot named, starts its own run.
    chain = list(range(200, 260))
    index, store = RunIndex(), {}
    index.grow(1000)

    def add(keys, after=-1):
        slots = np.full(len(keys), -1, dtype=np.int64)
        for j, key in enumerate(keys):
            if key not in store:
                store[key] = slots[j] = len(store)
        index.add(list(keys), slots, after)

    add(chain[:20])
    add(chain[20:35], store[chain[19]])
    add(chain[35:50], store[chain[34]])
    assert len(index.runs) == 1
    (run,) = index.runs.values()
    assert run.keys == chain[:50] and run.alive == 50 and len(run.slots) == 50
    assert index.slots(store, chain[:50]).tolist() == [store[k] for k in chain[:50]]
    assert index.slots(store, chain[:50][::-1]).tolist() == [store[k] for k in chain[:50]][::-1]
    assert index.prefix(store, chain) == 50
    add(chain[50:55], store[chain[10]])  # after a slot inside the run: a run of its own
    add(chain[55:], -1)
    assert len(index.runs) == 3
    index.check_integrity(_keys_of(store), _used(store))
    gone = [store.pop(chain[k]) for k in (5, 30)]  # objects leave from both parts of the run
    index.forget(np.array(gone))
    assert index.prefix(store, chain) == 5
    assert index.slots(store, chain).tolist() == [store.get(k, -1) for k in chain]
    assert run.alive == 48
    index.check_integrity(_keys_of(store), _used(store))


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 30), st.booleans(), st.integers(-1, 59)),
        min_size=1,
        max_size=6,
    ),
    gone=st.lists(st.integers(0, 59), max_size=20),
    query=st.tuples(st.integers(0, 50), st.integers(0, 40), st.booleans()),
)
def test_walks_agree_with_probing_every_key_whatever_runs_continue(runs, gone, query):
    # Batches naming any slot (a real predecessor, a slot inside a run, one at a run's end that
    # is unrelated, or none): answers are those of probing every key.
    chain = list(range(1000, 1060))
    index, store = RunIndex(), {}
    index.grow(1000)
    for a, n, rev, after in runs:
        keys = chain[a : a + n][::-1] if rev else chain[a : a + n]
        slots = np.full(len(keys), -1, dtype=np.int64)
        for j, key in enumerate(keys):
            if key not in store:
                store[key] = slots[j] = len(store)
        prev = store.get(chain[after], -1) if after >= 0 else -1
        index.add(list(keys), slots, prev)
    _forget_then_check_a_walk(index, store, chain, gone, query)


def _forget_then_check_a_walk(index, store, chain, gone, query) -> None:
    """Objects `gone` leave; a walk over the `query` run of `chain` (start, length, reversed)
    then answers as probing every key would, and the index stays consistent."""
    for key in gone:
        slot = store.pop(chain[key], None)
        if slot is not None:
            index.forget(np.array([slot]))
    a, n, rev = query
    keys = chain[a : a + n][::-1] if rev else chain[a : a + n]
    probe = [store.get(k, -1) for k in keys]
    assert index.slots(store, keys).tolist() == probe
    assert index.prefix(store, keys) == (probe.index(-1) if -1 in probe else len(probe))
    index.check_integrity(_keys_of(store), _used(store))


def _keys_of(store: dict[int, int]) -> list:
    keys = [None] * 1000
    for key, slot in store.items():
        keys[slot] = key
    return keys


def _used(store: dict[int, int]) -> np.ndarray:
    used = np.zeros(1000, dtype=bool)
    used[list(store.values())] = True
    return used
