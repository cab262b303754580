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

from ..compiled import jit
from ..errors import IntegrityError
from ..stamped_log import compact_in_place

FREE = -1  # the stamp of a slot that holds no object
_OLDEST_ROOM = 64  # victims `SlotLru.oldest` collects in its first pass over the log


@jit
def _touch(stamp, log_slot, log_stamp, tail, clock, slots):
    """Stamp slots clock, clock + 1, ... in order (a repeated slot keeps its last stamp) and log
    each (slot, stamp) at `tail`."""
    for i in range(slots.shape[0]):
        s = slots[i]
        stamp[s] = clock + i
        log_slot[tail + i] = s
        log_stamp[tail + i] = clock + i


@jit
def _oldest(stamp, log_slot, log_stamp, head, tail, nbytes, need, out):
    """Live log entries from `head` until their bytes reach `need` (or the log ends); the first
    len(out) of their slots are written to `out` ([m] int64), the rest only counted. Returns
    (entries, bytes, the position after the last)."""
    freed = 0
    found = 0
    h = head
    room = out.shape[0]
    while freed < need and h < tail:
        s = log_slot[h]
        if stamp[s] == log_stamp[h]:
            if found < room:
                out[found] = s
            found += 1
            freed += nbytes[s]
        h += 1
    return found, freed, h


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
        if self._tail + n > len(self._log_slot):
            self._room(n)
        _touch(
            self.stamp,
            self._log_slot,
            self._log_stamp,
            self._tail,
            self._clock,
            np.ascontiguousarray(slots, dtype=np.int64),
        )
        self._clock += n
        self._tail += n

    def touch_one(self, slot: int) -> None:
        self.touch(np.array([slot], dtype=np.int64))

    def forget(self, slots: np.ndarray | int) -> None:
        """The slots no longer hold objects (their log entries are stale from now on)."""
        self.stamp[slots] = FREE

    def oldest(self, nbytes: np.ndarray, need: int) -> tuple[np.ndarray, int, int]:
        """The least recently used slots, oldest first, whose `nbytes` add up to at least
        `need` (all live ones if they do not). Returns (slots, bytes they hold, log position
        after the last of them); nothing is consumed until `consume(position)`."""
        args = (self.stamp, self._log_slot, self._log_stamp, self._head, self._tail, nbytes, need)
        # An eviction usually makes room for one write, a few objects: one pass fills them in;
        # only a larger one walks the log a second time to fill an array of the size it found.
        slots = np.empty(_OLDEST_ROOM, dtype=np.int64)
        count, freed, position = _oldest(*args, slots)
        if count > _OLDEST_ROOM:
            slots = np.empty(count, dtype=np.int64)
            _oldest(*args, slots)
        return slots[:count], int(freed), int(position)

    def consume(self, position: int) -> None:
        """Drop the log entries before `position` (from `oldest`; their slots are evicted)."""
        self._head = position

    def _room(self, n: int) -> None:
        """Room for n more log entries, called when the log is full: drop the consumed head and
        the stale entries; grow if that is not enough."""
        kept = compact_in_place(self._log_slot, self._log_stamp, self._head, self._tail, self.stamp)
        self._head, self._tail = 0, kept
        size = len(self._log_slot)
        if 2 * (kept + n) > size:  # doubled past what is needed (as `compacted` sizes a log)
            size = 2 * (kept + n)
            for name in ("_log_slot", "_log_stamp"):
                grown = np.zeros(size, dtype=np.int64)
                grown[:kept] = getattr(self, name)[:kept]
                setattr(self, name, grown)

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
