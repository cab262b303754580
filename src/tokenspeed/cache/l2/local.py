"""The embedded L2 backend: host memory of this process, LRU-evicted within a byte budget.

Payloads are copied into memory the tier owns (pinned when CUDA is present, so loads into the
device tier run as asynchronous DMA). In metadata-only mode only keys, sizes and the LRU order are
kept, which is what the simulator needs to compare shared and rank-local L2 at cluster scale.
Objects are immutable, so a loader that holds a payload keeps reading valid bytes even if the
object is evicted meanwhile.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

import attrs
import torch

from ...types import PageKey
from ..errors import CacheConfigError, IntegrityError
from .base import HostCache, HostObject, L2Stats, ObjectKind


def crc32(payload: torch.Tensor) -> int:
    return zlib.crc32(payload.numpy())


@attrs.define(slots=True)
class _Stored:
    position: int
    nbytes: int
    payload: torch.Tensor | None
    crc: int | None


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
        self._pages: dict[PageKey, _Stored] = {}
        self._checkpoints: dict[PageKey, _Stored] = {}
        # Keyed by (is_checkpoint, key): hashing enum members is slow in CPython.
        self._lru: OrderedDict[tuple[bool, PageKey], None] = OrderedDict()
        self._bytes = 0
        self._empty = torch.empty(0, dtype=torch.uint8)

    def _store(self, kind: ObjectKind) -> dict[PageKey, _Stored]:
        return self._checkpoints if kind is ObjectKind.CHECKPOINT else self._pages

    def contains(self, kind: ObjectKind, keys: Sequence[PageKey]) -> list[bool]:
        self.counters.lookups += len(keys)
        store = self._store(kind)
        return [k in store for k in keys]

    def prefix_present(self, kind: ObjectKind, keys: Sequence[PageKey]) -> int:
        store = self._store(kind)
        if not keys or keys[0] not in store:
            self.counters.lookups += min(1, len(keys))
            return 0
        self.counters.lookups += len(keys)
        present = list(map(store.__contains__, keys))
        return present.index(False) if False in present else len(present)

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
        stored = 0
        c = self.counters
        lru = self._lru
        for obj in objects:
            is_checkpoint = obj.kind is ObjectKind.CHECKPOINT
            store = self._checkpoints if is_checkpoint else self._pages
            name = (is_checkpoint, obj.key)
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
            while self._bytes + obj.nbytes > self.capacity_bytes:
                self._evict_one()
            store[obj.key] = _Stored(obj.position, obj.nbytes, payload, crc)
            lru[name] = None
            self._bytes += obj.nbytes
            c.puts += 1
            c.put_bytes += obj.nbytes
            stored += 1
        return stored

    def get(
        self, kind: ObjectKind, keys: Sequence[PageKey], positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        store = self._store(kind)
        expected = self.object_bytes(kind)
        c = self.counters
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
            self._lru.move_to_end((kind is ObjectKind.CHECKPOINT, key))
            c.hits += 1
            c.get_bytes += s.nbytes
            out.append(self._empty if s.payload is None else s.payload)
        return out

    def _valid(self, s: _Stored, position: int, expected: int) -> bool:
        if s.position != position or s.nbytes != expected:
            return False
        if s.payload is None:
            return self.metadata_only
        if s.payload.numel() != expected:
            return False
        return not self.checksum or crc32(s.payload) == s.crc

    def _evict_one(self) -> None:
        (is_checkpoint, key), _ = self._lru.popitem(last=False)
        s = (self._checkpoints if is_checkpoint else self._pages).pop(key)
        self._bytes -= s.nbytes
        self.counters.evictions += 1

    def _drop(self, kind: ObjectKind, key: PageKey) -> None:
        s = self._store(kind).pop(key)
        del self._lru[(kind is ObjectKind.CHECKPOINT, key)]
        self._bytes -= s.nbytes

    def remove(self, kind: ObjectKind, keys: Sequence[PageKey]) -> int:
        store = self._store(kind)
        removed = 0
        for key in keys:
            if key in store:
                self._drop(kind, key)
                removed += 1
        return removed

    def corrupt_for_test(self, kind: ObjectKind, key: PageKey) -> None:
        """Flip one payload byte in place (fault-injection hook for tests)."""
        payload = self._store(kind)[key].payload
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
        stores = ((False, self._pages), (True, self._checkpoints))
        stored = {(flag, key) for flag, store in stores for key in store}
        if stored != set(self._lru):
            raise IntegrityError("L2 LRU order disagrees with the stored objects")
        total = sum(s.nbytes for _, store in stores for s in store.values())
        if total != self._bytes or self._bytes > self.capacity_bytes:
            raise IntegrityError(
                f"L2 holds {total} bytes, accounts {self._bytes}, capacity {self.capacity_bytes}"
            )
        for _, store in stores:
            for s in store.values():
                if (s.payload is None) != self.metadata_only:
                    raise IntegrityError("L2 payload presence disagrees with metadata_only")
