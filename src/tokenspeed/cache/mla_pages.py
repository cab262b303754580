"""Device pages of MLA latent rows: refcounts, the L1 prefix index, and LRU eviction.

A page is in exactly one of three states:

- free: on the pool's free list, no key, refcount 0;
- used: refcount > 0 (in the page table of that many requests), with or without a key;
- cached: refcount 0 but indexed by its key, kept for reuse and evictable in LRU order.

Pages get a key (become matchable) only once their content is known to be computed, which the
facade decides (at a checkpoint or an L2 load). Bookkeeping is vectorised because a 200k-token
history holds ~3k pages and is pinned and unpinned on every turn: page ids travel as [n] int64
arrays and keys as `PageKeys` end to end (page tables, the free list, eviction victims, the
`KeyTable` index), so no call walks pages one Python object at a time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ..types import PageId, PageKey
from .errors import BudgetTooSmallError, CacheFullError, IntegrityError
from .key_table import KeyTable
from .keys import KEY_DTYPE, PageKeys, as_page_keys, key_int
from .page_kernels import (
    OK,
    as_int64,
    distinct_and_unindexed,
    forget_pages,
    mark_registered,
    pin_pages,
    take_lru,
    unpin_pages,
)
from .pool import SlotPool, as_ids
from .stamped_log import compacted

SINK_PAGE: PageId = 0
"""Page 0 is never handed out: padded rows of a captured graph point at it."""

# Called with ([n] int64 page ids, their keys, [n] int64 positions) of pages about to be evicted,
# before they are reused.
WritebackFn = Callable[[np.ndarray, PageKeys, np.ndarray], None]


class MlaPageManager:
    """Pages of one device pool (ids [0, num_pages), page 0 the sink).

    Page ids come and go as [n] int64 arrays (sequences of ints are accepted and converted).
    """

    def __init__(self, num_pages: int) -> None:
        self.pool = SlotPool(num_pages, reserved=(SINK_PAGE,))
        self.index = KeyTable(num_pages)  # key -> page id, for indexed pages
        # [num_pages] the key a page is indexed under (meaningful where `indexed`; zeros elsewhere).
        self.key_of = np.zeros(num_pages, dtype=KEY_DTYPE)
        self.position_of = np.full(num_pages, -1, dtype=np.int64)  # page index in its chain
        self.ref = np.zeros(num_pages, dtype=np.int32)
        self.indexed = np.zeros(num_pages, dtype=bool)
        # Where the index may look for a key before probing: next to the previous page found.
        self._near = (self.key_of, self.indexed.view(np.int8), 1)
        self.evictable = np.zeros(num_pages, dtype=bool)  # cached: indexed and refcount 0
        self.last_use = np.zeros(num_pages, dtype=np.int64)
        self.num_cached = 0
        self.version = 0  # bumped whenever the index changes (a match may be stale)
        self._clock = 0
        # LRU queue: (page, last_use) in the order pages became cached, which is increasing
        # last_use. An entry is live while its page is evictable with that very last_use; pins
        # and re-caching leave stale entries behind, skipped when eviction reaches them. So the
        # live entries from the head are the cached pages, least recently used first, and
        # eviction costs what it evicts (plus the stale entries it steps over), not a scan of
        # the pool.
        self._queue_pid = np.zeros(2 * num_pages + 16, dtype=np.int64)
        self._queue_use = np.zeros(2 * num_pages + 16, dtype=np.int64)
        self._head = 0
        self._tail = 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used - self.num_cached

    def lookup(self, keys: PageKeys | Sequence[PageKey]) -> list[PageId | None]:
        """Page id of each key in the L1 index (None where absent)."""
        return [None if p < 0 else p for p in self.lookup_ids(as_page_keys(keys)).tolist()]

    def lookup_ids(self, keys: PageKeys) -> np.ndarray:
        """[n] int64: the page indexed under each key, -1 where absent."""
        return self.index.lookup(keys, self._near)

    def room_besides(self, pids: Sequence[PageId] | np.ndarray) -> int:
        """Pages an allocation could take (free + evictable) once `pids` are pinned."""
        held = int(np.count_nonzero(self.evictable[as_ids(pids)])) if len(pids) else 0
        return self.pool.num_free + self.num_cached - held

    def pin(self, pids: Sequence[PageId] | np.ndarray) -> None:
        """Add one reference to each page (the pages must be distinct and allocated)."""
        if len(pids):
            self.num_cached -= int(pin_pages(self.ref, self.evictable, as_int64(as_ids(pids))))

    def unpin(self, pids: Sequence[PageId] | np.ndarray) -> None:
        """Drop one reference from each page (distinct pages). Pages left unreferenced become
        cached if indexed (the table's tail first in LRU order, so a long history loses its end
        before its start) and free otherwise."""
        n = len(pids)
        if not n:
            return
        arr = as_int64(as_ids(pids))
        self._queue_room(n)
        freed = np.empty(n, dtype=np.int64)
        code, bad, cached, nfree = unpin_pages(
            self.ref,
            self.indexed,
            self.evictable,
            self.last_use,
            arr,
            self._clock,
            self._queue_pid,
            self._queue_use,
            self._tail,
            freed,
        )
        if code != OK:
            raise IntegrityError(f"unpin of unreferenced pages, e.g. page {bad}")
        cached, nfree = int(cached), int(nfree)
        self._clock += cached
        self._tail += cached
        self.num_cached += cached
        if nfree:
            self.pool.free(freed[:nfree])

    def allocate(self, n: int, writeback: WritebackFn | None) -> np.ndarray:
        """[n] int64 fresh pages with refcount 1, evicting cached pages (LRU) if the free list is
        short. Raises BudgetTooSmallError if n exceeds the whole pool, CacheFullError if too many
        pages are in use (in both cases nothing is taken)."""
        if n > self.capacity:
            raise BudgetTooSmallError(
                f"{n} pages needed but the device pool holds only {self.capacity} usable pages"
            )
        short = n - self.pool.num_free
        if short > self.num_cached:
            raise CacheFullError(
                f"{n} pages needed: {self.pool.num_free} free and {self.num_cached} evictable"
            )
        if short > 0:
            self.evict(short, writeback)
        ids = self.pool.allocate(n)
        self.ref[ids] = 1
        return ids

    def allocate_one(self, writeback: WritebackFn | None) -> PageId:
        """`allocate(1, writeback)` as a Python int (a decode step crossing a page boundary)."""
        if not self.pool.num_free:
            return int(self.allocate(1, writeback)[0])
        pid = self.pool.allocate_one()
        self.ref[pid] = 1
        return pid

    def _queue_room(self, n: int) -> None:
        """Make room for n more LRU queue entries (stamps increasing, above every queued one)."""
        if self._tail + n <= len(self._queue_pid):
            return
        # Drop the consumed head and the stale entries; grow if that is not enough.
        head, tail = self._head, self._tail
        qp = self._queue_pid[head:tail]
        live = self.evictable[qp] & (self.last_use[qp] == self._queue_use[head:tail])
        self._queue_pid, self._queue_use, self._tail = compacted(
            self._queue_pid, self._queue_use, head, tail, live, n
        )
        self._head = 0

    def _lru_victims(self, n: int) -> tuple[np.ndarray, int]:
        """The n least recently used cached pages (all of them if fewer), oldest first, and the
        queue head once they are consumed (the caller consumes them by setting `_head`)."""
        out = np.empty(min(n, self.num_cached), dtype=np.int64)
        found, head = take_lru(
            self._queue_pid,
            self._queue_use,
            self._head,
            self._tail,
            self.evictable,
            self.last_use,
            len(out),
            out,
        )
        return out[: int(found)], int(head)

    def evict(self, n: int, writeback: WritebackFn | None) -> int:
        """Evict up to n cached pages, least recently used first; returns how many."""
        if n <= 0 or self.num_cached == 0:
            return 0
        victims, head = self._lru_victims(n)
        keys = self.key_of[victims]
        if writeback is not None:
            writeback(victims, keys, self.position_of[victims])
        # Consumed only now: a write-back that raises (a device read) leaves the victims cached
        # and still in the queue, so they stay evictable.
        self._head = head
        self.index.delete(keys)
        forget_pages(victims, self.key_of, self.indexed, self.evictable, self.position_of)
        self.num_cached -= len(victims)
        self.pool.free(victims)
        self.version += 1
        return len(victims)

    def register(self, pid: PageId, key: PageKey, position: int) -> bool:
        """Make a used page matchable under `key` (its content is computed). Returns False, and
        leaves the page private, if the key already names another page (same content)."""
        pid = int(pid)
        if self.ref[pid] <= 0:
            raise IntegrityError(f"register of unreferenced page {pid}")
        current = self.index.get(key)
        if current is not None:
            return current == pid
        if self.indexed[pid]:
            raise IntegrityError(f"page {pid} is already indexed under another key")
        self.register_at(np.array([pid], dtype=np.int64), [key], [position])
        return True

    def register_many(
        self, pids: Sequence[PageId] | np.ndarray, keys: Sequence[PageKey], first_position: int
    ) -> None:
        """`register` for consecutive pages of one chain (positions first_position, ...)."""
        n = len(pids)
        self.register_at(pids, keys, np.arange(first_position, first_position + n))

    def register_at(
        self,
        pids: Sequence[PageId] | np.ndarray,
        keys: PageKeys | Sequence[PageKey],
        positions: Sequence[int] | np.ndarray,
    ) -> None:
        """`register(pid, key, position)` for each triple in order (distinct used pages): keys
        already indexed, by another page or earlier in this batch, keep their page and this one
        stays private. One batch, not a loop per page."""
        keys = as_page_keys(keys)
        n = len(pids)
        if n != len(keys) or n != len(positions):
            raise ValueError(f"{n} pages, {len(keys)} keys, {len(positions)} positions")
        if not n:
            return
        sel = as_int64(as_ids(pids))
        if np.count_nonzero(self.ref[sel] <= 0):
            raise IntegrityError("register of unreferenced pages")
        if not distinct_and_unindexed(sel, self.indexed):
            self._check_reregistration(sel, keys)
            # Pages already indexed under their own key stay as they are; none is under another.
            keep = ~self.indexed[sel]
            if not np.count_nonzero(keep):
                return
            sel, keys = sel[keep], keys[keep]
            positions = np.asarray(positions, dtype=np.int64)[keep]
        got = self.index.setdefault(keys, sel)
        # setdefault hands back the page it stored, or the page the key already names: no key
        # names one of these pages (none is indexed, and they are distinct), so a page got back
        # under its own id is exactly a fresh one.
        if mark_registered(
            sel, got, keys, as_int64(positions), self.indexed, self.key_of, self.position_of
        ):
            self.version += 1

    def _check_reregistration(self, sel: np.ndarray, keys: PageKeys) -> None:
        """Refuse (before any change) a batch that would index a page under a second key: a page
        already indexed, or listed twice, whose key is not already in the index (or taken
        earlier in the batch)."""
        present = self.index.lookup(keys) >= 0
        taken_keys, taken_pids = set(), set()
        for pid, key, there in zip(sel.tolist(), keys, present.tolist(), strict=True):
            k = key_int(key)
            if there or k in taken_keys:
                continue
            if self.indexed[pid] or pid in taken_pids:
                raise IntegrityError(f"page {pid} is already indexed under another key")
            taken_keys.add(k)
            taken_pids.add(pid)

    def unregister(self, pid: PageId) -> None:
        """Remove a used page from the index (its content can no longer be trusted)."""
        if not self.indexed[pid]:
            return
        if self.ref[pid] <= 0:
            raise IntegrityError(f"unregister of unreferenced page {pid}")
        self.index.delete(self.key_of[pid : pid + 1])
        self.key_of[pid] = 0
        self.indexed[pid] = False
        self.position_of[pid] = -1
        self.version += 1

    def check_integrity(self, expected_refs: Counter) -> None:
        """`expected_refs`: page id -> number of live page tables holding it."""
        pool = self.pool
        pool.check_integrity()
        if self.ref[SINK_PAGE] != 0 or self.indexed[SINK_PAGE] or pool.is_free(SINK_PAGE):
            raise IntegrityError("the sink page is referenced, indexed or on the free list")
        if (self.ref < 0).any():
            raise IntegrityError("negative page refcount")
        expected = np.zeros_like(self.ref)
        for pid, count in expected_refs.items():
            expected[pid] = count
        if not np.array_equal(expected, self.ref):
            bad = np.flatnonzero(expected != self.ref)[:8].tolist()
            raise IntegrityError(f"page refcounts disagree with the page tables at pages {bad}")
        free = pool.free_mask()
        if (free & (self.ref > 0)).any() or (free & self.indexed).any():
            raise IntegrityError("a free page is referenced or indexed")
        cached = self.indexed & (self.ref == 0)
        if not np.array_equal(cached, self.evictable) or int(cached.sum()) != self.num_cached:
            raise IntegrityError("the evictable set is not exactly the unreferenced indexed pages")
        if (self.evictable & (self.ref > 0)).any():
            raise IntegrityError("a page in use is marked evictable")
        self.index.check_integrity()
        if len(self.index) != int(self.indexed.sum()):
            raise IntegrityError("index size disagrees with the indexed flags")
        keys, pids = self.index.items()
        if not self.indexed[pids].all() or self.key_of[pids].tobytes() != keys.tobytes():
            raise IntegrityError("an index entry is not mirrored by its page")
        if self.key_of[~self.indexed].view(np.uint64).any():
            raise IntegrityError("a page that is not indexed still names a key")
        # Write-back stores a page at its position; a host-tier reader checks it.
        if (self.position_of[~self.indexed] != -1).any() or (
            self.position_of[self.indexed] < 0
        ).any():
            raise IntegrityError("a page's chain position disagrees with its being indexed")
        qp = self._queue_pid[self._head : self._tail]
        qu = self._queue_use[self._head : self._tail]
        if (np.diff(qu) <= 0).any() or (len(qu) and qu[-1] >= self._clock):
            raise IntegrityError("the LRU queue is not in increasing last-use order")
        live = qp[self.evictable[qp] & (self.last_use[qp] == qu)]
        if len(live) != self.num_cached or not np.array_equal(
            np.sort(live), np.flatnonzero(self.evictable)
        ):
            raise IntegrityError("the LRU queue does not hold each cached page exactly once")
        used = int((self.ref > 0).sum())
        if pool.num_free + used + self.num_cached != pool.capacity:
            raise IntegrityError(
                f"free {pool.num_free} + used {used} + cached {self.num_cached} "
                f"!= total {pool.capacity}"
            )
