"""SlotLru: stamps and a log give exactly the order of an OrderedDict with move_to_end."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import IntegrityError
from tokenspeed.cache.l2.slot_lru import FREE, SlotLru


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["touch", "forget", "evict"]), st.lists(st.integers(0, 15))),
        max_size=60,
    )
)
def test_order_matches_an_ordered_dict(ops):
    lru, ref = SlotLru(16), OrderedDict()
    nbytes = np.arange(1, 17, dtype=np.int64)  # slot s holds s + 1 bytes
    for op, slots in ops:
        if op == "touch":
            lru.touch(np.array(slots, dtype=np.int64))
            for s in slots:
                ref[s] = None
                ref.move_to_end(s)
        elif op == "forget":
            for s in set(slots) & set(ref):
                lru.forget(s)
                del ref[s]
        else:
            need = sum(slots)
            victims, freed, position = lru.oldest(nbytes, need)
            want, got = [], 0
            for s in ref:
                if got >= need:
                    break
                want.append(s)
                got += s + 1
            assert victims.tolist() == want and freed == got
            lru.consume(position)
            lru.forget(victims)
            for s in want:
                del ref[s]
        lru.check_integrity()
    victims, _, _ = lru.oldest(nbytes, 10**9)
    assert victims.tolist() == list(ref)


def test_a_stored_slot_without_a_live_log_entry_is_caught():
    lru = SlotLru(8)
    lru.touch(np.array([1, 2, 3], dtype=np.int64))
    lru.check_integrity()
    lru.stamp[2] = 99  # a stamp no log entry carries
    with pytest.raises(IntegrityError):
        lru.check_integrity()
    lru.stamp[2] = FREE
    lru.check_integrity()
    lru.stamp[5] = 0  # stamped as if stored, never touched
    with pytest.raises(IntegrityError):
        lru.check_integrity()


def test_the_log_compacts_without_losing_the_order():
    lru = SlotLru(4)
    for _ in range(200):
        lru.touch(np.array([0, 1, 2, 3], dtype=np.int64))
    lru.touch(np.array([2, 0], dtype=np.int64))
    victims, _, _ = lru.oldest(np.ones(4, dtype=np.int64), 4)
    assert victims.tolist() == [1, 3, 2, 0]
    lru.check_integrity()


def test_an_eviction_of_more_objects_than_the_first_pass_holds_lists_them_all():
    # `oldest` fills its first 64 victims in one pass and walks the log again for more.
    lru = SlotLru(300)
    lru.touch(np.arange(300, dtype=np.int64))
    lru.touch(np.arange(0, 300, 2, dtype=np.int64))  # the even slots are now the newest
    nbytes = np.ones(300, dtype=np.int64)
    for need in (1, 63, 64, 65, 200, 10**6):
        victims, freed, position = lru.oldest(nbytes, need)
        want = (list(range(1, 300, 2)) + list(range(0, 300, 2)))[:need]
        assert victims.tolist() == want and freed == len(want)
    lru.consume(position)
    lru.forget(victims)
    lru.check_integrity()


def test_the_log_grows_when_its_live_entries_fill_it():
    lru = SlotLru(4)
    lru.grow(1000)
    for i in range(10):  # ever more distinct slots: compaction alone cannot make room
        lru.touch(np.arange(100 * i, 100 * (i + 1), dtype=np.int64))
        lru.touch(np.arange(0, 100 * (i + 1), 7, dtype=np.int64))
        lru.check_integrity()
    victims, _, _ = lru.oldest(np.ones(1000, dtype=np.int64), 10**9)
    # Each slot once, in touch order: the multiples of 7 were touched again last.
    assert victims.tolist() == [s for s in range(1000) if s % 7] + list(range(0, 1000, 7))
