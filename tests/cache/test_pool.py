"""SlotPool: a free list that never hands out reserved ids and refuses double frees."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed.cache import CacheFullError, IntegrityError
from tokenspeed.cache.pool import SlotPool


def test_allocate_and_free_skip_the_reserved_sink():
    pool = SlotPool(5, reserved=(0,))
    assert pool.capacity == 4
    ids = pool.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4] and pool.num_free == 0
    with pytest.raises(CacheFullError):
        pool.allocate(1)
    pool.free([2, 3])
    assert pool.num_used == 2 and sorted(pool.allocate(2)) == [2, 3]
    pool.check_integrity()


def test_double_free_is_refused_without_changing_anything():
    pool = SlotPool(4, reserved=(0,))
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(IntegrityError):
        pool.free([b, a])  # a is already free: b must stay allocated too
    assert not pool.is_free(b)
    with pytest.raises(IntegrityError):
        pool.free([b, b])
    with pytest.raises(IntegrityError):
        pool.free([0])
    pool.check_integrity()
    assert pool.free_mask().tolist() == [False, True, False, True]


def test_many_ids_at_once_keep_lifo_order_and_refuse_a_reserved_id_atomically():
    pool = SlotPool(10, reserved=(0,))
    ids = pool.allocate(6)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6]
    pool.free(ids[2:])
    assert pool.allocate(2).tolist() == [
        3,
        4,
    ]  # a freed batch comes back in its own order, first first
    with pytest.raises(IntegrityError):
        pool.free([1, 2, 0])  # the reserved sink: nothing is freed
    assert not pool.is_free(1) and not pool.is_free(2)
    pool.check_integrity()


def test_arrays_in_and_out_and_single_slots():
    pool = SlotPool(6, reserved=(0,))
    ids = pool.allocate(3)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3]
    one = pool.allocate_one()
    assert isinstance(one, int) and one == 4
    pool.free(np.array([3, 1]))
    assert pool.allocate_one() == 3 and pool.num_free == 2
    with pytest.raises(IntegrityError):
        pool.free(np.array([6]))  # outside the pool
    pool._is_free[2] = True  # a flag without a free-list entry
    with pytest.raises(IntegrityError):
        pool.check_integrity()


@pytest.mark.parametrize("bad", [[-1], [6], [0], [2], [3, -1], [3, 6], [3, 0], [3, 2]])
def test_a_bad_free_of_one_or_many_ids_changes_nothing(bad):
    # One id takes a path without numpy; many ids take the vector checks. Both refuse negative
    # and out-of-range ids, the reserved sink and an id already free, leaving the pool as it was.
    pool = SlotPool(6, reserved=(0,))
    pool.allocate(3)  # 1, 2, 3 in use; 4, 5 free
    pool.free([2])
    before = (pool.free_mask().tolist(), pool.num_free)
    with pytest.raises(IntegrityError):
        pool.free(bad)
    assert (pool.free_mask().tolist(), pool.num_free) == before
    pool.check_integrity()
    assert pool.allocate(3).tolist() == [2, 4, 5]


def test_integrity_check_catches_an_id_out_of_range_on_the_free_list():
    pool = SlotPool(8, reserved=(0,))
    pool.check_integrity()
    assert pool._stack[0] == 7  # the bottom of the stack: the last id handed out
    pool._stack[0] = -1  # numpy reads -1 as id 7, which is free: the flags still agree
    with pytest.raises(IntegrityError, match="outside"):
        pool.check_integrity()
