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
from collections.abc import Callable, Sequence

import attrs

from ..types import PageKey, SlotId
from .errors import IntegrityError
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

    def get(self, key: PageKey) -> CheckpointEntry | None:
        return self.index.get(key)

    def deepest(self, keys: Sequence[PageKey], limit: int, page_size: int) -> int:
        """Largest i < limit with a checkpoint at keys[i] (-1 if none)."""
        index = self.index
        limit = min(limit, len(keys))
        if limit <= 0:
            return -1
        if keys[limit - 1] in index:  # the common case: the prefix ends at a checkpoint
            return limit - 1
        if len(index) < limit:
            # Few checkpoints, long prefix: each entry knows its position (L / P - 1).
            best = -1
            for entry in index.values():
                i = entry.num_tokens // page_size - 1
                if best < i < limit and keys[i] == entry.key:
                    best = i
            return best
        present = list(map(index.__contains__, keys[limit - 1 :: -1]))
        return limit - 1 - present.index(True) if True in present else -1

    def on_path(self, keys: Sequence[PageKey], limit: int, page_size: int) -> list[int]:
        """Sorted page counts n <= limit with a checkpoint at keys[n - 1]."""
        index = self.index
        limit = min(limit, len(keys))
        if len(index) < limit:  # walk the (few) checkpoints rather than the (long) prefix
            found = []
            for entry in index.values():
                n = entry.num_tokens // page_size
                if 0 < n <= limit and keys[n - 1] == entry.key:
                    found.append(n)
            return sorted(found)
        return [i + 1 for i in range(limit) if keys[i] in index]

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
        self.pool.free([e.slot for e in victims])
        self.version += 1
        return len(victims)

    def check_integrity(self, expected_pins: Counter) -> None:
        """`expected_pins`: checkpoint key -> pins that live requests hold on it."""
        self.pool.check_integrity()
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
