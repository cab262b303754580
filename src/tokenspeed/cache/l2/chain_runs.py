"""Runs of host-tier slots that hold consecutive pages of one chain, written together.

A turn's pages reach the host tier in one batch (publish), and a prefix check later walks the
whole history, page by page. Keys are chained (the key of page i hashes the key of page i-1 with
the page's content), so when the key at the start of a stretch of the query equals a run's key
at some offset, and the key d pages further on equals the run's key d offsets further on, every
key in between is equal too: the two chains agree there, and differ at every later page once
they differ at one. So a run answers "present" for up to its whole length with two key
comparisons, and where the query leaves the run a binary search finds the exact page.

That holds only while every slot of the run still holds its page: a run is dropped as a whole
the first time one of its objects leaves (the slots stay, answered key by key). Runs are made
only from batches the caller marks as consecutive pages of one chain (`put_many(chain=True)`).
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit
from ..errors import IntegrityError


@jit
def _drop_runs(slots, run_of, run_start, run_len, run_slots):
    """Drop every run holding one of `slots` (all its slots leave it); returns the slots that
    left runs."""
    left = 0
    for i in range(slots.shape[0]):
        r = run_of[slots[i]]
        if r < 0:
            continue
        base = run_start[r]
        for k in range(run_len[r]):
            run_of[run_slots[base + k]] = -1
        left += run_len[r]
        run_len[r] = 0
    return left


@jit
def _fill_run(slots, r, base, run_of, run_off, run_slots):
    """Run r's slots ([n] int64, in chain order) listed from `base` of `run_slots`, each naming
    the run and its offset in it."""
    for i in range(slots.shape[0]):
        s = slots[i]
        run_slots[base + i] = s
        run_of[s] = r
        run_off[s] = i


class ChainRuns:
    """The runs over a tier's slots: per slot its run (-1: none) and offset; per run the start
    of its slots in one flat array, and its length (0 once dropped)."""

    def __init__(self) -> None:
        self.run_of = np.zeros(0, dtype=np.int64)
        self.run_off = np.zeros(0, dtype=np.int64)
        self.run_start = np.zeros(1024, dtype=np.int64)
        self.run_len = np.zeros(1024, dtype=np.int64)
        self.run_slots = np.zeros(1 << 16, dtype=np.int64)
        self._runs = 0  # run ids handed out
        self._used = 0  # entries of run_slots handed out
        self._live = 0  # entries of run_slots that belong to live runs

    def grow(self, size: int) -> None:
        """Room for slots [0, size)."""
        old = len(self.run_of)
        run_of = np.full(size, -1, dtype=np.int64)
        run_of[:old] = self.run_of
        run_off = np.zeros(size, dtype=np.int64)
        run_off[:old] = self.run_off
        self.run_of, self.run_off = run_of, run_off

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """(run_of, run_off, run_start, run_len, run_slots), what a prefix walk reads."""
        return self.run_of, self.run_off, self.run_start, self.run_len, self.run_slots

    def add(self, slots: np.ndarray) -> None:
        """A run over `slots`, which now hold consecutive pages of one chain in this order (none
        of them in a run)."""
        n = len(slots)
        if n < 2:
            return
        if self._used + n > len(self.run_slots):
            self._compact(n)
        if self._runs == len(self.run_start):
            self.run_start = np.concatenate((self.run_start, np.zeros_like(self.run_start)))
            self.run_len = np.concatenate((self.run_len, np.zeros_like(self.run_len)))
        r = self._runs
        self._runs += 1
        base = self._used
        self._used += n
        self._live += n
        self.run_start[r] = base
        self.run_len[r] = n
        _fill_run(slots, r, base, self.run_of, self.run_off, self.run_slots)

    def forget(self, slots: np.ndarray) -> None:
        """These slots' objects left: the runs holding any of them are dropped."""
        if len(slots):
            self._live -= _drop_runs(
                slots, self.run_of, self.run_start, self.run_len, self.run_slots
            )

    def _compact(self, extra: int) -> None:
        """Keep only the live runs (renumbered), with room for `extra` more slots."""
        live = np.flatnonzero(self.run_len[: self._runs] > 0)
        lengths = self.run_len[live]
        starts = np.zeros(len(live), dtype=np.int64)
        if len(live):
            starts[1:] = np.cumsum(lengths)[:-1]
        size = max(len(self.run_slots), 2 * (self._live + extra))
        run_slots = np.zeros(size, dtype=np.int64)
        for new_id, (r, start, n) in enumerate(
            zip(live.tolist(), starts.tolist(), lengths.tolist(), strict=True)
        ):
            old = self.run_start[r]
            held = self.run_slots[old : old + n]
            run_slots[start : start + n] = held
            self.run_of[held] = new_id
        capacity = max(len(self.run_start), 2 * len(live) + 16)
        self.run_start = np.zeros(capacity, dtype=np.int64)
        self.run_len = np.zeros(capacity, dtype=np.int64)
        self.run_start[: len(live)] = starts
        self.run_len[: len(live)] = lengths
        self.run_slots = run_slots
        self._runs = len(live)
        self._used = self._live = int(lengths.sum())

    def check_integrity(self, pages: np.ndarray) -> None:
        """Every live run lists distinct slots that name it at their offsets and hold pages
        (`pages`: [slots] bool); no other slot names a run."""
        named = np.flatnonzero(self.run_of >= 0)
        seen = 0
        for r in np.flatnonzero(self.run_len[: self._runs] > 0).tolist():
            base, n = int(self.run_start[r]), int(self.run_len[r])
            held = self.run_slots[base : base + n]
            if (
                (self.run_of[held] != r).any()
                or (self.run_off[held] != np.arange(n)).any()
                or not pages[held].all()
            ):
                raise IntegrityError(f"host-tier run {r} does not hold its slots")
            seen += n
        if seen != len(named) or seen != self._live:
            raise IntegrityError("a host-tier slot names a run that does not list it")
