"""A free list over a fixed range of integer ids: the allocator under every device pool."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .errors import CacheFullError, IntegrityError


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
    numpy bool array: a 200k-token history takes and returns ~3k pages at once, and whole-array
    operations keep that at a few microseconds instead of a Python step per id.
    """

    __slots__ = ("_is_free", "_stack", "_top", "reserved", "size")

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
        top = self._top
        ids = self._stack[top - n : top][::-1].copy()
        self._top = top - n
        self._is_free[ids] = False
        return ids

    def allocate_one(self) -> int:
        """One id (a Python int), or CacheFullError."""
        if not self._top:
            raise CacheFullError("asked for 1 entry, 0 free")
        self._top -= 1
        i = int(self._stack[self._top])
        self._is_free[i] = False
        return i

    def free(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = as_ids(ids)
        n = len(arr)
        if not n:
            return
        # Checked before anything changes, so a bad call leaves the pool as it was. The checks
        # use `np.count_nonzero` rather than `.any()` (microseconds less per call: the pools
        # free about a million times per simulated hour), and one id (a KDA slot, a checkpoint)
        # skips numpy altogether.
        flags = self._is_free
        top = self._top
        if n == 1:
            i = int(arr[0])
            if not 0 <= i < self.size:
                raise IntegrityError(f"ids outside [0, {self.size}) freed: [{i}]")
            if flags[i] or i in self.reserved:
                raise IntegrityError(f"id {i} freed twice or reserved")
            flags[i] = True
            self._stack[top] = i
            self._top = top + 1
            return
        if np.count_nonzero(arr.view(np.uint64) >= self.size):  # a negative id wraps to >= 2^63
            raise IntegrityError(f"ids outside [0, {self.size}) freed: {arr.tolist()[:8]}")
        if np.count_nonzero(flags[arr]) or self._reserved_hits(arr):
            bad = next(int(i) for i in arr if int(i) in self.reserved or flags[i])
            raise IntegrityError(f"id {bad} freed twice or reserved")
        flags[arr] = True
        if int(np.count_nonzero(flags)) != top + n:
            flags[arr] = False  # some id appears twice in this call: undo
            raise IntegrityError(f"ids freed twice in one call: {arr.tolist()[:16]}")
        # Pushed so that the first id given is the first handed out again.
        self._stack[top : top + n] = arr[::-1]
        self._top = top + n

    def _reserved_hits(self, arr: np.ndarray) -> list[int]:
        """The reserved ids among `arr` (few reserved ids: one vector test each)."""
        return [r for r in self.reserved if np.count_nonzero(arr == r)]

    def check_integrity(self) -> None:
        free = self._stack[: self._top]
        if len(np.unique(free)) != len(free):
            raise IntegrityError("an id is on the free list twice")
        if any(i in self.reserved for i in free.tolist()):
            raise IntegrityError("a reserved id is on the free list")
        flags = np.zeros(self.size, dtype=bool)
        flags[free] = True
        if not np.array_equal(flags, self._is_free):
            raise IntegrityError("free flags disagree with the free list")
