"""The embedded L2 backend: host memory of this process, LRU-evicted within a byte budget.

Payloads are copied into memory the tier owns (pinned when CUDA is present, so loads into the
device tier run as asynchronous DMA). In metadata-only mode only keys, sizes and the LRU order are
kept, which is what the simulator needs to compare shared and rank-local L2 at cluster scale.
Objects are immutable, so a loader that holds a payload keeps reading valid bytes even if the
object is evicted meanwhile.

Bookkeeping is sized for a shared tier of millions of objects: a record is a plain tuple
(position, nbytes, payload, crc), which the garbage collector stops tracking, and runs of keys
(a prefix, a fetched hit, a published turn) are looked up, touched and stored with C-level
`map` calls rather than a Python loop per key.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from operator import itemgetter

import attrs
import torch

from ...types import PageKey
from .._exhaust import exhaust
from ..errors import CacheConfigError, IntegrityError
from .base import HostCache, HostObject, L2Stats, ObjectKind


def crc32(payload: torch.Tensor) -> int:
    return zlib.crc32(payload.numpy())


# A stored object: (position, nbytes, payload or None, crc or None, run id, offset in the run),
# read by the field indexes below. A plain tuple, not a class or a NamedTuple: the garbage
# collector untracks exact tuples of atoms, which matters with millions of them.
_Record = tuple
_AT_NBYTES, _AT_PAYLOAD, _AT_RUN, _AT_OFFSET = 1, 2, 4, 5
_NO_RUN = -1  # objects stored by `put` belong to no run


class _Run:
    """The keys one `put_many` call stored, in the caller's order (a run of one chain: a
    published turn, pages written back together). `dead` lists, sorted, the offsets whose
    object is not this run's any more (evicted or removed) or never was (already stored by
    someone else). Every other offset's key is stored, by this run's record: so a prefix check
    can compare a slice of the caller's keys with the run's keys (C-level list comparison,
    identity first) instead of probing the store once per key."""

    __slots__ = ("alive", "dead", "keys")

    def __init__(self, keys: list[PageKey]) -> None:
        self.keys = keys
        self.dead: list[int] = []
        self.alive = 0


_POSITION = itemgetter(0)
_NBYTES = itemgetter(1)
_CHECKPOINT = "c"


def _name(is_checkpoint: bool, key: PageKey) -> Hashable:
    """The object's name in the LRU order: the key itself for a page (pages are the many
    objects: their touches hash nothing new), (_CHECKPOINT, key) for a checkpoint."""
    return (_CHECKPOINT, key) if is_checkpoint else key


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
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise CacheConfigError(
                f"capacity_bytes must be a positive integer, got {capacity_bytes!r}"
            )
        super().__init__(metadata_only=metadata_only)
        self.capacity_bytes = capacity_bytes
        self.checksum = checksum and not metadata_only
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pages: dict[PageKey, _Record] = {}
        self._checkpoints: dict[PageKey, _Record] = {}
        # Names (`_name`) of every stored object of both kinds, least recently used first.
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        self._runs: dict[int, _Run] = {}  # runs with at least one live object
        self._next_run = 0
        self._bytes = 0
        # Mutating calls so far, and the count at the last successful check_integrity().
        self._mutations = 0
        self._checked = -1
        self._empty = torch.empty(0, dtype=torch.uint8)

    def _store(self, kind: ObjectKind) -> dict[PageKey, _Record]:
        return self._checkpoints if kind is ObjectKind.CHECKPOINT else self._pages

    def contains(self, kind: ObjectKind, keys: Sequence[PageKey]) -> list[bool]:
        self.counters.lookups += len(keys)
        return list(map(self._store(kind).__contains__, keys))

    def prefix_present(self, kind: ObjectKind, keys: Sequence[PageKey]) -> int:
        store = self._store(kind)
        n = len(keys)
        if not n or keys[0] not in store:
            self.counters.lookups += min(1, n)
            return 0
        self.counters.lookups += n
        # Walk the runs that hold the prefix: one probe per run, a list comparison within it.
        # Where the runs are fragments (objects stored a few at a time), probe key by key.
        runs, i, short = self._runs, 0, 0
        while i < n:
            if short > 4:
                present = list(map(store.__contains__, keys[i:]))
                return i + present.index(False) if False in present else n
            s = store.get(keys[i])
            if s is None:
                return i
            run = runs.get(s[_AT_RUN])
            if run is None:  # stored by `put`: probe the rest one by one
                present = list(map(store.__contains__, keys[i:]))
                return i + present.index(False) if False in present else n
            off = s[_AT_OFFSET]
            stop = off + min(n - i, len(run.keys) - off)
            d = bisect.bisect_right(run.dead, off)  # `off` itself is live: keys[i] maps to it
            if d < len(run.dead):
                stop = min(stop, run.dead[d])
            m = stop - off
            if m > 1 and keys[i : i + m] != run.keys[off:stop]:
                same = list(map(operator.eq, keys[i : i + m], run.keys[off:stop]))
                m = same.index(False)
            short = short + 1 if m < 8 else 0
            i += m
        return n

    def last_present(self, kind: ObjectKind, keys: Sequence[PageKey]) -> int:
        store = self._store(kind)
        if not keys:
            return -1
        if keys[-1] in store:
            self.counters.lookups += 1
            return len(keys) - 1
        self.counters.lookups += len(keys)
        present = list(map(store.__contains__, reversed(keys)))
        return len(keys) - 1 - present.index(True) if True in present else -1

    def put(self, objects: Sequence[HostObject]) -> int:
        self._mutations += 1
        stored = 0
        c = self.counters
        lru = self._lru
        for obj in objects:
            is_checkpoint = obj.kind is ObjectKind.CHECKPOINT
            store = self._checkpoints if is_checkpoint else self._pages
            name = _name(is_checkpoint, obj.key)
            if obj.key in store:
                lru.move_to_end(name)
                stored += 1
                continue
            if obj.nbytes > self.capacity_bytes:
                c.dropped_writes += 1
                continue
            payload, crc = None, None
            if not self.metadata_only:
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
            if self._bytes + obj.nbytes > self.capacity_bytes:
                self._make_room(obj.nbytes)
            store[obj.key] = (obj.position, obj.nbytes, payload, crc, _NO_RUN, 0)
            lru[name] = None
            self._bytes += obj.nbytes
            c.puts += 1
            c.put_bytes += obj.nbytes
            stored += 1
        return stored

    def put_many(
        self,
        kind: ObjectKind,
        keys: Sequence[PageKey],
        positions: Sequence[int],
        payloads: Sequence[torch.Tensor] | None = None,
    ) -> int:
        self._mutations += 1
        if payloads is not None or not self.metadata_only:
            return super().put_many(kind, keys, positions, payloads)
        # Metadata-only: `put` of the same objects, without building them first.
        nbytes = self.object_bytes(kind)
        c = self.counters
        if nbytes > self.capacity_bytes:
            c.dropped_writes += len(keys)
            return 0
        is_checkpoint = kind is ObjectKind.CHECKPOINT
        store = self._checkpoints if is_checkpoint else self._pages
        lru, capacity = self._lru, self.capacity_bytes
        run_id = self._next_run
        self._next_run += 1
        # The run lists the keys by position (write-back hands pages over tail first), so that
        # it lines up with the chain slices prefix checks are asked about.
        if all(map(operator.lt, positions, positions[1:])):
            offsets: Sequence[int] = range(len(keys))
            run = _Run(list(keys))
        else:
            order = sorted(range(len(keys)), key=positions.__getitem__)
            offsets = [0] * len(keys)
            exhaust(map(offsets.__setitem__, order, range(len(keys))))
            run = _Run(list(map(keys.__getitem__, order)))
        run.alive = 1  # held while it is being filled: evictions below may hit its records
        self._runs[run_id] = run
        dead = run.dead
        added = 0
        for offset, key, position in zip(offsets, keys, positions, strict=True):
            name = (_CHECKPOINT, key) if is_checkpoint else key
            if key in store:
                lru.move_to_end(name)
                bisect.insort(dead, offset)  # someone else's object
                continue
            if self._bytes + nbytes > capacity:
                self._make_room(nbytes)
            store[key] = (position, nbytes, None, None, run_id, offset)
            lru[name] = None
            self._bytes += nbytes
            added += 1
            run.alive += 1
        run.alive -= 1
        if not run.alive:
            del self._runs[run_id]
        c.puts += added
        c.put_bytes += added * nbytes
        return len(keys)

    def get(
        self, kind: ObjectKind, keys: Sequence[PageKey], positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        self._mutations += 1  # LRU touches, and rejected objects are dropped
        store = self._store(kind)
        expected = self.object_bytes(kind)
        c = self.counters
        if self.metadata_only:
            # Batched read of a run in which every object is present and as expected (the
            # common case): the same LRU touches and counts as the loop below, in C.
            found = list(map(store.get, keys))
            if (
                None not in found
                and list(map(_POSITION, found)) == list(positions)
                and all(map(expected.__eq__, map(_NBYTES, found)))
            ):
                is_checkpoint = kind is ObjectKind.CHECKPOINT
                names = [_name(True, k) for k in keys] if is_checkpoint else keys
                exhaust(map(self._lru.move_to_end, names))
                c.hits += len(found)
                c.get_bytes += len(found) * expected
                return [self._empty] * len(found)
        is_checkpoint = kind is ObjectKind.CHECKPOINT
        out: list[torch.Tensor | None] = []
        for key, position in zip(keys, positions, strict=True):
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
            self._lru.move_to_end(_name(is_checkpoint, key))
            c.hits += 1
            c.get_bytes += s[_AT_NBYTES]
            out.append(self._empty if s[_AT_PAYLOAD] is None else s[_AT_PAYLOAD])
        return out

    def _valid(self, s: _Record, position: int, expected: int) -> bool:
        pos, nbytes, payload, crc = s[:4]
        if pos != position or nbytes != expected:
            return False
        if payload is None:
            return self.metadata_only
        if payload.numel() != expected:
            return False
        return not self.checksum or crc32(payload) == crc

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used objects until `nbytes` more fit."""
        lru, pages, checkpoints = self._lru, self._pages, self._checkpoints
        evicted = 0
        while self._bytes + nbytes > self.capacity_bytes:
            name, _ = lru.popitem(last=False)
            s = checkpoints.pop(name[1]) if type(name) is tuple else pages.pop(name)
            self._bytes -= s[_AT_NBYTES]
            self._forget(s)
            evicted += 1
        self.counters.evictions += evicted

    def _forget(self, s: _Record) -> None:
        """A record left the store: its run no longer vouches for its offset."""
        run = self._runs.get(s[_AT_RUN])
        if run is not None:
            bisect.insort(run.dead, s[_AT_OFFSET])
            run.alive -= 1
            if not run.alive:
                del self._runs[s[_AT_RUN]]

    def _drop(self, kind: ObjectKind, key: PageKey) -> None:
        is_checkpoint = kind is ObjectKind.CHECKPOINT
        s = (self._checkpoints if is_checkpoint else self._pages).pop(key)
        del self._lru[_name(is_checkpoint, key)]
        self._bytes -= s[_AT_NBYTES]
        self._forget(s)

    def remove(self, kind: ObjectKind, keys: Sequence[PageKey]) -> int:
        self._mutations += 1
        store = self._store(kind)
        removed = 0
        for key in keys:
            if key in store:
                self._drop(kind, key)
                removed += 1
        return removed

    def corrupt_for_test(self, kind: ObjectKind, key: PageKey) -> None:
        """Flip one payload byte in place (fault-injection hook for tests)."""
        self._mutations += 1
        payload = self._store(kind)[key][_AT_PAYLOAD]
        if payload is not None and payload.numel():
            payload[0] ^= 0xFF

    def stats(self) -> L2Stats:
        c = self.counters
        return L2Stats(
            backend=self.backend_name,
            available=True,
            objects=len(self._lru),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            **attrs.asdict(c),
        )

    def check_integrity(self) -> None:
        """Stores, LRU order, byte count, payload presence and runs all agree. A shared tier is
        checked by every manager that uses it: a state already verified (no mutation since) is
        not walked again."""
        if self._checked == self._mutations:
            return
        lru = self._lru
        names_ok = len(lru) == len(self._pages) + len(self._checkpoints) and all(
            map(lru.__contains__, self._pages)
        )
        if not names_ok or any(_name(True, k) not in lru for k in self._checkpoints):
            raise IntegrityError("L2 LRU order disagrees with the stored objects")
        records = (*self._pages.values(), *self._checkpoints.values())
        total = sum(map(_NBYTES, records))
        if total != self._bytes or self._bytes > self.capacity_bytes:
            raise IntegrityError(
                f"L2 holds {total} bytes, accounts {self._bytes}, capacity {self.capacity_bytes}"
            )
        without_payload = sum(s[_AT_PAYLOAD] is None for s in records)
        if without_payload != (len(records) if self.metadata_only else 0):
            raise IntegrityError("L2 payload presence disagrees with metadata_only")
        self._check_runs()
        self._checked = self._mutations

    def _check_runs(self) -> None:
        """Each record of a run sits at a live offset holding its key; runs count their records;
        dead offsets are sorted and distinct; no run without records is kept."""
        runs = self._runs
        members: dict[int, list[int]] = {}
        for store in (self._pages, self._checkpoints):
            for key, s in store.items():
                rid, off = s[_AT_RUN], s[_AT_OFFSET]
                if rid == _NO_RUN:
                    continue
                run = runs.get(rid)
                if run is None or not 0 <= off < len(run.keys) or run.keys[off] != key:
                    raise IntegrityError(f"L2 object {key!r} is not where its run says")
                members.setdefault(rid, []).append(off)
        if members.keys() != runs.keys():
            raise IntegrityError("L2 keeps a run without objects, or an object's run is gone")
        for rid, run in runs.items():
            offs = members[rid]
            dead = run.dead
            if (
                run.alive != len(offs)
                or any(a >= b for a, b in itertools.pairwise(dead))
                or len(offs) + len(dead) != len(run.keys)
                or not set(offs).isdisjoint(dead)
            ):
                raise IntegrityError(f"L2 run {rid}: live and dead offsets disagree")
