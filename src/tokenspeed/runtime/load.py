"""`LoadSnapshot`: how busy one engine is, as a load-based gateway reads it.

    engine.load()          # Engine: computed now
    async_engine.load()    # AsyncEngine: now, or as of the last step's end while one runs

Requests: `running` (admitted: prefilling or decoding, holding cache) and `waiting` (queued for
admission). Tokens: `outstanding_prefill_tokens` (prompt tokens still to compute, queued
requests counted at their prompt minus their current prefix hit, as the router counts them)
and `outstanding_decode_tokens` (tokens every unfinished request may still generate, up to its
`max_tokens`: an upper bound). Pages of the device tier: `total_pages` (usable), `used_pages`
(held by requests), `cached_pages` (kept for prefix reuse, evictable) and `free_pages` (neither);
an allocation may take `free_pages + cached_pages` (`available_pages`). Capacity: `page_size`
(tokens per page) and `max_num_seqs` (requests that may run at once), so that a gateway can
turn pages into tokens and see how many more requests would start now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .engine import Engine


@attrs.frozen
class LoadSnapshot:
    running: int
    waiting: int
    outstanding_prefill_tokens: int
    outstanding_decode_tokens: int
    total_pages: int
    used_pages: int
    cached_pages: int
    free_pages: int
    page_size: int = 1
    max_num_seqs: int = 0  # 0: not known

    @property
    def outstanding_tokens(self) -> int:
        return self.outstanding_prefill_tokens + self.outstanding_decode_tokens

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable."""
        return self.free_pages + self.cached_pages

    def as_dict(self) -> dict[str, int]:
        return {
            **attrs.asdict(self),
            "outstanding_tokens": self.outstanding_tokens,
            "available_pages": self.available_pages,
        }


def engine_load(engine: Engine) -> LoadSnapshot:
    """The snapshot of one `Engine` (its scheduler's queues and its cache's page pool)."""
    scheduler = engine.scheduler
    prefill, decode = scheduler.prefill, scheduler.decode
    requests = [*prefill.waiting, *prefill.running.values(), *decode.running.values()]
    pages = engine.cache.stats().pages
    return LoadSnapshot(
        running=len(prefill.running) + len(decode.running),
        waiting=len(prefill.waiting),
        outstanding_prefill_tokens=scheduler.outstanding_tokens(),
        outstanding_decode_tokens=sum(r.output_remaining for r in requests),
        total_pages=pages.total,
        used_pages=pages.used,
        cached_pages=pages.cached,
        free_pages=pages.free,
        page_size=engine.config.page_size,
        max_num_seqs=engine.config.max_num_seqs,
    )
