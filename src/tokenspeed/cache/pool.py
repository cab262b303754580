"""A free list over a fixed range of integer ids: the allocator under every device pool."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .errors import CacheFullError, IntegrityError
from .page_kernels import NOT_HELD, OK, OUT_OF_RANGE, as_int64, pool_pop, pool_push


def as_ids(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """[n] int64 view or copy of page / slot ids (arrays pass through unconverted)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64:
        return ids
    return np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)


class SlotPool:
    """Ids [0, size) handed out and taken back; ids in `reserved` are never handed out.

    Reserved ids are the sink page / sink slot that padded rows of a CUDA graph point at: they
    exist in the tensors but belong to nobody. Allocation is LIFO so recently freed (cache-warm)
    entries are reused first.

    The free list is a numpy stack (`_stack[:_top]`, top = next handed out) and the flags a
    numpy bool array: a 200k-token history takes and returns ~3k pages at once, in one compiled
    loop (`page_kernels`) instead of a Python step per id.
    """

    __slots__ = ("_is_free", "_reserved", "_stack", "_top", "reserved", "size")

    def __init__(self, size: int, reserved: Iterable[int] = ()) -> None:
        self.size = size
        self.reserved = frozenset(reserved)
        if any(not 0 <= r < size for r in self.reserved):
            raise ValueError(f"reserved ids {sorted(self.reserved)} outside [0, {size})")
        # Highest ids at the bottom of the stack so that low ids are handed out first.
        free = [i for i in range(size - 1, -1, -1) if i not in self.reserved]
        self._stack = np.zeros(size, dtype=np.int64)
        self._stack[: len(free)] = free
        self._top = len(free)
        self._is_free = np.zeros(size, dtype=bool)
        self._is_free[free] = True
        self._reserved = np.zeros(size, dtype=bool)
        self._reserved[list(self.reserved)] = True

    @property
    def capacity(self) -> int:
        """Ids that can ever be handed out."""
        return self.size - len(self.reserved)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    def is_free(self, i: int) -> bool:
        return bool(self._is_free[i])

    def free_mask(self) -> np.ndarray:
        """[size] bool, True where the id is free (a copy)."""
        return self._is_free.copy()

    def allocate(self, n: int) -> np.ndarray:
        """[n] int64 ids, or CacheFullError with nothing taken."""
        if n > self._top:
            raise CacheFullError(f"asked for {n} entries, {self._top} free")
        ids = np.empty(n, dtype=np.int64)
        self._top = int(pool_pop(self._stack, self._top, n, self._is_free, ids))
        return ids

    def allocate_one(self) -> int:
        """One id (a Python int), or CacheFullError."""
        if not self._top:
            raise CacheFullError("asked for 1 entry, 0 free")
        self._top -= 1
        i = int(self._stack[self._top])
        self._is_free[i] = False
        return i

    def free_one(self, i: int) -> None:
        """Return one id (a KDA slot, a checkpoint slot); IntegrityError for a bad one."""
        if not 0 <= i < self.size:
            raise IntegrityError(f"ids outside [0, {self.size}) freed: [{i}]")
        if self._is_free[i] or self._reserved[i]:
            raise IntegrityError(f"id {i} freed twice or reserved")
        self._is_free[i] = True
        self._stack[self._top] = i
        self._top += 1

    def free(self, ids: Iterable[int] | np.ndarray) -> None:
        """Return ids (the first given is the first handed out again). A bad call (an id out of
        range, free already, reserved, or listed twice) raises IntegrityError with the pool as
        it was."""
        arr = as_ids(ids)
        n = len(arr)
        if not n:
            return
        if n == 1:  # one id: no compiled call needed
            self.free_one(int(arr[0]))
            return
        code, bad, top = pool_push(
            self._stack, self._top, self._is_free, self._reserved, as_int64(arr)
        )
        if code == OK:
            self._top = int(top)
        elif code == OUT_OF_RANGE:
            raise IntegrityError(f"ids outside [0, {self.size}) freed: {arr.tolist()[:8]}")
        elif code == NOT_HELD:
            raise IntegrityError(f"id {bad} freed twice or reserved")
        else:
            raise IntegrityError(f"ids freed twice in one call: {arr.tolist()[:16]}")

    def check_integrity(self) -> None:
        free = self._stack[: self._top]
        # Before the flags below: numpy reads -1 as the last id, so an id out of range would
        # pass for a free one there and then be handed out.
        if len(free) and (free.min() < 0 or free.max() >= self.size):
            raise IntegrityError(f"an id outside [0, {self.size}) is on the free list")
        if len(np.unique(free)) != len(free):
            raise IntegrityError("an id is on the free list twice")
        if any(i in self.reserved for i in free.tolist()):
            raise IntegrityError("a reserved id is on the free list")
        flags = np.zeros(self.size, dtype=bool)
        flags[free] = True
        if not np.array_equal(flags, self._is_free):
            raise IntegrityError("free flags disagree with the free list")
