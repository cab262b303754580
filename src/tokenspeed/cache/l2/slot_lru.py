"""Least-recently-used order over integer slots, kept as stamps and an append-only log.

The host tier names each stored object by a slot (an index into its numpy columns). A touch gives
the slot the next clock value (its stamp) and appends (slot, stamp) to the log; the slot's older
log entry goes stale, and is skipped when eviction reaches it. So the live log entries, from the
head, are the stored objects least recently used first (exactly the order an OrderedDict with
`move_to_end` on every touch keeps), and touching a run of thousands of objects is one vectorised
append instead of one linked-list move per object.
"""

from __future__ import annotations

import numpy as np

from ..errors import IntegrityError

FREE = -1  # the stamp of a slot that holds no object


class SlotLru:
    def __init__(self, size: int = 0) -> None:
        self.stamp = np.full(size, FREE, dtype=np.int64)  # [slots] last touch, FREE if unused
        self._log_slot = np.zeros(max(64, 2 * size), dtype=np.int64)
        self._log_stamp = np.zeros(max(64, 2 * size), dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._clock = 0

    def grow(self, size: int) -> None:
        """Room for slots [0, size) (new slots start FREE)."""
        old = len(self.stamp)
        if size > old:
            stamp = np.full(size, FREE, dtype=np.int64)
            stamp[:old] = self.stamp
            self.stamp = stamp

    def touch(self, slots: np.ndarray) -> None:
        """Make `slots` the most recently used, in this order (a repeated slot: its last place)."""
        n = len(slots)
        if not n:
            return
        stamps = np.arange(self._clock, self._clock + n, dtype=np.int64)
        self._clock += n
        self.stamp[slots] = stamps
        if n > 1 and not np.array_equal(self.stamp[slots], stamps):
            np.maximum.at(self.stamp, slots, stamps)  # repeated slots keep their last stamp
        self._append(slots, stamps)

    def touch_one(self, slot: int) -> None:
        self.touch(np.array([slot], dtype=np.int64))

    def forget(self, slots: np.ndarray | int) -> None:
        """The slots no longer hold objects (their log entries are stale from now on)."""
        self.stamp[slots] = FREE

    def oldest(self, nbytes: np.ndarray, need: int) -> tuple[np.ndarray, int, int]:
        """The least recently used slots, oldest first, whose `nbytes` add up to at least
        `need` (all live ones if they do not). Returns (slots, bytes they hold, log position
        after the last of them); nothing is consumed until `consume(position)`."""
        found: list[np.ndarray] = []
        freed = 0
        head, tail = self._head, self._tail
        chunk = 256
        while freed < need and head < tail:
            end = min(tail, head + chunk)
            chunk = min(4 * chunk, 1 << 16)
            ls = self._log_slot[head:end]
            live = np.flatnonzero(self.stamp[ls] == self._log_stamp[head:end])
            if not len(live):
                head = end
                continue
            cand = ls[live]
            cum = np.cumsum(nbytes[cand])
            if freed + int(cum[-1]) >= need:
                k = int(np.searchsorted(cum, need - freed))  # first with cum >= need - freed
                found.append(cand[: k + 1])
                freed += int(cum[k])
                head += int(live[k]) + 1
                break
            found.append(cand)
            freed += int(cum[-1])
            head = end
        slots = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return slots, freed, head

    def consume(self, position: int) -> None:
        """Drop the log entries before `position` (from `oldest`; their slots are evicted)."""
        self._head = position

    def _append(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        n = len(slots)
        if self._tail + n > len(self._log_slot):
            # Drop the consumed head and the stale entries; grow if that is not enough.
            ls = self._log_slot[self._head : self._tail]
            lt = self._log_stamp[self._head : self._tail]
            live = self.stamp[ls] == lt
            ls, lt = ls[live], lt[live]
            size = max(len(self._log_slot), 2 * (len(ls) + n))
            self._log_slot = np.zeros(size, dtype=np.int64)
            self._log_stamp = np.zeros(size, dtype=np.int64)
            self._log_slot[: len(ls)] = ls
            self._log_stamp[: len(ls)] = lt
            self._head, self._tail = 0, len(ls)
        self._log_slot[self._tail : self._tail + n] = slots
        self._log_stamp[self._tail : self._tail + n] = stamps
        self._tail += n

    def check_integrity(self) -> None:
        """Log stamps strictly increase; every stamped slot has exactly one live log entry."""
        ls = self._log_slot[self._head : self._tail]
        lt = self._log_stamp[self._head : self._tail]
        if (np.diff(lt) <= 0).any() or (len(lt) and lt[-1] >= self._clock):
            raise IntegrityError("L2 LRU log is not in increasing touch order")
        live = ls[self.stamp[ls] == lt]
        used = np.flatnonzero(self.stamp != FREE)
        if len(live) != len(used) or not np.array_equal(np.sort(live), used):
            raise IntegrityError("L2 LRU log does not hold each stored object exactly once")
