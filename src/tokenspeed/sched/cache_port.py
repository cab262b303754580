"""The seam between the schedulers and the cache: what a scheduler asks of one rank's cache.

The schedulers never see pages, slots or tiers, only these calls; a port keeps its own opaque
handle per request id (a P/D request is held by two ranks' ports at once while it transfers).
`tokenspeed.sched.cache_adapter.CacheManagerPort` implements it over the real
`tokenspeed.cache.CacheManager`; narrowly scoped unit tests may implement it directly.

Contract (lengths are token counts; `req.keys` are the request's page keys):
- `lookup(req, limit)`: reusable prefix length right now (hybrid rule, at most `limit`), taking no
  hold; used to estimate outstanding work. May be stale by the time the request is admitted.
- `acquire(req, limit)`: start holding the request on this rank: hold the reusable prefix (at most
  `limit` tokens) and a live state slot restored from its checkpoint. Returns the prefix length, or
  None when the device tier cannot take one more request now (nothing is held then). Raises
  `AdmissionError` when setting the request up failed (a device error while restoring its state or
  starting its load; nothing is held then either): the scheduler aborts that request alone.
- `reserve(req, length)`: make the request's pages cover [0, length). False (and nothing changed)
  when the device tier cannot, even after evicting unused cached pages.
- `covered(req)`: tokens the request's pages can hold without another `reserve`.
- `checkpoint(req, length, turn_end=, from_live=)`: [0, length) is computed and the KDA state at
  exactly `length` (page-aligned) becomes a checkpoint, making the prefix matchable on this rank.
  With `from_live` the live state is snapshotted (it must be at `length` now); otherwise the port
  returns the checkpoint slot, which the engine fills (a chunked kernel's intermediate state, or
  the state a decode row kept at its last page boundary) before its next cache call. Returns
  None when no new slot was needed or none was free (a dropped checkpoint is not an error).
- `publish(req, length)`: turn end: write the request's checkpointed prefix (up to `length`, which
  has a checkpoint) through to the host tier where there is one, for other ranks and later turns.
- `release(req)`: drop everything the request holds; published pages stay cached, others free.
- `free_pages()`: device pages available to new reservations (free or evictable).
"""

from __future__ import annotations

from typing import Protocol

from tokenspeed.sched.request import Request


class AdmissionError(Exception):
    """`acquire` failed for this request (not for want of room) and holds nothing for it."""


class CachePort(Protocol):
    page_size: int

    def lookup(self, req: Request, limit: int) -> int: ...

    def acquire(self, req: Request, limit: int) -> int | None: ...

    def reserve(self, req: Request, length: int) -> bool: ...

    def covered(self, req: Request) -> int: ...

    def checkpoint(
        self, req: Request, length: int, *, turn_end: bool, from_live: bool
    ) -> int | None: ...

    def publish(self, req: Request, length: int) -> None: ...

    def release(self, req: Request) -> None: ...

    def free_pages(self) -> int: ...
