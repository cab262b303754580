"""Runs: the keys one batched write stored together, so that chain slices resolve per run.

A chain's pages are indexed a run at a time (a device tier registers a prefill chunk or a decoded
history; the host tier stores a published turn, pages written back together), and are asked about
a run at a time (a prefix match, a fetched hit, a write-back's presence check). A run records the
keys of one batch in the caller's order and, per offset, the slot (device page, host object) it
indexed there (-1 where it indexed nothing: the key was indexed already, or the slot has left the
index since). Resolving a slice of a chain then costs one dictionary probe per run plus a C-level
list comparison of the slice against the run's keys, in either direction (write-back hands a
history over tail first), instead of one dictionary probe per key. The dictionary (key -> slot)
stays the truth; runs only say where to look.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from ..types import PageKey
from .errors import IntegrityError

NO_RUN = -1
_NONE = np.zeros(0, dtype=np.int64)


class _Run:
    __slots__ = ("alive", "keys", "slots")

    def __init__(self, keys: list[PageKey], slots: np.ndarray, alive: int) -> None:
        self.keys = keys
        self.slots = slots  # [len(keys)] int64: the slot this run stored at each offset, or -1
        self.alive = alive  # offsets whose slot is >= 0


def _common(a: list, b: list) -> int:
    """Length of the common prefix of two equally long lists whose first items are equal.

    Two chains that differ at one page differ at every later one (a key hashes its
    predecessor), so where `b` is a stretch of one chain the equal items form a prefix: a
    binary search finds its end, and one C-level comparison confirms it (a run that joins
    several chains may break the pattern; then the items are compared one by one)."""
    if a == b:
        return len(a)
    lo, hi = 1, len(a) - 1  # a[lo - 1] == b[lo - 1]; a[hi] != b[hi] (a != b, compared last)
    if a[hi] == b[hi]:
        return list(map(operator.eq, a, b)).index(False)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    if a[:lo] == b[:lo]:
        return lo
    return list(map(operator.eq, a, b)).index(False)


class RunIndex:
    """Runs over the slots of one store; `run_of` / `off_of` say where each slot's run is."""

    def __init__(self, size: int = 0) -> None:
        self.runs: dict[int, _Run] = {}
        self.run_of = np.full(size, NO_RUN, dtype=np.int64)  # [slots] run id, or NO_RUN
        self.off_of = np.zeros(size, dtype=np.int64)  # [slots] offset within that run
        self._next = 0

    def grow(self, size: int) -> None:
        old = len(self.run_of)
        if size > old:
            run_of = np.full(size, NO_RUN, dtype=np.int64)
            off_of = np.zeros(size, dtype=np.int64)
            run_of[:old], off_of[:old] = self.run_of, self.off_of
            self.run_of, self.off_of = run_of, off_of

    def add(self, keys: list[PageKey], slots: np.ndarray, after: int = -1) -> None:
        """A run of `keys` (kept, not copied: the index owns the list and may extend it) whose
        slots this batch indexed (-1: not this batch's). The slots must belong to no run.

        after: a slot holding the key just before `keys[0]` in its chain (a turn published after
            the turn before it), or -1. When that slot is the last offset of its run, the batch
            continues that run instead of starting one, so a history published turn by turn
            stays one run and a walk over it is one segment, not one per turn. Only where to
            look changes: any slot will do (answers never depend on how keys are grouped)."""
        offs = np.flatnonzero(slots >= 0)
        if not len(offs):
            return
        owned = slots[offs]
        if after >= 0:
            rid = int(self.run_of[after])
            run = self.runs.get(rid) if rid != NO_RUN else None
            if run is not None and int(self.off_of[after]) == len(run.keys) - 1:
                base = len(run.keys)
                run.keys.extend(keys)
                run.slots = np.concatenate((run.slots, slots))
                run.alive += len(offs)
                self.run_of[owned] = rid
                self.off_of[owned] = offs + base
                return
        rid = self._next
        self._next += 1
        self.runs[rid] = _Run(keys, slots, len(offs))
        self.run_of[owned] = rid
        self.off_of[owned] = offs

    def forget(self, slots: np.ndarray) -> None:
        """These slots left the index: their runs no longer vouch for them."""
        if not len(slots):
            return
        rids = self.run_of[slots]
        held = rids != NO_RUN
        if not held.any():
            return
        slots, rids = slots[held], rids[held]
        offs = self.off_of[slots]
        self.run_of[slots] = NO_RUN
        runs = self.runs
        if (rids == rids[0]).all():  # the common case: one run
            groups = [(int(rids[0]), offs)]
        else:
            order = np.argsort(rids, kind="stable")
            rids, offs = rids[order], offs[order]
            starts = np.flatnonzero(np.diff(rids)) + 1
            groups = zip(
                rids[np.concatenate(([0], starts))].tolist(),
                np.split(offs, starts),
                strict=True,
            )
        for rid, group in groups:
            run = runs[rid]
            run.slots[group] = -1
            run.alive -= len(group)
            if not run.alive:
                del runs[rid]

    def slots(self, store: dict[PageKey, int], keys: Sequence[PageKey]) -> np.ndarray:
        """[n] int64: the slot of each key in `store`, -1 where absent."""
        return self._walk(store, keys, stop=False)[0]

    def prefix(self, store: dict[PageKey, int], keys: Sequence[PageKey]) -> int:
        """The number of leading keys present in `store`."""
        return self._walk(store, keys, stop=True)[1]

    def _walk(
        self, store: dict[PageKey, int], keys: Sequence[PageKey], *, stop: bool
    ) -> tuple[np.ndarray, int]:
        """(slots as `slots` gives them, the number of leading keys present). With `stop`, the
        walk ends at the first absent key (later slots are then unspecified)."""
        n = len(keys)
        out = _NONE if stop else np.full(n, -1, dtype=np.int64)
        runs, run_of, off_of, get = self.runs, self.run_of, self.off_of, store.get
        lead = -1  # the first absent index, once found
        i = short = 0
        while i < n:
            if short > 4 or n - i < 8:
                # Fragments (objects stored a few at a time, runs thinned by eviction, absent
                # keys) or a short rest: probe the rest one key at a time.
                rest = list(map(get, keys[i:], repeat(-1)))
                if not stop:
                    out[i:] = rest
                if lead < 0 and -1 in rest:
                    lead = i + rest.index(-1)
                break
            s = get(keys[i])
            if s is None:
                if lead < 0:
                    lead = i
                    if stop:
                        break
                i += 1
                short += 1
                continue
            rid = int(run_of[s])
            run = runs.get(rid) if rid != NO_RUN else None
            m = 1
            seg = None
            if run is not None:
                off, rk = int(off_of[s]), run.keys
                nxt = keys[i + 1]
                if off + 1 < len(rk) and rk[off + 1] == nxt:
                    m = min(n - i, len(rk) - off)
                    m = _common(keys[i : i + m], rk[off : off + m])
                    seg = run.slots[off : off + m]
                elif off > 0 and rk[off - 1] == nxt:  # the slice runs backwards along the run
                    m = min(n - i, off + 1)
                    m = _common(keys[i : i + m], rk[off - m + 1 : off + 1][::-1])
                    seg = run.slots[off - m + 1 : off + 1][::-1]
            if seg is None:
                if not stop:
                    out[i] = s
                i += 1
                short += 1
                continue
            if run.alive < len(rk):  # some offsets' objects left: cut at the first, probe it
                dead = np.flatnonzero(seg < 0)
                if len(dead):
                    m = int(dead[0])
                    seg = seg[:m]
            if not stop:
                out[i : i + m] = seg
            i += m
            short = short + 1 if m < 8 else 0
        return out, (n if lead < 0 else lead)

    def check_integrity(self, keys_of: list, used: np.ndarray) -> None:
        """Each run's live offsets hold slots in use, pointing back at that run and offset, with
        the run's key; alive counts agree; no run without slots is kept; every slot that names a
        run is in use and listed by it. keys_of: [slots] key per slot; used: [slots] bool."""
        seen = 0
        for rid, run in self.runs.items():
            offs = np.flatnonzero(run.slots >= 0)
            if run.alive != len(offs) or not run.alive or len(run.slots) != len(run.keys):
                raise IntegrityError(f"run {rid}: its live offsets are miscounted")
            for off in offs.tolist():
                s = int(run.slots[off])
                if (
                    not used[s]
                    or self.run_of[s] != rid
                    or self.off_of[s] != off
                    or keys_of[s] != run.keys[off]
                ):
                    raise IntegrityError(f"run {rid}: offset {off} does not hold its slot")
            seen += len(offs)
        size = len(used)
        named = self.run_of[:size] != NO_RUN
        if int(np.count_nonzero(named & used)) != seen or (named & ~used).any():
            raise IntegrityError("a slot names a run that does not list it")
        if (self.run_of[size:] != NO_RUN).any():
            raise IntegrityError("a slot beyond the store names a run")
