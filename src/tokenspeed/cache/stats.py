"""Counters and occupancy snapshots the cache reports (`CacheManager.stats()`)."""

from __future__ import annotations

import attrs

from .l2.base import L2Stats


@attrs.frozen
class Occupancy:
    """Entries of one device pool. used: held by requests; cached: kept for reuse, evictable."""

    total: int
    free: int
    used: int
    cached: int


@attrs.define
class CacheCounters:
    """Running totals since construction (mutable; snapshotted into CacheStats)."""

    allocations: int = 0
    prompt_tokens: int = 0  # prompt tokens presented to allocate
    hit_tokens: int = 0  # of which reused (L)
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    kv_only_tokens: int = 0  # covered by MLA pages past the last checkpoint: not reusable
    l2_fetch_failures: int = 0  # hits shrunk because an L2 object could not be read back
    l2_errors: int = 0  # L2 backend calls that raised or answered nonsense (swallowed)
    checkpoints_taken: int = 0
    checkpoints_thinned: int = 0  # removed by the per-path cap
    checkpoints_dropped: int = 0  # not taken: every checkpoint slot was pinned
    checkpoints_discarded: int = 0  # taken, but the caller could not write their state
    checkpoints_promoted: int = 0  # L2 checkpoints also kept in the device tier after a load
    pages_evicted: int = 0
    checkpoints_evicted: int = 0
    pages_written_back: int = 0  # evicted pages written to L2 (write-back)
    checkpoints_written_back: int = 0
    objects_published: int = 0  # pages + checkpoints written to L2 by publish (write-through)
    bytes_loaded: int = 0  # host -> device bytes of L2 hits (bytes written: see L2Stats)


@attrs.frozen
class CacheStats:
    pages: Occupancy
    checkpoints: Occupancy
    live_slots: Occupancy
    requests: int
    counters: CacheCounters
    l2: L2Stats | None

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens presented to allocate."""
        c = self.counters
        return c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return attrs.asdict(self, recurse=True)
