"""CheckpointPaths: the per-path cap and rolling checkpoints, through the facade."""

from __future__ import annotations

from tokenspeed.cache import CheckpointKind, CheckpointPolicy, KeyChain

from .helpers import (
    live_state_matches,
    make_manager,
    prefix_seed,
    token_stream,
    write_live_state,
    write_pages,
)

P = 4


def test_rolling_checkpoint_replaces_itself_and_becomes_turn_end():
    cache = make_manager(pages=16, checkpoints=4)
    tokens = token_stream(15, 30)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 30)
    write_pages(cache, h, 0, 7)
    for length in (8, 12, 16, 20, 24, 28):  # decode crossing page boundaries
        write_live_state(cache, h, prefix_seed(tokens[:length]))
        cache.checkpoint(h, length, kind=CheckpointKind.ROLLING)
        assert cache.stats().checkpoints.used == 1  # only the latest, pinned by the request
    cache.release(h)
    entry = cache._ckpts.get(keys[6])
    assert entry is not None and entry.kind is CheckpointKind.TURN_END
    assert cache.stats().checkpoints.cached == 1
    h2 = cache.allocate("b", keys, 30)
    assert h2.num_cached_tokens == 28
    assert live_state_matches(cache, h2, prefix_seed(tokens[:28]))
    cache.release(h2)
    cache.check_integrity()


def test_checkpoints_per_path_are_capped_and_spread_out():
    policy = CheckpointPolicy(interval_pages=1, max_per_path=3)
    cache = make_manager(pages=16, checkpoints=8, policy=policy)
    tokens = token_stream(16, 41)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 41)
    write_pages(cache, h, 0, 10)
    points = cache.checkpoint_points(0, 41, turn_end=True)
    assert [n for n, _ in points] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert points[-1][1] is CheckpointKind.TURN_END
    for length, kind in points:
        write_live_state(cache, h, prefix_seed(tokens[:length]))
        cache.checkpoint(h, length, kind=kind)
    kept = sorted(e.num_tokens for e in cache._ckpts.index.values())
    assert len(kept) == 3 and kept[-1] == 40  # the turn end (newest) always survives
    assert kept[0] <= 16  # thinning keeps early checkpoints too, not just the latest
    assert cache.stats().counters.checkpoints_thinned == 7
    cache.release(h)
    cache.check_integrity()
