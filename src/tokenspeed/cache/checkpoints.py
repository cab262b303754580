"""KDA checkpoints in the device tier: snapshots of every KDA layer's conv and recurrent state at a
page-aligned prefix length, indexed by the chained key of the prefix's last page.

A checkpoint at length L is what makes the MLA pages of [0, L) worth anything: without the KDA
state at exactly L the linear-attention layers cannot continue from there. Entries are pinned
(refcount > 0) while a request holds them (its rolling checkpoint, or one it is still filling from
L2) and are evicted LRU otherwise.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable

import attrs
import numpy as np

from ..types import PageKey, SlotId
from .errors import IntegrityError
from .key_table import KeyTable
from .keys import PageKeys, as_key_int, key_array, keys_from_ints, keys_to_ints
from .pool import SlotPool


class CheckpointKind(enum.Enum):
    """Why a checkpoint was taken; decides which ones the per-path cap thins first."""

    INTERVAL = "interval"
    """Every N pages during a long prefill; thinned first when a path has too many."""
    TURN_END = "turn_end"
    """The last page boundary of a turn: where the next turn of the conversation resumes."""
    ROLLING = "rolling"
    """The latest page boundary of a running request (taken as decode crosses page boundaries):
    at most one per request, each replacing the previous; it becomes TURN_END when the request is
    published or released."""


@attrs.define(eq=False, slots=True)
class CheckpointEntry:
    key: PageKey  # chained key of the last page before num_tokens
    num_tokens: int  # the prefix length L this state belongs to
    slot: SlotId
    kind: CheckpointKind
    refcount: int = 0


# Called with the entries about to be evicted, before their slots are reused.
CheckpointWritebackFn = Callable[[list[CheckpointEntry]], None]


class CheckpointManager:
    """Checkpoint slots [0, num_slots) and their index."""

    def __init__(self, num_slots: int) -> None:
        self.pool = SlotPool(num_slots)
        self.index: dict[PageKey, CheckpointEntry] = {}
        # The same keys for whole-history questions (which pages of a prefix have one): key -> slot.
        self._table = KeyTable(num_slots)
        self._lru: OrderedDict[PageKey, CheckpointEntry] = OrderedDict()  # unpinned, oldest first
        self.version = 0  # bumped whenever the index changes (a match may be stale)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self.index) - len(self._lru)

    def get(self, key: PageKey | np.void) -> CheckpointEntry | None:
        return self.index.get(as_key_int(key))

    def deepest(self, keys: PageKeys, limit: int) -> int:
        """Largest i < limit with a checkpoint at keys[i] (-1 if none)."""
        limit = min(limit, len(keys))
        if limit <= 0 or not self.index:
            return -1
        found = np.flatnonzero(self._table.lookup(keys[:limit]) >= 0)
        return int(found[-1]) if len(found) else -1

    def on_path(self, keys: PageKeys, limit: int) -> list[int]:
        """Sorted page counts n <= limit with a checkpoint at keys[n - 1]."""
        limit = min(limit, len(keys))
        if limit <= 0 or not self.index:
            return []
        return (np.flatnonzero(self._table.lookup(keys[:limit]) >= 0) + 1).tolist()

    def add(
        self,
        key: PageKey,
        num_tokens: int,
        kind: CheckpointKind,
        writeback: CheckpointWritebackFn | None,
    ) -> CheckpointEntry | None:
        """A new unpinned entry (evicting the LRU one if no slot is free), or None if every slot
        is pinned. The key must not be indexed yet."""
        if key in self.index:
            raise IntegrityError(f"checkpoint {key!r} added twice")
        if self.pool.num_free == 0 and not self.evict(1, writeback):
            return None
        slot = self.pool.allocate_one()
        entry = CheckpointEntry(key=key, num_tokens=num_tokens, slot=slot, kind=kind)
        self.index[key] = entry
        self._table.setdefault(key_array(key), np.array([slot], dtype=np.int64))
        self._lru[key] = entry
        self.version += 1
        return entry

    def touch(self, entry: CheckpointEntry) -> None:
        """Mark as recently used."""
        if entry.refcount == 0:
            self._lru.move_to_end(entry.key)

    def pin(self, entry: CheckpointEntry) -> None:
        if entry.refcount == 0:
            del self._lru[entry.key]
        entry.refcount += 1

    def unpin(self, entry: CheckpointEntry) -> None:
        if entry.refcount <= 0:
            raise IntegrityError(f"unpin of unpinned checkpoint {entry.key!r}")
        entry.refcount -= 1
        if entry.refcount == 0:
            self._lru[entry.key] = entry

    def remove(self, entry: CheckpointEntry) -> None:
        """Drop an unpinned entry without writing it anywhere (policy thinning)."""
        if entry.refcount:
            raise IntegrityError(f"remove of pinned checkpoint {entry.key!r}")
        del self._lru[entry.key]
        del self.index[entry.key]
        self._table.delete(key_array(entry.key))
        self.pool.free([entry.slot])
        self.version += 1

    def evict(self, n: int, writeback: CheckpointWritebackFn | None) -> int:
        """Evict up to n unpinned entries, least recently used first; returns how many."""
        victims = []
        for entry in self._lru.values():
            if len(victims) == n:
                break
            victims.append(entry)
        if not victims:
            return 0
        if writeback is not None:
            writeback(victims)
        for entry in victims:
            del self._lru[entry.key]
            del self.index[entry.key]
        self._table.delete(keys_from_ints([e.key for e in victims]))
        self.pool.free([e.slot for e in victims])
        self.version += 1
        return len(victims)

    def check_integrity(self, expected_pins: Counter) -> None:
        """`expected_pins`: checkpoint key -> pins that live requests hold on it."""
        self.pool.check_integrity()
        self._table.check_integrity()
        keys, slots_of = self._table.items()
        if len(keys) != len(self.index) or any(
            self.index.get(k) is None or self.index[k].slot != s
            for k, s in zip(keys_to_ints(keys), slots_of.tolist(), strict=True)
        ):
            raise IntegrityError("the checkpoint key table disagrees with the index")
        slots = [e.slot for e in self.index.values()]
        if len(set(slots)) != len(slots):
            raise IntegrityError("two checkpoints share a slot")
        if any(self.pool.is_free(s) for s in slots):
            raise IntegrityError("an indexed checkpoint's slot is on the free list")
        if len(slots) + self.pool.num_free != self.pool.capacity:
            raise IntegrityError(
                f"checkpoints {len(slots)} + free {self.pool.num_free} != {self.pool.capacity}"
            )
        for key, entry in self.index.items():
            if entry.key != key:
                raise IntegrityError(f"checkpoint indexed under the wrong key {key!r}")
            if entry.refcount < 0:
                raise IntegrityError(f"negative refcount on checkpoint {key!r}")
            if entry.refcount != expected_pins.get(key, 0):
                raise IntegrityError(
                    f"checkpoint {key!r} has {entry.refcount} pins, requests hold "
                    f"{expected_pins.get(key, 0)}"
                )
            if (entry.refcount == 0) != (key in self._lru):
                raise IntegrityError(f"checkpoint {key!r}: pinned xor evictable violated")
        for key in expected_pins:
            if key not in self.index:
                raise IntegrityError(f"a request pins checkpoint {key!r} that is not indexed")
