"""`KeyTable`: a hash map from 128-bit page keys to non-negative ints, called on whole arrays.

The cache asks about whole histories at once (a prefill's match looks up thousands of page keys;
eviction drops thousands), so the map is built for batches: keys come in as `PageKeys` arrays and
answers go out as int64 arrays. Open addressing with linear probing over one [capacity, 3] uint64
table (key lo, key hi, value: one cache line per probe), kept at most half full (doubled when an
insertion would pass that). Deletion shifts the entries after the hole back instead of leaving
tombstones, so a table that churns (an index under eviction) never needs rebuilding and a probe
stops at the first empty slot. The probe loops are compiled with numba when it is installed;
without numba the same functions run in the interpreter (correct, much slower).

A batch gives exactly the answers of the same calls made one key at a time, in order: a key that
appears twice in one `setdefault` keeps the first value.
"""

from __future__ import annotations

import numpy as np

from ..types import PageKey
from .compiled import AVAILABLE, jit, jitable
from .errors import IntegrityError
from .keys import KEY_DTYPE, PageKeys, key_array

EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_NO_VALUES = np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------------- kernels
# tab: [capacity, 3] uint64 (lo, hi, value or EMPTY); mask = capacity - 1 (capacity a power of
# two); keys: a `PageKeys` array. Keys are digests, so their low word is already uniform: its low
# bits are the home slot. Every live entry sits at or after its home with no empty slot in
# between (what a lookup relies on to stop).
@jitable
def _find(tab, mask, lo, hi):
    """The slot holding the key (lo, hi), or the EMPTY slot where its probe ends."""
    p = np.int64(lo & np.uint64(mask))
    while True:
        if tab[p, 2] == EMPTY or (tab[p, 0] == lo and tab[p, 1] == hi):
            return p
        p = (p + 1) & mask


@jitable
def _value(tab, mask, lo, hi):
    """The value under the key (lo, hi), -1 if absent (`_find`'s probe, returning the value
    it reads: the lookups' hot path)."""
    p = np.int64(lo & np.uint64(mask))
    while True:
        v = tab[p, 2]
        if v == EMPTY:
            return np.int64(-1)
        if tab[p, 0] == lo and tab[p, 1] == hi:
            return np.int64(v)
        p = (p + 1) & mask


def _lookup(tab, mask, keys, out):
    for i in range(out.shape[0]):
        out[i] = _value(tab, mask, keys[i]["lo"], keys[i]["hi"])


def _lookup_near(tab, mask, keys, out, column, owner, want, stop):
    """`_lookup` for values that index a key column (`column[v]` is the key stored under v
    wherever `owner[v] == want`). After each answer the keys that follow are first checked
    against the slots that follow it (or precede it: a chain stored tail first): a history
    stored or indexed in one go usually sits in consecutive slots, so a long chain is read in
    order, its loads independent of each other, instead of probing a large table once per key.
    A slot is taken only when it holds exactly this key, which the table then maps to it.
    With `stop`, ends at the first absent key; returns how many keys were answered."""
    size = column.shape[0]
    n = out.shape[0]
    prev = -1
    i = 0
    while i < n:
        if prev >= 0:
            extended = False
            for step in (1, -1):
                j = i
                c = prev + step
                while (
                    j < n
                    and 0 <= c < size
                    and owner[c] == want
                    and column[c]["lo"] == keys[j]["lo"]
                    and column[c]["hi"] == keys[j]["hi"]
                ):
                    out[j] = c
                    j += 1
                    c += step
                if j > i:
                    prev = c - step
                    i = j
                    extended = True
                    break
            if extended:
                continue
        r = _value(tab, mask, keys[i]["lo"], keys[i]["hi"])
        out[i] = r
        prev = r
        i += 1
        if stop and r < 0:
            break
    return i


def _prefix_chain(
    tab, mask, keys, column, owner, want, run_of, run_off, run_start, run_len, run_slots
):
    """How many leading keys are present, for `keys` that are consecutive pages of one chain.
    Keys are found as in `_lookup_near`; at a key held by a run (slots holding consecutive
    pages of one chain, all still present), the run vouches for the keys that follow as far
    as both chains agree: equal keys d pages on mean equal keys everywhere in between, and
    chains that differ once differ from then on, so a comparison at the run's (or the query's)
    end, or a binary search for the page where they part, replaces a comparison per key."""
    size = column.shape[0]
    n = keys.shape[0]
    prev = -1
    i = 0
    while i < n:
        lo = keys[i]["lo"]
        hi = keys[i]["hi"]
        s = -1
        if prev >= 0:
            c = prev + 1
            if c < size and owner[c] == want and column[c]["lo"] == lo and column[c]["hi"] == hi:
                s = c
            else:
                c = prev - 1
                if c >= 0 and owner[c] == want and column[c]["lo"] == lo and column[c]["hi"] == hi:
                    s = c
        if s < 0:
            s = _value(tab, mask, lo, hi)
        if s < 0:
            return i
        r = run_of[s]
        if r >= 0:
            o = run_off[s]
            base = run_start[r] + o
            far = min(run_len[r] - 1 - o, n - 1 - i)
            if far > 0:
                t = run_slots[base + far]
                if (
                    column[t]["lo"] == keys[i + far]["lo"]
                    and column[t]["hi"] == (keys[i + far]["hi"])
                ):
                    d = far
                else:  # equal at 0, not at far: find the last equal offset
                    d = 0
                    top = far
                    while top - d > 1:
                        mid = (d + top) // 2
                        t = run_slots[base + mid]
                        if (
                            column[t]["lo"] == keys[i + mid]["lo"]
                            and column[t]["hi"] == (keys[i + mid]["hi"])
                        ):
                            d = mid
                        else:
                            top = mid
                i += d + 1
                prev = run_slots[base + d]
                continue
        i += 1
        prev = s
    return n


def _last_present(tab, mask, keys):
    """The index of the last key present (-1 if none), probing from the end."""
    for i in range(keys.shape[0] - 1, -1, -1):
        if _value(tab, mask, keys[i]["lo"], keys[i]["hi"]) >= 0:
            return i
    return -1


def _setdefault(tab, mask, keys, values, out):
    """out[i]: the value under keys[i] after inserting each absent key with values[i], in order.
    Needs more EMPTY slots than keys. Returns the number of keys inserted."""
    inserted = 0
    for i in range(out.shape[0]):
        lo = keys[i]["lo"]
        hi = keys[i]["hi"]
        p = _find(tab, mask, lo, hi)
        if tab[p, 2] == EMPTY:
            tab[p, 0] = lo
            tab[p, 1] = hi
            tab[p, 2] = np.uint64(values[i])
            out[i] = values[i]
            inserted += 1
        else:
            out[i] = np.int64(tab[p, 2])
    return inserted


def _delete(tab, mask, keys, out):
    """Remove each key present; out[i] = the value it had, or -1. Returns the number removed.
    The entries after a hole that would no longer be reached from their home move back into
    it (backward-shift deletion), so no tombstone is left."""
    m = np.uint64(mask)
    removed = 0
    for i in range(out.shape[0]):
        p = _find(tab, mask, keys[i]["lo"], keys[i]["hi"])
        if tab[p, 2] == EMPTY:
            out[i] = -1
            continue
        out[i] = np.int64(tab[p, 2])
        removed += 1
        hole = p
        q = (p + 1) & mask
        while tab[q, 2] != EMPTY:
            home = np.int64(tab[q, 0] & m)
            # The entry at q may fill the hole if the hole lies between its home and q.
            if ((q - home) & mask) >= ((q - hole) & mask):
                tab[hole, 0] = tab[q, 0]
                tab[hole, 1] = tab[q, 1]
                tab[hole, 2] = tab[q, 2]
                hole = q
            q = (q + 1) & mask
        tab[hole, 2] = EMPTY
    return removed


def _rehash(old, new, mask):
    """Insert every live entry of `old` into the empty table `new`."""
    m = np.uint64(mask)
    for q in range(old.shape[0]):
        v = old[q, 2]
        if v != EMPTY:
            p = np.int64(old[q, 0] & m)
            while new[p, 2] != EMPTY:
                p = (p + 1) & mask
            new[p, 0] = old[q, 0]
            new[p, 1] = old[q, 1]
            new[p, 2] = v


def _misplaced(tab, mask):
    """The first live entry a lookup would not reach (an EMPTY slot between its home and it),
    or -1."""
    m = np.uint64(mask)
    for q in range(tab.shape[0]):
        if tab[q, 2] != EMPTY:
            p = np.int64(tab[q, 0] & m)
            while p != q:
                if tab[p, 2] == EMPTY:
                    return q
                p = (p + 1) & mask
    return -1


class _Kernels:
    def __init__(self, compile_: bool) -> None:
        wrap = jit if compile_ else (lambda f: f)
        self.compiled = compile_ and AVAILABLE
        self.lookup = wrap(_lookup)
        self.lookup_near = wrap(_lookup_near)
        self.last_present = wrap(_last_present)
        self.prefix_chain = wrap(_prefix_chain)
        self.setdefault = wrap(_setdefault)
        self.delete = wrap(_delete)
        self.rehash = wrap(_rehash)
        self.misplaced = wrap(_misplaced)


INTERPRETED = _Kernels(False)
COMPILED = _Kernels(True)


def _checked(keys: PageKeys) -> PageKeys:
    if keys.dtype is not KEY_DTYPE and keys.dtype != KEY_DTYPE:
        raise TypeError(f"page keys must be a KEY_DTYPE array, got {keys.dtype}")
    return keys


class KeyTable:
    """key -> value (an int in [0, 2^63 - 1)), for batches of `PageKeys`.

    kernels: `COMPILED` (default; numba when installed) or `INTERPRETED` (the same loops in the
        interpreter: a reference for tests).
    """

    __slots__ = ("_k", "_live", "_mask", "_tab")

    def __init__(self, capacity: int = 0, *, kernels: _Kernels | None = None) -> None:
        self._k = kernels or COMPILED
        self._live = 0
        self._alloc(self._size_for(capacity))

    @staticmethod
    def _size_for(n: int) -> int:
        """Table slots for n live keys at a load of at most a quarter (a power of two)."""
        return max(64, 1 << (max(4 * n, 1) - 1).bit_length())

    def _alloc(self, size: int) -> None:
        self._tab = np.empty((size, 3), dtype=np.uint64)
        self._tab[:, 2] = EMPTY
        self._mask = size - 1

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        return len(self._tab)

    def _make_room(self, n: int) -> None:
        """Keep live + n at most half the slots (probes stay short and always end)."""
        if 2 * (self._live + n) <= len(self._tab):
            return
        old = self._tab
        self._alloc(self._size_for(self._live + n))
        self._k.rehash(old, self._tab, self._mask)

    # ---------------------------------------------------------------------------- batches
    def lookup(
        self, keys: PageKeys, near: tuple[PageKeys, np.ndarray, int] | None = None
    ) -> np.ndarray:
        """[n] int64: the value of each key, -1 where absent.

        near: (column, owner, want) when values index a column of keys: `column[v]` is the key
            stored under v for every v with `owner[v] == want` ([size] int8). Only a hint (the
            answers are the same): a key found at the slot next to the previous answer skips
            the table."""
        out = np.empty(len(keys), dtype=np.int64)
        if len(out):
            if near is None:
                self._k.lookup(self._tab, self._mask, _checked(keys), out)
            else:
                self._k.lookup_near(self._tab, self._mask, _checked(keys), out, *near, False)
        return out

    def prefix(self, keys: PageKeys, near: tuple[PageKeys, np.ndarray, int]) -> int:
        """How many leading keys are present (probing stops at the first absent one); `near`
        as for `lookup`."""
        if not len(keys):
            return 0
        out = np.empty(len(keys), dtype=np.int64)
        done = int(self._k.lookup_near(self._tab, self._mask, _checked(keys), out, *near, True))
        return done if out[done - 1] >= 0 else done - 1

    def prefix_chain(
        self,
        keys: PageKeys,
        near: tuple[PageKeys, np.ndarray, int],
        runs: tuple[np.ndarray, ...],
    ) -> int:
        """`prefix` of keys that are consecutive pages of one chain, skipping along `runs`
        (`ChainRuns.arrays` over the column of `near`): the same answer in a few comparisons
        per run instead of one per key."""
        if not len(keys):
            return 0
        return int(self._k.prefix_chain(self._tab, self._mask, _checked(keys), *near, *runs))

    def last_present(self, keys: PageKeys) -> int:
        """The index of the last key present, -1 if none (probing from the end)."""
        if not len(keys):
            return -1
        return int(self._k.last_present(self._tab, self._mask, _checked(keys)))

    def setdefault(self, keys: PageKeys, values: np.ndarray) -> np.ndarray:
        """Insert each absent key with its value, in order (a key repeated in the batch keeps
        the first value); returns [n] int64, the value under each key afterwards. Values must
        be non-negative."""
        n = len(keys)
        if n != len(values):
            raise ValueError(f"{n} keys, {len(values)} values")
        if not n:
            return _NO_VALUES.copy()
        vals = np.ascontiguousarray(values, dtype=np.int64)
        if np.count_nonzero(vals < 0):
            raise ValueError("KeyTable values must be non-negative")
        self._make_room(n)
        out = np.empty(n, dtype=np.int64)
        self._live += int(self._k.setdefault(self._tab, self._mask, _checked(keys), vals, out))
        return out

    def delete(self, keys: PageKeys) -> np.ndarray:
        """Remove each key that is present; returns [n] int64, the value each had (-1: absent)."""
        out = np.empty(len(keys), dtype=np.int64)
        if len(out):
            self._live -= int(self._k.delete(self._tab, self._mask, _checked(keys), out))
        return out

    # ------------------------------------------------------------------------ single keys
    def get(self, key: PageKey | np.void) -> int | None:
        out = np.empty(1, dtype=np.int64)
        self._k.lookup(self._tab, self._mask, key_array(key), out)
        v = int(out[0])
        return None if v < 0 else v

    def __contains__(self, key: PageKey | np.void) -> bool:
        return self.get(key) is not None

    # ------------------------------------------------------------------------- inspection
    def items(self) -> tuple[PageKeys, np.ndarray]:
        """(keys, values) of every entry, in table order."""
        rows = self._tab[self._tab[:, 2] != EMPTY]
        keys = np.ascontiguousarray(rows[:, :2]).view(KEY_DTYPE).ravel()
        return keys, rows[:, 2].astype(np.int64)

    def check_integrity(self) -> None:
        """The entry count and the load agree; no key twice; every entry is reachable."""
        live = int(np.count_nonzero(self._tab[:, 2] != EMPTY))
        if live != self._live:
            raise IntegrityError(f"key table holds {live} entries, counts {self._live}")
        if 2 * live > len(self._tab):
            raise IntegrityError("key table is more than half full")
        keys, _ = self.items()
        if len(np.unique(keys)) != len(keys):
            raise IntegrityError("a key is in the key table twice")
        bad = self._k.misplaced(self._tab, self._mask)
        if bad >= 0:
            raise IntegrityError(f"key table slot {bad} is unreachable from its key's home")
