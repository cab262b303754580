"""CacheStats: occupancy snapshots and running counters."""

from __future__ import annotations

from tokenspeed.cache import CheckpointKind, KeyChain

from .helpers import make_manager, token_stream


def test_stats_snapshot_is_detached_and_reports_hit_rate():
    cache = make_manager(metadata_only=True)
    keys = KeyChain(4).append_tokens(token_stream(1, 33))
    h = cache.allocate("a", keys, 33)
    cache.checkpoint(h, 32, kind=CheckpointKind.TURN_END)
    cache.release(h)
    first = cache.stats()
    cache.release(cache.allocate("b", keys, 33))
    second = cache.stats()
    assert first.counters.allocations == 1 and second.counters.allocations == 2
    assert second.hit_rate == 32 / 66
    assert second.pages.cached == 8 and second.checkpoints.cached == 1
    d = second.as_dict()
    assert d["counters"]["hit_tokens"] == 32 and d["l2"] is None
