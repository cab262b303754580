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
from .compiled import jit
from .errors import IntegrityError
from .keys import KEY_DTYPE, PageKeys, as_key_int
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


@jit
def _on_chain(slot_page, slot_key, keys, limit, out):
    """The pages i < limit with keys[i] equal to the key of a slot stored for page i."""
    found = 0
    for s in range(slot_page.shape[0]):
        i = slot_page[s]
        if (
            0 <= i < limit
            and keys[i]["lo"] == slot_key[s]["lo"]
            and keys[i]["hi"] == (slot_key[s]["hi"])
        ):
            out[found] = i
            found += 1
    return found


# Called with the entries about to be evicted, before their slots are reused.
CheckpointWritebackFn = Callable[[list[CheckpointEntry]], None]


class CheckpointManager:
    """Checkpoint slots [0, num_slots) and their index (page_size: of the keys' pages)."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.pool = SlotPool(num_slots)
        self.page_size = page_size
        self.index: dict[PageKey, CheckpointEntry] = {}
        # Per slot, for whole-history questions (which pages of a prefix have a checkpoint): the
        # key and the index of its page in the chain (-1: free slot). A pool holds a few dozen
        # checkpoints, so asking each one is cheaper than looking a history up.
        self._slot_key = np.zeros(num_slots, dtype=KEY_DTYPE)
        self._slot_page = np.full(num_slots, -1, dtype=np.int64)
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

    def _pages_with_checkpoint(self, keys: PageKeys, limit: int) -> np.ndarray:
        """Indices i < limit with a checkpoint at keys[i] (unsorted)."""
        out = np.empty(len(self._slot_page), dtype=np.int64)
        found = _on_chain(self._slot_page, self._slot_key, keys, min(limit, len(keys)), out)
        return out[:found]

    def keys_of(self, entries: list[CheckpointEntry]) -> PageKeys:
        """The keys of indexed entries, as `PageKeys` (read from their slots)."""
        if len(entries) == 1:
            slot = entries[0].slot
            return self._slot_key[slot : slot + 1]
        return self._slot_key[[e.slot for e in entries]]

    def deepest(self, keys: PageKeys, limit: int) -> int:
        """Largest i < limit with a checkpoint at keys[i] (-1 if none)."""
        found = self._pages_with_checkpoint(keys, limit)
        return int(found.max()) if len(found) else -1

    def on_path(self, keys: PageKeys, limit: int) -> list[int]:
        """Sorted page counts n <= limit with a checkpoint at keys[n - 1]."""
        return np.sort(self._pages_with_checkpoint(keys, limit) + 1).tolist()

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
        self._slot_key[slot] = (key & 0xFFFF_FFFF_FFFF_FFFF, key >> 64)
        self._slot_page[slot] = num_tokens // self.page_size - 1
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
        self._forget_slot(entry.slot)
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
            self._forget_slot(entry.slot)
        self.version += 1
        return len(victims)

    def _forget_slot(self, slot: SlotId) -> None:
        self._slot_key[slot] = 0
        self._slot_page[slot] = -1
        self.pool.free_one(slot)

    def check_integrity(self, expected_pins: Counter) -> None:
        """`expected_pins`: checkpoint key -> pins that live requests hold on it."""
        self.pool.check_integrity()
        slots = [e.slot for e in self.index.values()]
        held = np.zeros(len(self._slot_page), dtype=bool)
        held[slots] = True
        if (self._slot_page[~held] != -1).any() or self._slot_key[~held].view(np.uint64).any():
            raise IntegrityError("a free checkpoint slot still names a key")
        for e in self.index.values():
            if as_key_int(self._slot_key[e.slot]) != e.key or self._slot_page[e.slot] != (
                e.num_tokens // self.page_size - 1
            ):
                raise IntegrityError(f"checkpoint slot {e.slot} disagrees with its entry")
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
        # The LRU holds exactly the unpinned entries themselves: a stale or foreign entry there
        # would be evicted (its slot freed, its key deleted) under a live one.
        if any(self.index.get(key) is not entry for key, entry in self._lru.items()):
            raise IntegrityError("the checkpoint LRU holds an entry that is not indexed")
