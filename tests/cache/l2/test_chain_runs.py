"""ChainRuns: runs survive compaction, are dropped whole, and are checked."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed.cache import IntegrityError
from tokenspeed.cache.l2.chain_runs import ChainRuns, _fill_run


def test_runs_are_renumbered_by_compaction_and_dropped_whole():
    runs = ChainRuns()
    runs.run_slots = np.zeros(64, dtype=np.int64)  # small, so that adding compacts often
    runs.grow(4000)
    pages = np.ones(4000, dtype=bool)
    kept = {}
    for r in range(300):
        slots = np.arange(r * 10, r * 10 + 7, dtype=np.int64)[:: 1 if r % 2 else -1]
        runs.add(slots)
        if r % 3:
            runs.forget(slots[3:4])  # any slot leaving drops the whole run
        else:
            kept[r] = slots
        runs.check_integrity(pages)
    assert len(runs.run_slots) < 64 * 300  # compaction kept the storage to the live runs
    for slots in kept.values():
        r = runs.run_of[slots[0]]
        assert r >= 0 and (runs.run_of[slots] == r).all()
        base = runs.run_start[r]
        assert runs.run_slots[base : base + 7].tolist() == slots.tolist()
        assert runs.run_off[slots].tolist() == list(range(7))
    assert (runs.run_of >= 0).sum() == 7 * len(kept)


def test_integrity_check_catches_a_run_over_a_slot_that_holds_no_page():
    runs = ChainRuns()
    runs.grow(16)
    runs.add(np.array([3, 4, 5], dtype=np.int64))
    pages = np.zeros(16, dtype=bool)
    pages[[3, 4, 5]] = True
    runs.check_integrity(pages)
    pages[4] = False
    with pytest.raises(IntegrityError):
        runs.check_integrity(pages)
    pages[4] = True
    runs.run_of[9] = 0  # a slot naming a run that does not list it
    with pytest.raises(IntegrityError):
        runs.check_integrity(pages)


def test_a_run_s_slots_are_listed_and_name_the_run_and_their_offsets():
    run_of = np.full(10, -1, dtype=np.int64)
    run_off = np.zeros(10, dtype=np.int64)
    run_slots = np.zeros(8, dtype=np.int64)
    _fill_run(np.array([7, 2, 5], dtype=np.int64), 4, 3, run_of, run_off, run_slots)
    assert run_slots.tolist() == [0, 0, 0, 7, 2, 5, 0, 0]
    assert run_of.tolist() == [-1, -1, 4, -1, -1, 4, -1, 4, -1, -1]
    assert (run_off[7], run_off[2], run_off[5]) == (0, 1, 2)
