"""Compiled per-id loops behind `SlotPool` and `MlaPageManager` (see `compiled.py`).

Each function does in one pass what a handful of whole-array numpy steps would, over the ids of
one call (a request's page table: up to a few thousand pages), so a call costs one dispatch and
a loop instead of a dozen array temporaries. They check what the callers' contracts require and
report a failure as a code before changing anything, so the callers raise with nothing changed.
"""

from __future__ import annotations

import numpy as np

from .compiled import jit

OK = 0
OUT_OF_RANGE = 1  # an id outside the pool
NOT_HELD = 2  # freeing an id that is free or reserved; unpinning an unreferenced page
REPEATED = 3  # an id listed twice in one call


# ------------------------------------------------------------------------------ free lists
@jit
def pool_pop(stack, top, n, is_free, out):
    """Hand out the n ids on top of the stack (top of stack first); returns the new top."""
    for i in range(n):
        p = stack[top - 1 - i]
        out[i] = p
        is_free[p] = False
    return top - n


@jit
def pool_push(stack, top, is_free, reserved, ids):
    """Return ids to the stack so that ids[0] is handed out first again. Returns (code, the
    offending id or -1, the new top); on a failure nothing has changed."""
    size = is_free.shape[0]
    n = ids.shape[0]
    for i in range(n):
        p = ids[i]
        if p < 0 or p >= size:
            return OUT_OF_RANGE, p, top
        if is_free[p] or reserved[p]:
            return NOT_HELD, p, top
    for i in range(n):  # flag as we go: an id seen flagged was listed twice
        p = ids[i]
        if is_free[p]:
            for j in range(i):
                is_free[ids[j]] = False
            return REPEATED, p, top
        is_free[p] = True
    for i in range(n):
        stack[top + i] = ids[n - 1 - i]
    return OK, -1, top + n


# ------------------------------------------------------------------------------ page states
@jit
def pin_pages(ref, evictable, pids):
    """One more reference per page; returns how many were cached (evictable) until now."""
    was_cached = 0
    for i in range(pids.shape[0]):
        p = pids[i]
        if evictable[p]:
            evictable[p] = False
            was_cached += 1
        ref[p] += 1
    return was_cached


@jit
def unpin_pages(ref, indexed, evictable, last_use, pids, clock, qpid, quse, tail, freed):
    """One reference less per page (distinct pages). Pages left unreferenced become cached when
    indexed, the table's later positions with older stamps (clock, clock + 1, ... from the
    tail), queued in increasing stamp order at `tail`; the others go to `freed`.
    Returns (code, offending page, pages cached, pages freed)."""
    n = pids.shape[0]
    cached = 0  # pages that will be cached: checked and counted before anything changes
    for i in range(n):
        p = pids[i]
        r = ref[p]
        if r <= 0:
            return NOT_HELD, p, 0, 0
        if r == 1 and indexed[p]:
            cached += 1
    j = 0
    nfree = 0
    for i in range(n):
        p = pids[i]
        r = ref[p] - 1
        ref[p] = r
        if r != 0:
            continue
        if indexed[p]:
            stamp = clock + cached - 1 - j  # the j-th cached page in table order
            last_use[p] = stamp
            evictable[p] = True
            qpid[tail + cached - 1 - j] = p
            quse[tail + cached - 1 - j] = stamp
            j += 1
        else:
            freed[nfree] = p
            nfree += 1
    return OK, -1, cached, nfree


@jit
def take_lru(qpid, quse, head, tail, evictable, last_use, n, out):
    """The first n live queue entries from `head` (a page still cached with that very stamp):
    the n least recently used cached pages, oldest first. Returns (found, the new head: just
    past the last one taken, or `tail` when fewer were found)."""
    found = 0
    h = head
    while h < tail and found < n:
        p = qpid[h]
        if evictable[p] and last_use[p] == quse[h]:
            out[found] = p
            found += 1
        h += 1
    return found, h


@jit
def forget_pages(pids, key_of, indexed, evictable, position_of):
    """Evicted pages: no key, not indexed, not evictable, no position."""
    for i in range(pids.shape[0]):
        p = pids[i]
        key_of[p]["lo"] = 0
        key_of[p]["hi"] = 0
        indexed[p] = False
        evictable[p] = False
        position_of[p] = -1


@jit
def distinct_and_unindexed(pids, indexed):
    """Whether the pages are distinct and none is indexed (flags restored on return)."""
    n = pids.shape[0]
    ok = True
    marked = 0
    for i in range(n):
        p = pids[i]
        if indexed[p]:
            ok = False
            break
        indexed[p] = True
        marked += 1
    for i in range(marked):
        indexed[pids[i]] = False
    return ok


@jit
def mark_registered(pids, got, keys, positions, indexed, key_of, position_of):
    """After the index's setdefault: a page got back under its own id is newly indexed under
    its key (the others stay private). Returns how many."""
    fresh = 0
    for i in range(pids.shape[0]):
        p = pids[i]
        if got[i] != p:
            continue
        indexed[p] = True
        key_of[p]["lo"] = keys[i]["lo"]
        key_of[p]["hi"] = keys[i]["hi"]
        position_of[p] = positions[i]
        fresh += 1
    return fresh


def as_int64(ids) -> np.ndarray:
    """Contiguous [n] int64 (what the loops take)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.flags.c_contiguous:
        return ids
    return np.ascontiguousarray(ids, dtype=np.int64)
