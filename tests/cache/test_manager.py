"""CacheManager: the hybrid prefix rule, exact restores from both tiers, lifecycle and bad input."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.cache import (
    BudgetTooSmallError,
    CacheConfig,
    CacheConfigError,
    CacheError,
    CacheFullError,
    CacheManager,
    CheckpointKind,
    DuplicateRequestError,
    ForeignHandleError,
    IntegrityError,
    InvalidRequestError,
    KeyChain,
    LocalHostCache,
    ObjectKind,
    RequestReleasedError,
)

from .helpers import (
    live_state_matches,
    make_manager,
    pages_match,
    prefix_seed,
    tiny_geometry,
    token_stream,
    write_checkpoint_slot,
    write_live_state,
    write_pages,
)

P = 4


def _prefill(cache, rid, tokens, *, checkpoints, keys=None, publish=False, release=True):
    """Allocate `tokens` as a prompt, 'compute' it, checkpoint at the given lengths."""
    keys = keys if keys is not None else KeyChain(P).append_tokens(tokens)
    h = cache.allocate(rid, keys, len(tokens))
    h.load.synchronize()
    hit = h.num_cached_tokens
    write_pages(cache, h, hit // P, len(tokens) // P)
    for length in checkpoints:
        write_live_state(cache, h, prefix_seed(tokens[:length]))
        cache.checkpoint(h, length, kind=CheckpointKind.TURN_END)
    if publish:
        cache.publish(h)
    if release:
        cache.release(h)
    return h


def _snapshot(cache):
    s = cache.stats()
    return s.pages, s.checkpoints, s.live_slots, s.requests


# ------------------------------------------------------------------------- the hybrid rule
def test_pages_without_a_checkpoint_at_their_end_are_never_a_hit():
    cache = make_manager(pages=32)
    tokens = token_stream(1, 41)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 41)
    write_pages(cache, h, 0, 10)
    write_live_state(cache, h, prefix_seed(tokens[:40]))
    cache.checkpoint(h, 40)  # makes pages [0, 40) matchable
    slot = cache.checkpoint(h, 16, from_live=False)
    write_checkpoint_slot(cache, slot, prefix_seed(tokens[:16]))
    cache.release(h)
    assert cache.evict(checkpoints=1) == (0, 1)  # the LRU one: the checkpoint at 40
    # MLA pages still cover 40 tokens, but KDA state exists only at 16.
    m = cache.match(keys, len(tokens))
    assert m.mla_covered_tokens == 40
    assert m.num_tokens == 16 and m.kv_only_tokens == 24
    h = cache.allocate("b", keys, len(tokens))
    assert h.num_cached_tokens == 16
    assert pages_match(cache, h, 0, 4)
    assert live_state_matches(cache, h, prefix_seed(tokens[:16]))
    cache.release(h)
    assert cache.stats().counters.kv_only_tokens == 24
    cache.check_integrity()


def test_a_checkpoint_whose_state_was_never_written_can_be_withdrawn():
    """checkpoint(from_live=False) hands out a slot the caller fills; when that copy fails the
    caller withdraws it, and the prefix is a hit only up to the checkpoint before it."""
    cache = make_manager(pages=32)
    tokens = token_stream(3, 41)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 41)
    write_pages(cache, h, 0, 10)
    slot16 = cache.checkpoint(h, 16, from_live=False)
    write_checkpoint_slot(cache, slot16, prefix_seed(tokens[:16]))
    slot40 = cache.checkpoint(h, 40, kind=CheckpointKind.ROLLING, from_live=False)
    assert not cache.discard_checkpoint(h, 40, slot16)  # not the slot of that checkpoint
    assert not cache.discard_checkpoint(h, 17, slot40)  # not a page boundary
    assert cache.discard_checkpoint(h, 40, slot40)  # the copy into slot40 failed
    assert not cache.has_checkpoint(h, 40) and cache.has_checkpoint(h, 16)
    assert cache.stats().counters.checkpoints_discarded == 1
    cache.check_integrity()
    cache.release(h)
    m = cache.match(keys, len(tokens))
    assert m.num_tokens == 16
    h = cache.allocate("b", keys, len(tokens))
    assert live_state_matches(cache, h, prefix_seed(tokens[:16]))
    cache.release(h)
    cache.check_integrity()


def test_discarding_a_rolling_checkpoint_another_request_holds_changes_nothing():
    """Two requests with one history share a rolling checkpoint; the one that wrote it cannot
    discard it (IntegrityError), and the refusal leaves its pin and its rolling entry as they
    were (before, it dropped its own pin first and then raised)."""
    cache = make_manager(pages=64)
    tokens = token_stream(7, 41)
    keys = KeyChain(P).append_tokens(tokens)
    a = cache.allocate("a", keys, 41)
    b = cache.allocate("b", keys, 41)
    slot = cache.checkpoint(a, 40, kind=CheckpointKind.ROLLING, from_live=False)
    assert slot is not None
    assert cache.checkpoint(b, 40, kind=CheckpointKind.ROLLING, from_live=False) is None
    with pytest.raises(IntegrityError, match="held by another"):
        cache.discard_checkpoint(a, 40, slot)
    assert cache.has_checkpoint(a, 40)
    assert a._rolling is not None and a._rolling.refcount == 2  # a's pin and b's
    cache.check_integrity()
    cache.release(b)
    cache.release(a)
    cache.check_integrity()


def test_a_failed_snapshot_of_the_live_state_leaves_no_checkpoint(monkeypatch):
    cache = make_manager(pages=32)
    tokens = token_stream(4, 41)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 41)
    write_pages(cache, h, 0, 10)
    write_live_state(cache, h, prefix_seed(tokens[:40]))

    def failing(live_slot, slot):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(cache.storage, "save_checkpoint", failing)
    with pytest.raises(RuntimeError, match="device copy failed"):
        cache.checkpoint(h, 40)
    assert not cache.has_checkpoint(h, 40)
    cache.check_integrity()
    cache.release(h)
    assert cache.match(keys, len(tokens)).num_tokens == 0
    cache.check_integrity()


def test_no_checkpoint_no_hit_whatever_the_page_coverage():
    cache = make_manager()
    tokens = token_stream(2, 33)
    _prefill(cache, "a", tokens, checkpoints=[])
    keys = KeyChain(P).append_tokens(tokens)
    assert cache.match(keys, len(tokens)).num_tokens == 0
    h = cache.allocate("b", keys, len(tokens))
    assert h.num_cached_tokens == 0
    assert live_state_matches(cache, h, None)  # a miss starts from zero state
    cache.release(h)


def test_a_checkpoint_whose_pages_are_gone_is_never_a_hit():
    cache = make_manager(pages=32)
    tokens = token_stream(3, 33)
    _prefill(cache, "a", tokens, checkpoints=[16, 32])
    # Release put the tail pages first in LRU order: evicting two drops pages 7 and 6, so the
    # checkpoint at 32 tokens has lost its pages while the one at 16 is still covered.
    assert cache.evict(pages=2) == (2, 0)
    keys = KeyChain(P).append_tokens(tokens)
    m = cache.match(keys, len(tokens))
    assert (m.mla_covered_tokens, m.num_tokens) == (24, 16)
    h = cache.allocate("b", keys, len(tokens))
    assert h.num_cached_tokens == 16
    assert pages_match(cache, h, 0, 4)
    assert live_state_matches(cache, h, prefix_seed(tokens[:16]))
    cache.release(h)
    cache.check_integrity()


def test_hit_leaves_at_least_one_token_to_compute():
    cache = make_manager()
    tokens = token_stream(4, 32)
    _prefill(cache, "a", [*tokens, 7], checkpoints=[16, 32])
    keys = KeyChain(P).append_tokens(tokens)
    assert cache.match(keys, 33).num_tokens == 32
    assert cache.match(keys, 32).num_tokens == 16  # a prompt of exactly 32 tokens recomputes one
    assert cache.match(keys, 1).num_tokens == 0


def test_hit_restores_exact_bytes_from_device_tier():
    cache = make_manager()
    tokens = token_stream(5, 30)
    _prefill(cache, "a", tokens, checkpoints=[28])
    h = cache.allocate("b", KeyChain(P).append_tokens(tokens), 30)
    assert (h.num_cached_tokens, h.l2_cached_tokens) == (28, 0)
    assert pages_match(cache, h, 0, 7)
    assert live_state_matches(cache, h, prefix_seed(tokens[:28]))
    # The hit pages are shared, not copied.
    cache.release(h)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("async_loads", "rows"),
    [(False, P), (True, P), (False, P // 2)],
    ids=["inline", "async", "dcp"],
)
def test_hit_restores_exact_bytes_from_host_tier(async_loads, rows):
    """rows: the MLA rows of a device page (P // 2: a DCP pair's member, half of each page)."""
    g = tiny_geometry(mla_rows_per_page=rows)
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(g, l2=l2, async_loads=async_loads)
    tokens = token_stream(6, 30)
    _prefill(cache, "a", tokens, checkpoints=[16, 28], publish=True)
    assert cache.evict(pages=100, checkpoints=100) == (7, 2)
    keys = KeyChain(P).append_tokens(tokens)
    m = cache.match(keys, 30)
    assert (m.num_tokens, m.l2_tokens, m.checkpoint_tier) == (28, 28, "l2")
    h = cache.allocate("b", keys, 30, match=m)
    assert (h.num_cached_tokens, h.l2_cached_tokens) == (28, 28)
    assert h.load.l2_pages == 7 and h.load.l2_checkpoint
    for layer in range(g.num_mla_layers):
        h.load.wait_mla(layer)
    for layer in range(g.num_kda_layers):
        h.load.wait_kda(layer)
    assert h.load.done()
    assert pages_match(cache, h, 0, 7)
    assert live_state_matches(cache, h, prefix_seed(tokens[:28]))
    cache.release(h)
    # The checkpoint came back into the device tier with the load: the next turn hits L1.
    m2 = cache.match(keys, 30)
    assert (m2.num_tokens, m2.l1_tokens, m2.checkpoint_tier) == (28, 28, "l1")
    assert cache.stats().counters.checkpoints_promoted == 1
    cache.check_integrity()
    cache.close()


def test_hit_mixes_device_pages_host_pages_and_host_checkpoint():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(l2=l2)
    tokens = token_stream(7, 33)
    _prefill(cache, "a", tokens, checkpoints=[32], publish=True)
    cache.evict(pages=3, checkpoints=1)  # the last 3 pages and the checkpoint leave L1
    keys = KeyChain(P).append_tokens(tokens)
    m = cache.match(keys, 33)
    assert (m.num_tokens, m.l1_tokens, m.l2_tokens, m.checkpoint_tier) == (32, 20, 12, "l2")
    h = cache.allocate("b", keys, 33)
    h.load.synchronize()
    assert pages_match(cache, h, 0, 8)
    assert live_state_matches(cache, h, prefix_seed(tokens[:32]))
    cache.release(h)
    cache.check_integrity()


def _only_in_l2(seed):
    """(l2, cache, tokens, keys): a published 33-token history with checkpoints at 16 and 32,
    evicted from the device tier, so that a hit on it loads everything from L2."""
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(l2=l2)
    tokens = token_stream(seed, 33)
    _prefill(cache, "a", tokens, checkpoints=[16, 32], publish=True)
    cache.evict(pages=100, checkpoints=100)
    return l2, cache, tokens, KeyChain(P).append_tokens(tokens)


def test_corrupted_host_object_is_rejected_and_the_hit_shrinks():
    l2, cache, tokens, keys = _only_in_l2(8)
    l2.corrupt_for_test(ObjectKind.PAGE, keys[5])  # page 5 lies between the two checkpoints
    h = cache.allocate("b", keys, 33)
    h.load.synchronize()
    assert h.num_cached_tokens == 16  # fell back to the checkpoint that page 5 does not feed
    assert pages_match(cache, h, 0, 4)
    assert live_state_matches(cache, h, prefix_seed(tokens[:16]))
    s = cache.stats()
    assert s.l2.corrupt == 1 and s.counters.l2_fetch_failures == 1
    cache.release(h)
    cache.check_integrity()


def test_corrupted_host_checkpoint_falls_back_to_a_shallower_one():
    l2, cache, tokens, keys = _only_in_l2(9)
    l2.corrupt_for_test(ObjectKind.CHECKPOINT, keys[7])
    h = cache.allocate("b", keys, 33)
    h.load.synchronize()
    assert h.num_cached_tokens == 16
    assert live_state_matches(cache, h, prefix_seed(tokens[:16]))
    cache.release(h)


# ------------------------------------------------------------------------------ lifecycle
def test_lifecycle_grows_pages_and_counts_hits():
    cache = make_manager(pages=16)
    tokens = token_stream(10, 40)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys[:2], 9, reserve_tokens=5)  # a chunked prefill reserves less
    assert (h.num_tokens, len(h.page_ids)) == (5, 2)
    cache.extend(h, 9, keys[2:])
    assert (h.num_tokens, len(h.page_ids)) == (9, 3)
    cache.extend(h, 9)  # no growth: nothing allocated
    assert len(h.page_ids) == 3
    cache.extend(h, 40)
    assert len(h.page_ids) == 10 and len(set(h.page_ids)) == 10
    s = cache.stats()
    assert (s.pages.used, s.pages.free, s.live_slots.used) == (10, 6, 1)
    cache.release(h)
    s = cache.stats()
    assert (s.pages.used, s.pages.free, s.pages.cached) == (0, 16, 0)  # nothing was registered
    cache.check_integrity()


def test_released_pages_stay_cached_until_evicted_lru_tail_first():
    cache = make_manager(pages=16)
    tokens = token_stream(11, 33)
    h = _prefill(cache, "a", tokens, checkpoints=[32])
    table = list(h.page_ids)
    assert cache.stats().pages.cached == 8
    n, _ = cache.evict(pages=3)
    assert n == 3
    keys = KeyChain(P).append_tokens(tokens)
    assert cache._pages.lookup(keys) == [*table[:5], None, None, None]


def test_held_pages_are_never_evicted():
    cache = make_manager(pages=9)
    tokens = token_stream(12, 33)
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("a", keys, 33, reserve_tokens=32)
    write_pages(cache, h, 0, 8)
    write_live_state(cache, h, prefix_seed(tokens[:32]))
    cache.checkpoint(h, 32)
    assert cache.evict(pages=100, checkpoints=100) == (0, 1)  # pages held; checkpoint is not
    assert pages_match(cache, h, 0, 8)
    other = KeyChain(P).append_tokens(token_stream(99, 33))
    with pytest.raises(CacheFullError):
        cache.allocate("b", other, 33)  # 9 pages needed, 1 free, none evictable
    assert pages_match(cache, h, 0, 8)
    cache.check_integrity()
    cache.release(h)


def test_allocate_evicts_cached_pages_when_short():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(pages=9, l2=l2)
    _prefill(cache, "a", token_stream(13, 33), checkpoints=[32])
    assert (cache.stats().pages.cached, cache.stats().pages.free) == (8, 1)
    h = cache.allocate("b", KeyChain(P).append_tokens(token_stream(14, 20)), 20)
    s = cache.stats()
    assert s.counters.pages_evicted == 4 and s.counters.pages_written_back == 4  # write-back
    assert s.l2.objects == 4
    cache.release(h)
    cache.check_integrity()


def test_a_device_error_while_writing_back_an_eviction_leaves_the_hit_unpinned(monkeypatch):
    """allocate pins the L1 hit before taking fresh pages; when taking them evicts pages whose
    write-back fails on the device, the hit (and its checkpoint) must not stay pinned."""
    cache = make_manager(pages=8, l2=LocalHostCache(capacity_bytes=1 << 20))
    tokens = token_stream(15, 17)
    _prefill(cache, "a", tokens, checkpoints=[16])  # 4 cached pages and a checkpoint: the hit
    _prefill(cache, "b", token_stream(16, 13), checkpoints=[12])  # 3 more cached pages
    before = _snapshot(cache)

    def failing(pids):
        raise RuntimeError("device read failed")

    monkeypatch.setattr(cache.storage, "read_pages", failing)
    keys = KeyChain(P).append_tokens(tokens)
    assert cache.match(keys, 29).num_tokens == 16
    with pytest.raises(RuntimeError, match="device read failed"):
        cache.allocate("c", keys, 29)  # 4 hit pages + 4 fresh: 3 must be evicted
    assert _snapshot(cache) == before
    cache.check_integrity()
    monkeypatch.undo()
    h = cache.allocate("c", keys, 29)
    assert h.num_cached_tokens == 16
    cache.release(h)
    cache.check_integrity()


def test_extend_with_unreadable_keys_changes_nothing():
    cache = make_manager(pages=8)
    h = cache.allocate("a", KeyChain(P).append_tokens(token_stream(17, 9)), 9)
    before = (_snapshot(cache), list(h.page_ids), h.num_tokens, h.num_keys)
    with pytest.raises(CacheConfigError):
        cache.extend(h, 20, [-1])  # not a page key: raised before any page is taken
    assert (_snapshot(cache), list(h.page_ids), h.num_tokens, h.num_keys) == before
    cache.check_integrity()
    cache.extend(h, 20, KeyChain(P).append_tokens(token_stream(18, 8)))
    assert (len(h.page_ids), h.num_keys) == (5, 4)
    cache.release(h)
    cache.check_integrity()


def test_integrity_check_catches_a_shared_page_at_a_foreign_position():
    """A page is written back at its chain position and a reader checks it: a request's
    indexed page must sit at the position it is indexed at."""
    cache = make_manager(pages=16)
    tokens = token_stream(19, 17)
    _prefill(cache, "a", tokens, checkpoints=[16])
    h = cache.allocate("b", KeyChain(P).append_tokens(tokens), 17)
    assert h.num_cached_tokens == 16
    cache.check_integrity()
    pages = cache._pages
    a, b = h.page_ids[1], h.page_ids[2]
    pages.position_of[a], pages.position_of[b] = pages.position_of[b], pages.position_of[a]
    with pytest.raises(IntegrityError, match="position"):
        cache.check_integrity()


def test_sink_page_and_slot_are_never_handed_out():
    cache = make_manager(pages=6, live=3)
    handles = [cache.allocate(i, [], 8) for i in range(3)]  # 2 pages each: the whole pool
    pages = [p for h in handles for p in h.page_ids]
    assert sorted(pages) == [1, 2, 3, 4, 5, 6] and cache.sink_page == 0
    assert sorted(h.live_slot for h in handles) == [1, 2, 3] and cache.sink_slot == 0
    with pytest.raises(CacheFullError):
        cache.allocate(9, [], 1)
    table = cache.page_table_tensor(handles[:2], num_rows=4, num_cols=3)
    assert table.shape == (4, 3) and table.dtype == torch.int32
    assert table[0, :2].tolist() == handles[0].page_ids.tolist() and table[0, 2] == 0
    assert (table[2:] == 0).all()
    slots = cache.live_slot_tensor(handles[:2], num_rows=4)
    assert slots.tolist() == [handles[0].live_slot, handles[1].live_slot, 0, 0]


def test_runtime_views_have_documented_shapes():
    g = tiny_geometry()
    cache = make_manager(g, pages=10, live=2, checkpoints=3)
    assert cache.mla_layer(1).shape == (11, P, g.mla_row_width)
    conv, rec = cache.kda_layer(2)
    assert conv.shape == (3, *g.kda_conv_shape) and conv.dtype == g.kda_conv_dtype
    assert rec.shape == (3, *g.kda_recurrent_shape) and rec.dtype == torch.float32


# --------------------------------------------------------------------------- checkpoints
def test_checkpoint_dropped_when_every_slot_is_pinned():
    cache = make_manager(pages=16, live=3, checkpoints=1)
    a = cache.allocate("a", KeyChain(P).append_tokens(token_stream(17, 9)), 9)
    b = cache.allocate("b", KeyChain(P).append_tokens(token_stream(18, 9)), 9)
    assert cache.checkpoint(a, 8, kind=CheckpointKind.ROLLING) is not None
    assert cache.checkpoint(b, 8, kind=CheckpointKind.ROLLING) is None  # a pins the only slot
    assert cache.stats().counters.checkpoints_dropped == 1
    cache.release(a)
    cache.release(b)
    cache.check_integrity()


def test_checkpoint_of_an_existing_prefix_needs_no_new_slot():
    cache = make_manager()
    tokens = token_stream(19, 17)
    _prefill(cache, "a", tokens, checkpoints=[16])
    h = cache.allocate("b", KeyChain(P).append_tokens(tokens), 17)
    assert h.num_cached_tokens == 16
    taken = cache.stats().counters.checkpoints_taken
    assert cache.checkpoint(h, 16) is None
    assert cache.stats().counters.checkpoints_taken == taken
    cache.release(h)
    cache.check_integrity()


# ---------------------------------------------------------------------------- publishing
def test_publish_writes_through_once_and_another_rank_reads_it():
    g = tiny_geometry()
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    a, b = make_manager(g, l2=l2), make_manager(g, l2=l2)
    tokens = token_stream(20, 33)
    h = _prefill(a, "x", tokens, checkpoints=[16, 32], release=False)
    assert a.publish(h) == 10  # 8 pages + 2 checkpoints
    assert a.publish(h) == 0  # already there
    a.release(h)
    keys = KeyChain(P).append_tokens(tokens)
    hb = b.allocate("y", keys, 33)
    assert (hb.num_cached_tokens, hb.l2_cached_tokens) == (32, 32)
    assert pages_match(b, hb, 0, 8) and live_state_matches(b, hb, prefix_seed(tokens[:32]))
    b.release(hb)
    a.check_integrity()
    b.check_integrity()


def test_publish_without_checkpoints_writes_nothing():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(l2=l2)
    h = _prefill(cache, "a", token_stream(21, 20), checkpoints=[], release=False)
    assert cache.publish(h) == 0 and l2.stats().objects == 0
    cache.release(h, publish=True)


# ------------------------------------------------------------------------------ bad input
def test_release_twice_raises_and_leaves_pools_consistent():
    cache = make_manager()
    h = cache.allocate("a", [], 10)
    cache.release(h)
    before = _snapshot(cache)
    with pytest.raises(RequestReleasedError, match="released"):
        cache.release(h)
    with pytest.raises(RequestReleasedError):
        cache.extend(h, 20)
    with pytest.raises(RequestReleasedError):
        cache.checkpoint(h, 8)
    with pytest.raises(RequestReleasedError):
        cache.publish(h)
    assert _snapshot(cache) == before
    cache.check_integrity()


def test_invalid_arguments_raise_and_change_nothing():
    cache = make_manager()
    keys = KeyChain(P).append_tokens(token_stream(22, 20))
    h = cache.allocate("a", keys, 20)
    before = (_snapshot(cache), list(h.page_ids), h.num_tokens)
    with pytest.raises(DuplicateRequestError):
        cache.allocate("a", keys, 20)
    with pytest.raises(InvalidRequestError, match="never shrinks"):
        cache.extend(h, 10)
    with pytest.raises(InvalidRequestError, match="multiple of 4"):
        cache.checkpoint(h, 6)
    with pytest.raises(InvalidRequestError):
        cache.checkpoint(h, 24)  # beyond the reserved tokens
    with pytest.raises(InvalidRequestError):
        cache.checkpoint(h, 0)
    with pytest.raises(InvalidRequestError):
        cache.allocate("b", keys, 0)
    with pytest.raises(InvalidRequestError):
        cache.match(keys, 0)
    with pytest.raises(InvalidRequestError):
        cache.evict(pages=-1)
    other = make_manager()
    with pytest.raises(ForeignHandleError):
        other.release(h)
    assert (_snapshot(cache), list(h.page_ids), h.num_tokens) == before
    cache.check_integrity()
    other.check_integrity()


def test_budget_too_small_for_one_request():
    g = tiny_geometry()
    with pytest.raises(BudgetTooSmallError, match="device_budget_bytes"):
        CacheManager(g, CacheConfig(device_budget_bytes=g.kda_state_bytes, max_live_requests=1))
    cache = make_manager(g, pages=8)
    before = _snapshot(cache)
    with pytest.raises(BudgetTooSmallError, match="8"):
        cache.allocate("big", [], 100)  # 25 pages: can never fit
    assert _snapshot(cache) == before
    h = cache.allocate("ok", [], 10)
    with pytest.raises(BudgetTooSmallError):
        cache.extend(h, 40)
    assert len(h.page_ids) == 3
    cache.release(h)
    cache.check_integrity()


def test_cache_full_is_transient():
    cache = make_manager(pages=8, live=2)
    a = cache.allocate("a", [], 24)
    before = _snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.allocate("b", [], 12)
    assert _snapshot(cache) == before
    assert not cache.can_allocate([], 12)
    cache.release(a)
    assert cache.can_allocate([], 12)
    cache.release(cache.allocate("b", [], 12))
    cache.check_integrity()


# ---------------------------------------------------------------------- modes, matching
def test_stale_match_is_rematched_not_trusted():
    cache = make_manager(pages=16)
    tokens = token_stream(23, 33)
    _prefill(cache, "a", tokens, checkpoints=[16, 32])
    keys = KeyChain(P).append_tokens(tokens)
    m = cache.match(keys, 33)
    assert m.num_tokens == 32
    cache.evict(pages=2)  # the plan's last pages are gone
    h = cache.allocate("b", keys, 33, match=m)
    assert h.num_cached_tokens == 16
    assert pages_match(cache, h, 0, 4)
    cache.release(h)
    cache.check_integrity()


def test_metadata_only_mode_has_no_tensors_but_same_bookkeeping():
    g = tiny_geometry()
    l2 = LocalHostCache(capacity_bytes=1 << 20, metadata_only=True)
    cache = make_manager(g, metadata_only=True, l2=l2)
    assert cache.storage is None
    with pytest.raises(CacheError):
        cache.mla_layer(0)
    keys = KeyChain(P).append_tokens(token_stream(24, 33))
    h = cache.allocate("a", keys, 33)
    cache.checkpoint(h, 32, kind=CheckpointKind.TURN_END)
    cache.publish(h)
    cache.release(h)
    cache.evict(pages=100, checkpoints=100)
    h = cache.allocate("b", keys, 33)
    assert (h.num_cached_tokens, h.l2_cached_tokens, h.load.l2_checkpoint) == (32, 32, True)
    assert h.load.done()
    cache.release(h)
    assert l2.stats().bytes == 8 * g.mla_page_bytes + g.kda_state_bytes
    cache.check_integrity()


def test_shared_versus_rank_local_l2_in_metadata_mode():
    g = tiny_geometry()
    keys = KeyChain(P).append_tokens(token_stream(25, 33))

    def run(shared: bool) -> int:
        l2s = [LocalHostCache(capacity_bytes=1 << 20, metadata_only=True) for _ in range(2)]
        if shared:
            l2s[1] = l2s[0]
        ranks = [make_manager(g, metadata_only=True, l2=l2) for l2 in l2s]
        h = ranks[0].allocate("turn1", keys, 33)
        ranks[0].checkpoint(h, 32, kind=CheckpointKind.TURN_END)
        ranks[0].release(h, publish=True)
        h = ranks[1].allocate("turn2", keys, 33)  # the next turn lands on the other rank
        return h.num_cached_tokens

    assert run(shared=True) == 32
    assert run(shared=False) == 0


def test_ranks_sharing_an_l2_must_share_a_geometry():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    make_manager(tiny_geometry(), l2=l2)
    with pytest.raises(CacheConfigError, match="geometry"):
        make_manager(tiny_geometry(mla_row_width=8), l2=l2)
    with pytest.raises(CacheConfigError, match="metadata_only"):
        make_manager(tiny_geometry(), l2=l2, metadata_only=True)


def test_two_managers_in_one_process_are_independent():
    a, b = make_manager(async_loads=True), make_manager(async_loads=True)
    ha = a.allocate("same-id", [], 8)
    hb = b.allocate("same-id", [], 8)
    assert ha.page_ids.tolist() == hb.page_ids.tolist()  # separate pools hand out the same ids
    a.storage.mla.fill_(1)
    assert not b.storage.mla.any()
    with pytest.raises(ForeignHandleError):
        b.release(ha)
    a.release(ha)
    b.release(hb)
    a.close()
    b.close()


def test_has_checkpoint_reports_exactly_the_checkpointed_lengths():
    from tokenspeed.cache import CacheConfig, CacheGeometry, CacheManager, KeyChain

    geometry = CacheGeometry.from_model_dims(
        num_mla_layers=1,
        kv_lora_rank=4,
        qk_rope_head_dim=4,
        num_kda_layers=1,
        kda_num_heads=1,
        kda_head_dim=4,
        kda_conv_kernel=4,
        page_size=4,
    )
    cache = CacheManager(
        geometry,
        CacheConfig(
            device_budget_bytes=CacheConfig.budget_for(
                geometry, pages=8, live_requests=1, checkpoints=4
            ),
            max_live_requests=1,
            num_checkpoint_slots=4,
        ),
    )
    chain = KeyChain(4)
    chain.append_tokens(list(range(13)))
    handle = cache.allocate("r", chain.keys, 13)
    assert not cache.has_checkpoint(handle, 8)
    cache.checkpoint(handle, 8)
    assert cache.has_checkpoint(handle, 8)
    assert not cache.has_checkpoint(handle, 4) and not cache.has_checkpoint(handle, 7)
    assert not cache.has_checkpoint(handle, 16)
    cache.release(handle)


@pytest.mark.parametrize("call", ["match", "allocate", "reserve", "extend", "evict"])
def test_token_and_page_counts_refuse_bools(call):
    """True is an int to Python; as a token or page count it is a caller's bug (a flag passed
    where a length goes), refused like any other non-count instead of read as 1."""
    cache = make_manager(pages=32)
    tokens = token_stream(8, 9)
    keys = KeyChain(P).append_tokens(tokens)
    with pytest.raises(InvalidRequestError):
        if call == "match":
            cache.match(keys, True)
        elif call == "allocate":
            cache.allocate("a", keys, True)
        elif call == "reserve":
            cache.allocate("a", keys, 9, reserve_tokens=True)
        elif call == "extend":
            h = cache.allocate("a", keys, 1)
            cache.extend(h, True)
        else:
            cache.evict(pages=True)
    cache.check_integrity()
