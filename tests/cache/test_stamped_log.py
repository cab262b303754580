"""A stamped log's live entries move to the front, in order (`compacted`: into new arrays with
room to grow; `compact_in_place`: within the same arrays)."""

from __future__ import annotations

import numpy as np

from tokenspeed.cache.stamped_log import compact_in_place, compacted


def test_live_entries_move_to_the_front_in_order_with_room_for_more():
    ids = np.array([9, 1, 2, 3, 4, 5, 0, 0], dtype=np.int64)
    stamps = np.array([0, 10, 11, 12, 13, 14, 0, 0], dtype=np.int64)
    live = np.array([True, False, True, False, True])  # entries 1..5
    new_ids, new_stamps, kept = compacted(ids, stamps, 1, 6, live, extra=1)
    assert kept == 3
    assert new_ids[:3].tolist() == [1, 3, 5] and new_stamps[:3].tolist() == [10, 12, 14]
    assert len(new_ids) == len(new_stamps) == 8  # never smaller than before
    assert ids.tolist() == [9, 1, 2, 3, 4, 5, 0, 0]  # the old arrays are left alone


def test_the_arrays_grow_when_the_live_entries_and_the_extra_do_not_fit():
    ids = np.arange(4, dtype=np.int64)
    stamps = np.arange(4, dtype=np.int64)
    new_ids, new_stamps, kept = compacted(ids, stamps, 0, 4, np.ones(4, dtype=bool), extra=3)
    assert kept == 4 and len(new_ids) >= 7 and len(new_stamps) == len(new_ids)
    assert new_ids[:4].tolist() == [0, 1, 2, 3]


def test_compaction_in_place_keeps_the_entries_whose_id_still_carries_their_stamp():
    ids = np.array([9, 1, 2, 1, 3, 2, 0, 0], dtype=np.int64)
    stamps = np.array([0, 10, 11, 12, 13, 14, 0, 0], dtype=np.int64)
    current = np.array([-1, 12, 14, -1, -1, -1, -1, -1, -1, 0], dtype=np.int64)  # id 3: freed
    kept = compact_in_place(ids, stamps, 1, 6, current)
    assert kept == 2
    assert ids[:2].tolist() == [1, 2] and stamps[:2].tolist() == [12, 14]
    assert compact_in_place(ids, stamps, 0, 0, current) == 0  # an empty log stays empty
