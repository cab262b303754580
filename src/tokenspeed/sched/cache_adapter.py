"""`CachePort` over the real `tokenspeed.cache.CacheManager` of one rank.

The manager hands out one opaque `RequestCache` per request; this port keeps them by request id,
so an engine gets page tables and live slots through `handle(rid)`. Capacity errors
(`CacheFullError`, and `BudgetTooSmallError` for a request that can never fit) become the
port's "not now" answers; any other cache error is a bug and propagates. Any other failure of
`allocate` (a device error while it set the request up; it gives everything back first) becomes
`AdmissionError`, so that the scheduler aborts that request and goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from tokenspeed.cache import (
    BudgetTooSmallError,
    CacheError,
    CacheFullError,
    CacheManager,
    CheckpointKind,
    PrefixMatch,
    RequestCache,
)
from tokenspeed.sched.cache_port import AdmissionError
from tokenspeed.sched.request import Request

logger = logging.getLogger("tokenspeed.sched")

_CAPACITY_ERRORS = (CacheFullError, BudgetTooSmallError)


class CacheManagerPort:
    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self._handles: dict[Hashable, RequestCache] = {}
        # The latest lookup: (rid, limit, match). A request queued on an idle rank is admitted
        # at once; `allocate` reuses the match when neither tier changed in between (it checks),
        # instead of walking the prefix again.
        self._last: tuple[Hashable, int, PrefixMatch] | None = None

    def handle(self, rid: Hashable) -> RequestCache:
        """The cache handle a request holds on this rank (page table, live slot, loads)."""
        return self._handles[rid]

    def holds(self, rid: Hashable) -> bool:
        return rid in self._handles

    def lookup(self, req: Request, limit: int) -> int:
        if limit < self.page_size:
            return 0
        # `match` leaves at least one token of `prompt_tokens` uncached: limit + 1 caps at limit.
        m = self.cache.match(req.keys, limit + 1)
        self._last = (req.rid, limit, m)
        return m.num_tokens

    def acquire(self, req: Request, limit: int) -> int | None:
        last, self._last = self._last, None
        m = last[2] if last is not None and last[:2] == (req.rid, limit) else None
        try:
            handle = self.cache.allocate(req.rid, req.keys, limit + 1, reserve_tokens=1, match=m)
        except _CAPACITY_ERRORS:
            return None
        except CacheError:
            raise
        except Exception as exc:
            logger.warning("request %r could not be admitted: %r", req.rid, exc)
            raise AdmissionError(f"could not set up its cache: {exc!r}") from exc
        self._handles[req.rid] = handle
        return handle.num_cached_tokens

    def reserve(self, req: Request, length: int) -> bool:
        handle = self._handles[req.rid]
        if length <= handle.num_tokens:
            return True
        try:
            self.cache.extend(handle, length, self._new_keys(req, handle))
        except _CAPACITY_ERRORS:
            return False
        return True

    def sync_keys(self, req: Request) -> None:
        """Hand the cache the keys of pages completed since the last reservation (an engine
        that samples several steps per reservation calls this between them)."""
        handle = self._handles[req.rid]
        keys = self._new_keys(req, handle)
        if len(keys):
            self.cache.extend(handle, handle.num_tokens, keys)

    @staticmethod
    def _new_keys(req: Request, handle: RequestCache):
        known = handle.num_keys
        return req.keys[known:] if len(req.keys) > known else ()

    def covered(self, req: Request) -> int:
        return self._handles[req.rid].num_tokens

    def checkpoint(
        self, req: Request, length: int, *, turn_end: bool, from_live: bool
    ) -> int | None:
        kind = CheckpointKind.TURN_END if turn_end else CheckpointKind.INTERVAL
        return self.cache.checkpoint(self._handles[req.rid], length, kind=kind, from_live=from_live)

    def publish(self, req: Request, length: int) -> None:
        # The manager publishes the deepest checkpointed prefix, which the scheduler has just
        # made `length`.
        self.cache.publish(self._handles[req.rid])

    def release(self, req: Request) -> None:
        self.cache.release(self._handles.pop(req.rid))

    def free_pages(self) -> int:
        return self.cache.available_pages
