"""CheckpointManager: slots, pins, LRU eviction with write-back, deepest lookup."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenspeed.cache import CheckpointKind, IntegrityError
from tokenspeed.cache.checkpoints import CheckpointEntry, CheckpointManager
from tokenspeed.cache.keys import keys_from_ints

INTERVAL = CheckpointKind.INTERVAL


def test_add_evicts_lru_unpinned_with_writeback():
    ckpts = CheckpointManager(2, 4)
    a = ckpts.add(1, 4, INTERVAL, None)
    b = ckpts.add(2, 8, INTERVAL, None)
    ckpts.touch(a)  # b is now the least recently used
    written = []
    c = ckpts.add(3, 12, INTERVAL, written.extend)
    assert written == [b] and ckpts.get(2) is None and c.slot == b.slot
    ckpts.check_integrity(Counter())


def test_pinned_entries_are_never_evicted():
    ckpts = CheckpointManager(1, 4)
    a = ckpts.add(1, 4, INTERVAL, None)
    ckpts.pin(a)
    assert ckpts.add(2, 8, INTERVAL, None) is None  # no slot: dropped, not an error
    assert ckpts.evict(5, None) == 0
    with pytest.raises(IntegrityError):
        ckpts.remove(a)
    ckpts.check_integrity(Counter({1: 1}))
    with pytest.raises(IntegrityError):
        ckpts.check_integrity(Counter())  # the pin is not accounted for
    ckpts.unpin(a)
    with pytest.raises(IntegrityError):
        ckpts.unpin(a)
    assert ckpts.evict(5, None) == 1 and ckpts.num_free == 1


def test_deepest_within_a_limit():
    ckpts = CheckpointManager(8, 4)
    ints = list(range(100, 120))
    keys = keys_from_ints(ints)
    for n in (3, 7, 12):  # checkpoints after pages 3, 7 and 12
        ckpts.add(ints[n - 1], n * 4, INTERVAL, None)
    assert ckpts.deepest(keys, 20) == 11
    assert ckpts.deepest(keys, 11) == 6
    assert ckpts.deepest(keys, 2) == -1
    assert ckpts.on_path(keys, 20) == [3, 7, 12] and ckpts.on_path(keys, 11) == [3, 7]
    other = keys_from_ints(range(200, 220))  # same positions, different prefix
    assert ckpts.deepest(other, 20) == -1 and ckpts.on_path(other, 20) == []
    ckpts.evict(1, None)  # the least recently used: the one after page 3
    assert ckpts.on_path(keys, 20) == [7, 12] and ckpts.deepest(keys, 6) == -1
    ckpts.check_integrity(Counter())
    with pytest.raises(IntegrityError):
        ckpts.add(ints[6], 28, INTERVAL, None)


def test_integrity_check_catches_a_slot_record_out_of_step():
    ckpts = CheckpointManager(4, 4)
    a = ckpts.add(11, 8, INTERVAL, None)
    ckpts.check_integrity(Counter())
    ckpts._slot_page[a.slot] = 5  # says page 5, the entry says page 1
    with pytest.raises(IntegrityError):
        ckpts.check_integrity(Counter())
    ckpts._slot_page[a.slot] = 1
    ckpts.remove(a)
    ckpts.check_integrity(Counter())
    ckpts._slot_page[a.slot] = 1  # a freed slot that still names a page
    with pytest.raises(IntegrityError):
        ckpts.check_integrity(Counter())


@pytest.mark.parametrize("damage", ["stale", "foreign"])
def test_integrity_check_catches_an_lru_entry_that_is_not_indexed(damage):
    ckpts = CheckpointManager(4, 4)
    a = ckpts.add(11, 8, INTERVAL, None)
    ckpts.check_integrity(Counter())
    if damage == "stale":  # a removed entry left behind in the LRU
        ckpts._lru[12] = CheckpointEntry(key=12, num_tokens=8, slot=3, kind=INTERVAL)
    else:  # the LRU holds another object than the index under the same key
        ckpts._lru[11] = CheckpointEntry(key=11, num_tokens=8, slot=a.slot, kind=INTERVAL)
    with pytest.raises(IntegrityError):
        ckpts.check_integrity(Counter())
