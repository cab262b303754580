"""`CachePort` over the real `tokenspeed.cache.CacheManager` of one rank.

The manager hands out one opaque `RequestCache` per request; this port keeps them by request id,
so an engine gets page tables and live slots through `handle(rid)`. Capacity errors
(`CacheFullError`, and `BudgetTooSmallError` for a request that can never fit) become the
port's "not now" answers; any other cache error is a bug and propagates. Any other failure of
`allocate` (a device error while it set the request up; it gives everything back first) becomes
`AdmissionError`, so that the scheduler aborts that request and goes on.

Besides the `CachePort` calls of the schedulers, the port is the engine's one way into the cache
(the engine and its KDA state keeper hold it, never the manager): the handles it runs forwards
over, the rolling checkpoints and the checkpoint withdrawals of decode rows, the copies of KDA
states between live and checkpoint slots, and the integrity check and shutdown. The model
runner alone reads the device pools directly, through a read-only view (`runtime.runner`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    import torch

    KdaState = tuple[torch.Tensor, torch.Tensor]

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

    # ---- the engine's calls (not part of `CachePort`: the schedulers never make them) ---------
    def rolling_checkpoint(self, rid: Hashable, length: int, *, from_live: bool) -> int | None:
        """A decode row's history is computed up to `length` (page-aligned): make the KDA state
        there the request's rolling checkpoint (the one kept at its latest page boundary, which
        replaces the previous one). Same answers as `checkpoint`: with `from_live` the live state
        (which must be at `length` now) is snapshotted; otherwise the returned slot must be
        written (`write_checkpoint_state`) before the next cache call. None: no new slot was
        needed (one exists at `length`: it becomes the rolling one) or none was free."""
        return self.cache.checkpoint(
            self._handles[rid], length, kind=CheckpointKind.ROLLING, from_live=from_live
        )

    def has_checkpoint(self, rid: Hashable, length: int) -> bool:
        """Whether a KDA checkpoint exists at exactly `length` of the request's prefix."""
        return self.cache.has_checkpoint(self._handles[rid], length)

    def discard_checkpoint(self, rid: Hashable, length: int, slot: int) -> bool:
        """Withdraw the checkpoint at `length` that was handed out in `slot` and whose state
        could not be written, so that no request ever starts from it. False (nothing changed)
        when the checkpoint at `length` is not in `slot`."""
        return self.cache.discard_checkpoint(self._handles[rid], length, slot)

    def read_live_state(self, rid: Hashable) -> KdaState:
        """Copies of the request's live KDA state over all KDA layers: (conv, recurrent), on the
        device (queued in stream order: the copies see every kernel launched before)."""
        storage = self.cache.storage
        slot = self._handles[rid].live_slot
        return storage.conv[:, slot].clone(), storage.recurrent[:, slot].clone()

    def write_checkpoint_state(self, slot: int, state: KdaState) -> None:
        """Write a KDA state (as `read_live_state` returns it) into checkpoint slot `slot`, one
        that `checkpoint` or `rolling_checkpoint` handed out with from_live=False."""
        storage = self.cache.storage
        storage.ckpt_conv[:, slot].copy_(state[0])
        storage.ckpt_recurrent[:, slot].copy_(state[1])

    def check_integrity(self) -> None:
        """The manager's own consistency check (raises `IntegrityError`)."""
        self.cache.check_integrity()

    def close(self) -> None:
        """Shut the manager down (its copy worker); the port is unusable afterwards."""
        self.cache.close()
