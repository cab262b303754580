"""The embedded L2 backend: host memory of this process, LRU-evicted within a byte budget.

Payloads are copied into memory the tier owns (pinned when CUDA is present, so loads into the
device tier run as asynchronous DMA). In metadata-only mode only keys, sizes and the LRU order are
kept, which is what the simulator needs to compare shared and rank-local L2 at cluster scale.
Objects are immutable, so a loader that holds a payload keeps reading valid bytes even if the
object is evicted meanwhile.

Bookkeeping is sized for a shared tier of millions of objects. Each stored object has a slot, an
index into numpy columns (key, position, size, kind) and the LRU stamps (`SlotLru`); a `KeyTable`
per kind maps keys to slots. Batched calls on chain slices (a prefix check, a fetched hit, a
published turn, pages written back together) resolve all their keys in one table call and touch,
check and evict with whole-array operations. Every batch gives exactly the answers, counters and
LRU order of the same objects handled one at a time; where a batch cannot guarantee that (a write
that would evict one of its own objects, a key repeated in one write), it takes the per-object
path.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from itertools import repeat

import attrs
import numpy as np
import torch

from ...types import PageKey
from .._exhaust import exhaust
from ..compiled import jit
from ..errors import CacheConfigError, IntegrityError
from ..key_table import KeyTable
from ..keys import KEY_DTYPE, PageKeys, as_page_keys, key_array, keys_to_ints
from .base import HostCache, HostObject, L2Stats, ObjectKind
from .chain_runs import ChainRuns
from .slot_lru import FREE, SlotLru

_NONE, _PAGE, _CHECKPOINT = -1, 0, 1  # what a slot holds
_KIND = {ObjectKind.PAGE: _PAGE, ObjectKind.CHECKPOINT: _CHECKPOINT}


@jit
def _all_readable(slots, pos, nbytes, positions, expected):
    """Every slot holds an object (>= 0) stored at its expected position and size."""
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0 or pos[s] != positions[i] or nbytes[s] != expected:
            return False
    return True


@jit
def _store_new(
    got, taken, new, new_keys, positions, nbytes, kind, pos, sizes, key_col, kind_of, slots
):
    """Fill the columns for a batch's new objects, unless a key repeats in the batch.

    taken: [k] int64, the slots handed out for them; got: [k] int64, what `KeyTable.setdefault`
    answered for their keys (equal to `taken` unless a key repeats); new: [k] int64, their indices
    in the batch; new_keys: [k] KEY_DTYPE; positions: [n] int64, the whole batch's; slots: [n]
    int64, the batch's lookup (-1 at the new objects), given each new object's slot. Returns
    False, having written nothing, where `got` differs from `taken`."""
    k = taken.shape[0]
    for i in range(k):
        if got[i] != taken[i]:
            return False
    for i in range(k):
        s = taken[i]
        j = new[i]
        pos[s] = positions[j]
        sizes[s] = nbytes
        key_col[s] = new_keys[i]
        kind_of[s] = kind
        slots[j] = s
    return True


@jit
def _clear_slots(slots, key_col, kind_of, sizes, free_stack, top):
    """Slots ([m] int64) whose objects left: name no key and no kind from now on, and go on the
    free stack at `top` in this order. Returns the bytes their objects held."""
    freed = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        key_col[s]["lo"] = 0
        key_col[s]["hi"] = 0
        kind_of[s] = _NONE
        freed += sizes[s]
        free_stack[top + i] = s
    return freed


def crc32(payload: torch.Tensor) -> int:
    return zlib.crc32(payload.numpy())


class LocalHostCache(HostCache):
    """In-process L2 of `capacity_bytes`.

    pin_memory: pin payloads (default: when CUDA is available).
    checksum: keep a CRC32 per object and verify it on every read (costs ~1 ms per MB of
        payload on one core; turn off when the memory is trusted and reads are hot).
    """

    backend_name = "local"

    def __init__(
        self,
        *,
        capacity_bytes: int,
        metadata_only: bool = False,
        pin_memory: bool | None = None,
        checksum: bool = True,
    ) -> None:
        if (
            not isinstance(capacity_bytes, int)
            or isinstance(capacity_bytes, bool)
            or capacity_bytes <= 0
        ):
            raise CacheConfigError(
                f"capacity_bytes must be a positive integer, got {capacity_bytes!r}"
            )
        # A string such as "no" is truthy: take only a real bool (as `CacheConfig` does).
        for name, flag in (("metadata_only", metadata_only), ("checksum", checksum)):
            if not isinstance(flag, bool):
                raise CacheConfigError(f"{name} must be a bool, got {flag!r}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise CacheConfigError(f"pin_memory must be a bool or None, got {pin_memory!r}")
        super().__init__(metadata_only=metadata_only)
        self.capacity_bytes = capacity_bytes
        self.checksum = checksum and not metadata_only
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # key -> slot, one table per kind.
        self._pages = KeyTable()
        self._checkpoints = KeyTable()
        # Per slot: numpy columns for what batches compare and sum, lists for payloads.
        self._pos = np.zeros(0, dtype=np.int64)  # page index, or the checkpoint's length
        self._nbytes = np.zeros(0, dtype=np.int64)
        self._keys = np.zeros(0, dtype=KEY_DTYPE)  # zeros where the slot holds nothing
        self._kind_of = np.zeros(0, dtype=np.int8)  # per slot: _PAGE, _CHECKPOINT or _NONE
        self._set_near()
        self._payload: list[torch.Tensor | None] = []
        self._crc: list[int | None] = []
        # Slots holding no object: a stack (`_free_stack[:_free_top]`, the top handed out first).
        self._free_stack = np.zeros(0, dtype=np.int64)
        self._free_top = 0
        self._lru = SlotLru()
        self._runs = ChainRuns()  # pages written in one batch as consecutive pages of a chain
        self._bytes = 0
        self._presence = 0  # bumped whenever an object is stored or leaves
        # Mutating calls so far, and the count at the last successful check_integrity().
        self._mutations = 0
        self._checked = -1
        self._empty = torch.empty(0, dtype=torch.uint8)

    def presence_version(self) -> int:
        return self._presence

    def _slots(self, kind: ObjectKind, keys: PageKeys) -> np.ndarray:
        """[n] int64: the slot holding each key's object of this kind, -1 where absent (a
        chain stored in one go usually sits in consecutive slots: the lookup follows them; one
        key has no neighbour to follow, and the plain lookup is the cheaper call)."""
        if kind is ObjectKind.PAGE:
            return self._pages.lookup(keys, self._near_pages if len(keys) > 1 else None)
        return self._checkpoints.lookup(keys, self._near_checkpoints if len(keys) > 1 else None)

    def _set_near(self) -> None:
        """Where each kind's lookups look first (`KeyTable.lookup`): the key column."""
        self._near_pages = (self._keys, self._kind_of, _PAGE)
        self._near_checkpoints = (self._keys, self._kind_of, _CHECKPOINT)

    def _store(self, kind: ObjectKind) -> KeyTable:
        return self._checkpoints if kind is ObjectKind.CHECKPOINT else self._pages

    # ------------------------------------------------------------------------------ slots
    def _take_slots(self, n: int) -> np.ndarray:
        """[n] int64 unused slots, the top of the free stack in stack order (the columns grow
        when the free slots run out)."""
        top = self._free_top
        if n <= top:  # the usual case: no growth
            self._free_top = top - n
            # A copy: the stack's top is rewritten as soon as slots are freed.
            return self._free_stack[top - n : top].copy()
        k = top
        got = self._free_stack[top - k : top].copy()
        self._free_top = top - k
        if k < n:
            size = len(self._pos)
            extra = n - k
            grown = max(2 * size, size + extra, 1024)
            self._grow(grown)
            got = np.concatenate((got, np.arange(size, size + extra, dtype=np.int64)))
            self._push_free(np.arange(grown - 1, size + extra - 1, -1, dtype=np.int64))
        return got

    def _push_free(self, slots: np.ndarray) -> None:
        top = self._free_top
        self._free_stack[top : top + len(slots)] = slots
        self._free_top = top + len(slots)

    def _grow(self, size: int) -> None:
        old = len(self._pos)
        for name in ("_pos", "_nbytes", "_keys", "_kind_of"):
            col = getattr(self, name)
            grown = np.zeros(size, dtype=col.dtype)
            grown[:old] = col
            setattr(self, name, grown)
        self._kind_of[old:] = _NONE
        self._set_near()
        stack = np.zeros(size, dtype=np.int64)
        stack[: self._free_top] = self._free_stack[: self._free_top]
        self._free_stack = stack
        extra = size - old
        self._payload.extend(repeat(None, extra))
        self._crc.extend(repeat(None, extra))
        self._lru.grow(size)
        self._runs.grow(size)

    def _release(self, slots: np.ndarray) -> int:
        """Slots whose objects left their store: clear them and return them to the free list.
        Returns the bytes their objects held (not yet taken off the byte count)."""
        self._presence += 1
        self._lru.forget(slots)
        self._runs.forget(slots)
        if not self.metadata_only:
            listed = slots.tolist()
            exhaust(map(self._payload.__setitem__, listed, repeat(None)))
            exhaust(map(self._crc.__setitem__, listed, repeat(None)))
        top = self._free_top
        freed = _clear_slots(slots, self._keys, self._kind_of, self._nbytes, self._free_stack, top)
        self._free_top = top + len(slots)
        return int(freed)

    def _evict(self, need: int) -> None:
        """Evict least recently used objects until `need` more bytes are free."""
        victims, _, position = self._lru.oldest(self._nbytes, need)
        self._lru.consume(position)
        self._drop_slots(victims)
        self.counters.evictions += len(victims)

    def _drop_slots(self, slots: np.ndarray) -> None:
        ckpt = self._kind_of[slots] == _CHECKPOINT
        if np.count_nonzero(ckpt):
            self._checkpoints.delete(self._keys[slots[ckpt]])
            self._pages.delete(self._keys[slots[~ckpt]])
        else:  # only pages (the common case)
            self._pages.delete(self._keys[slots])
        self._bytes -= self._release(slots)

    # ---------------------------------------------------------------------------- lookups
    def contains(self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey]) -> np.ndarray:
        if type(keys) is not np.ndarray or keys.dtype is not KEY_DTYPE:
            keys = as_page_keys(keys)
        self.counters.lookups += len(keys)
        return self._slots(kind, keys) >= 0

    def prefix_present(self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey]) -> int:
        keys = as_page_keys(keys)
        n = len(keys)
        if kind is ObjectKind.PAGE:
            found = self._pages.prefix_chain(keys, self._near_pages, self._runs.arrays)
        else:
            found = self._checkpoints.prefix(keys, self._near_checkpoints)
        # Counted as keys asked about: the first one when it is absent, else all of them.
        self.counters.lookups += min(1, n) if found == 0 else n
        return found

    def last_present(self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey]) -> int:
        keys = as_page_keys(keys)
        n = len(keys)
        if not n:
            return -1
        found = self._store(kind).last_present(keys)
        self.counters.lookups += 1 if found == n - 1 else n
        return found

    # ----------------------------------------------------------------------------- writes
    def put(self, objects: Sequence[HostObject]) -> int:
        self._mutations += 1
        stored = 0
        evictions = self.counters.evictions
        for obj in objects:
            payload, crc = None, None
            if not self.metadata_only and self._store(obj.kind).get(obj.key) is None:
                if obj.payload is None or obj.payload.dtype != torch.uint8:
                    raise IntegrityError(f"{obj.kind} {obj.key!r}: a uint8 payload is required")
                if obj.payload.numel() != obj.nbytes:
                    raise IntegrityError(
                        f"{obj.kind} {obj.key!r}: payload of {obj.payload.numel()} bytes, "
                        f"declared {obj.nbytes}"
                    )
                # Copy: the caller's tensor may be a view into a larger staging buffer.
                payload = obj.payload.pin_memory() if self._pin else obj.payload.clone()
                crc = crc32(payload) if self.checksum else None
            stored += self._put_one(obj.kind, obj.key, obj.position, obj.nbytes, payload, crc)
        if self.counters.evictions != evictions and stored:
            # A later object may have evicted an earlier one of this call: count the survivors.
            stored = sum(self._store(obj.kind).get(obj.key) is not None for obj in objects)
        return stored

    def _put_one(
        self,
        kind: ObjectKind,
        key: PageKey,
        position: int,
        nbytes: int,
        payload: torch.Tensor | None,
        crc: int | None,
    ) -> int:
        """Store one object (the per-object path every batch reproduces); 1 if it is stored
        (an object stored or touched here may still be evicted by a later one of the same call)."""
        store = self._store(kind)
        s = store.get(key)
        if s is not None:
            self._lru.touch_one(s)
            return 1
        if nbytes > self.capacity_bytes:
            self.counters.dropped_writes += 1
            return 0
        if self._bytes + nbytes > self.capacity_bytes:
            self._evict(self._bytes + nbytes - self.capacity_bytes)
        taken = self._take_slots(1)
        s = int(taken[0])
        self._pos[s] = position
        self._nbytes[s] = nbytes
        self._keys[s] = (key & 0xFFFF_FFFF_FFFF_FFFF, key >> 64)
        self._kind_of[s] = _KIND[kind]
        self._payload[s] = payload
        self._crc[s] = crc
        store.setdefault(self._keys[s : s + 1], taken)
        self._presence += 1
        self._lru.touch_one(s)
        self._bytes += nbytes
        self.counters.puts += 1
        self.counters.put_bytes += nbytes
        return 1

    def put_many(
        self,
        kind: ObjectKind,
        keys: PageKeys | Sequence[PageKey],
        positions: Sequence[int],
        payloads: Sequence[torch.Tensor] | None = None,
        *,
        chain: bool = False,
    ) -> int:
        self._mutations += 1
        keys = as_page_keys(keys)
        if payloads is not None or not self.metadata_only:
            return super().put_many(kind, keys, positions, payloads)
        nbytes = self.object_bytes(kind)
        if nbytes > self.capacity_bytes:
            self.counters.dropped_writes += len(keys)
            return 0
        if len(keys) != len(positions):
            raise ValueError(f"{len(keys)} keys, {len(positions)} positions")
        if self._put_batch(kind, keys, positions, nbytes, chain and kind is ObjectKind.PAGE):
            return len(keys)  # the batch evicted none of its own objects: all are stored
        evictions = self.counters.evictions
        for key, position in zip(keys_to_ints(keys), positions, strict=True):
            self._put_one(kind, key, position, nbytes, None, None)
        if self.counters.evictions == evictions:
            return len(keys)
        # Later objects evicted earlier ones of this call: count the survivors.
        return int(np.count_nonzero(self._slots(kind, keys) >= 0))

    def _put_batch(
        self,
        kind: ObjectKind,
        keys: PageKeys,
        positions: Sequence[int],
        nbytes: int,
        chain: bool = False,
    ) -> bool:
        """Metadata-only `put_many` in whole-array steps. Returns False, having changed nothing,
        where the result could differ from storing the objects one by one: the eviction it
        needs would reach one of the batch's own objects, or a new key repeats. True: every
        object of the batch is stored. With `chain` (the keys are consecutive pages of one
        chain), each stretch of new pages becomes a run (`ChainRuns`)."""
        n = len(keys)
        if not n:
            return True
        store = self._store(kind)
        slots = self._slots(kind, keys)
        new = (slots < 0).nonzero()[0]
        k = len(new)
        need = self._bytes + k * nbytes - self.capacity_bytes
        victims, position = None, 0
        if need > 0:
            victims, freed, position = self._lru.oldest(self._nbytes, need)
            if freed < need:
                return False  # the old objects do not make room: later inserts evict earlier
            present = slots[slots >= 0]
            stamp = self._lru.stamp
            if len(present) and stamp[present].min() <= stamp[victims[-1]]:
                return False  # one by one, this batch would evict one of its own objects
        if k:
            new_keys = keys[new] if k < n else keys
            taken = self._take_slots(k)
            got = store.setdefault(new_keys, taken)
            # The victims' slots are not among `taken`: the columns may be filled first.
            if not _store_new(
                got,
                taken,
                new,
                new_keys,
                np.asarray(positions, dtype=np.int64),
                nbytes,
                _PAGE if kind is ObjectKind.PAGE else _CHECKPOINT,
                self._pos,
                self._nbytes,
                self._keys,
                self._kind_of,
                slots,
            ):  # a key repeats within the batch
                store.delete(new_keys[got == taken])
                self._push_free(taken)
                return False
            if victims is not None:
                self._lru.consume(position)
                self._drop_slots(victims)
                self.counters.evictions += len(victims)
            self._presence += 1
            self._bytes += k * nbytes
            self.counters.puts += k
            self.counters.put_bytes += k * nbytes
            if chain and k > 1 and new[-1] - new[0] == k - 1:
                # The new pages are one stretch of the chain (the usual turn): a run.
                self._runs.add(taken)
        self._lru.touch(slots)
        return True

    # ------------------------------------------------------------------------------ reads
    def get(
        self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey], positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        keys = as_page_keys(keys)
        if self.metadata_only and self._read_all(kind, keys, positions):
            return [self._empty] * len(keys)
        return self._get_each(kind, keys, positions)

    def get_present(
        self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey], positions: Sequence[int]
    ) -> np.ndarray:
        keys = as_page_keys(keys)
        if self.metadata_only and self._read_all(kind, keys, positions):
            return np.ones(len(keys), dtype=bool)
        return np.array([p is not None for p in self._get_each(kind, keys, positions)], dtype=bool)

    def _read_all(self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]) -> bool:
        """Metadata-only read of objects that are all present and as expected (the common
        case), with the touches and counts of `_get_each`; False, changing nothing, otherwise."""
        n = len(keys)
        if not n:
            return False
        slots = self._slots(kind, keys)
        expected = self.object_bytes(kind)
        if not _all_readable(
            slots, self._pos, self._nbytes, np.asarray(positions, dtype=np.int64), expected
        ):
            return False
        self._mutations += 1
        self._lru.touch(slots)
        self.counters.hits += n
        self.counters.get_bytes += n * expected
        return True

    def _get_each(
        self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """`get` one object at a time: LRU touches, counts, and rejected objects dropped."""
        self._mutations += 1
        store = self._store(kind)
        expected = self.object_bytes(kind)
        c = self.counters
        out: list[torch.Tensor | None] = []
        for key, position in zip(keys_to_ints(keys), positions, strict=True):
            s = store.get(key)
            if s is None:
                c.misses += 1
                out.append(None)
                continue
            if not self._valid(s, position, expected):
                c.corrupt += 1
                c.misses += 1
                self._drop(kind, key)
                out.append(None)
                continue
            self._lru.touch_one(s)
            c.hits += 1
            c.get_bytes += int(self._nbytes[s])
            payload = self._payload[s]
            out.append(self._empty if payload is None else payload)
        return out

    def _valid(self, s: int, position: int, expected: int) -> bool:
        if self._pos[s] != position or self._nbytes[s] != expected:
            return False
        payload = self._payload[s]
        if payload is None:
            return self.metadata_only
        if payload.numel() != expected:
            return False
        return not self.checksum or crc32(payload) == self._crc[s]

    # ---------------------------------------------------------------------------- removal
    def _drop(self, kind: ObjectKind, key: PageKey) -> None:
        s = int(self._store(kind).delete(key_array(key))[0])
        self._bytes -= self._release(np.array([s], dtype=np.int64))

    def remove(self, kind: ObjectKind, keys: PageKeys | Sequence[PageKey]) -> int:
        self._mutations += 1
        store = self._store(kind)
        removed = 0
        for key in keys_to_ints(as_page_keys(keys)):
            if key in store:
                self._drop(kind, key)
                removed += 1
        return removed

    def corrupt_for_test(self, kind: ObjectKind, key: PageKey | np.void) -> None:
        """Flip one payload byte in place (fault-injection hook for tests)."""
        self._mutations += 1
        payload = self._payload[self._store(kind).get(key)]
        if payload is not None and payload.numel():
            payload[0] ^= 0xFF

    # ------------------------------------------------------------------ accounting, checks
    def stats(self) -> L2Stats:
        c = self.counters
        return L2Stats(
            backend=self.backend_name,
            available=True,
            objects=len(self._pages) + len(self._checkpoints),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            **attrs.asdict(c),
        )

    def check_integrity(self) -> None:
        """Stores, slots, LRU log, byte count, payload presence and runs all agree. A shared tier
        is checked by every manager that uses it: a state already verified (no mutation since) is
        not walked again."""
        if self._checked == self._mutations:
            return
        size = len(self._pos)
        used = self._lru.stamp[:size] != FREE
        held: list[np.ndarray] = []
        for store, is_ckpt in ((self._pages, False), (self._checkpoints, True)):
            store.check_integrity()
            keys, slots = store.items()
            if (
                self._keys[slots].tobytes() != keys.tobytes()
                or (self._kind_of[slots] != (_CHECKPOINT if is_ckpt else _PAGE)).any()
            ):
                raise IntegrityError("L2 store entry does not match its slot")
            held.append(slots)
        held_slots = np.concatenate(held)
        if len(np.unique(held_slots)) != len(held_slots) or int(used.sum()) != len(held_slots):
            raise IntegrityError("L2 slots in use disagree with the stored objects")
        if len(held_slots) and not used[held_slots].all():
            raise IntegrityError("L2 stored object has no LRU stamp")
        free_slots = self._free_stack[: self._free_top]
        # Before the checks below: numpy would read -1 there as the last slot.
        if len(free_slots) and (free_slots.min() < 0 or free_slots.max() >= size):
            raise IntegrityError(f"an L2 free slot is outside [0, {size})")
        free = free_slots.tolist()
        if len(set(free)) != len(free) or len(free) + len(held_slots) != size or used[free].any():
            raise IntegrityError("L2 free slots disagree with the slots in use")
        if self._keys[np.asarray(free, dtype=np.int64)].view(np.uint64).any():
            raise IntegrityError("L2 free slot still names a key")
        total = int(self._nbytes[:size][used].sum())
        if total != self._bytes or self._bytes > self.capacity_bytes:
            raise IntegrityError(
                f"L2 holds {total} bytes, accounts {self._bytes}, capacity {self.capacity_bytes}"
            )
        without_payload = sum(self._payload[s] is None for s in held_slots.tolist())
        if without_payload != (len(held_slots) if self.metadata_only else 0):
            raise IntegrityError("L2 payload presence disagrees with metadata_only")
        self._lru.check_integrity()
        self._runs.check_integrity(self._kind_of[:size] == _PAGE)
        self._checked = self._mutations
