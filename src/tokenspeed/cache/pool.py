"""A free list over a fixed range of integer ids: the allocator under every device pool."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

import numpy as np

from ._exhaust import exhaust
from .errors import CacheFullError, IntegrityError


class SlotPool:
    """Ids [0, size) handed out and taken back; ids in `reserved` are never handed out.

    Reserved ids are the sink page / sink slot that padded rows of a CUDA graph point at: they
    exist in the tensors but belong to nobody. Allocation is LIFO so recently freed (cache-warm)
    entries are reused first.
    """

    __slots__ = ("_free", "_is_free", "reserved", "size")

    def __init__(self, size: int, reserved: Iterable[int] = ()) -> None:
        self.size = size
        self.reserved = frozenset(reserved)
        if any(not 0 <= r < size for r in self.reserved):
            raise ValueError(f"reserved ids {sorted(self.reserved)} outside [0, {size})")
        # Highest ids at the bottom of the stack so that low ids are handed out first.
        self._free = [i for i in range(size - 1, -1, -1) if i not in self.reserved]
        self._is_free = bytearray(size)
        for i in self._free:
            self._is_free[i] = 1

    @property
    def capacity(self) -> int:
        """Ids that can ever be handed out."""
        return self.size - len(self.reserved)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def is_free(self, i: int) -> bool:
        return bool(self._is_free[i])

    def free_mask(self) -> np.ndarray:
        """[size] bool, True where the id is free."""
        return np.frombuffer(bytes(self._is_free), dtype=np.uint8).astype(bool)

    def allocate(self, n: int) -> list[int]:
        """n ids, or CacheFullError with nothing taken."""
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} entries, {len(self._free)} free")
        if n == 0:
            return []
        ids = self._free[-n:]
        del self._free[-n:]
        ids.reverse()
        exhaust(map(self._is_free.__setitem__, ids, repeat(0)))
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        is_free = self._is_free
        if len(set(ids)) != len(ids):
            raise IntegrityError(f"ids freed twice in one call: {ids}")
        # Checked before anything changes, so a bad call leaves the pool as it was.
        if any(map(is_free.__getitem__, ids)) or not self.reserved.isdisjoint(ids):
            bad = next(i for i in ids if i in self.reserved or is_free[i])
            raise IntegrityError(f"id {bad} freed twice or reserved")
        exhaust(map(is_free.__setitem__, ids, repeat(1)))
        self._free.extend(reversed(ids))

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise IntegrityError("an id is on the free list twice")
        if any(i in self.reserved for i in self._free):
            raise IntegrityError("a reserved id is on the free list")
        if sum(self._is_free) != len(self._free) or any(not self._is_free[i] for i in self._free):
            raise IntegrityError("free flags disagree with the free list")
