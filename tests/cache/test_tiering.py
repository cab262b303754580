"""Tiering: coverage across both tiers, and hits that shrink when L2 cannot deliver."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenspeed.cache import CacheConfigError, CheckpointKind, KeyChain, LocalHostCache, ObjectKind
from tokenspeed.cache.tiering import Tiering

from .helpers import make_manager, tiny_geometry, token_stream

P = 4


def _turn(cache, rid, keys, tokens, *, checkpoints):
    h = cache.allocate(rid, keys, tokens)
    for length in checkpoints:
        cache.checkpoint(h, length, kind=CheckpointKind.TURN_END)
    cache.release(h, publish=True)


class _PrefixOnlyL2:
    """Answers `prefix_present` from a set of present keys and records every question."""

    def __init__(self, present):
        self.present, self.asked = present, []

    def prefix_present(self, kind, keys):
        self.asked.append(list(keys))
        found = [k in self.present for k in keys]
        return found.index(False) if False in found else len(keys)


def _coverage_page_by_page(l2, keys, pids):
    """The walk coverage replaced: step through L1 pages one by one, ask L2 for each gap."""
    n, covered = len(keys), 0
    while covered < n:
        if pids[covered] >= 0:
            covered += 1
            continue
        gap_end = covered
        while gap_end < n and pids[gap_end] < 0:
            gap_end += 1
        found = l2.prefix_present(ObjectKind.PAGE, keys[covered:gap_end])
        covered += found
        if covered < gap_end:
            break
    return covered


@given(st.lists(st.sampled_from(["l1", "l2", "none"]), max_size=40))
def test_coverage_asks_l2_the_same_gaps_as_a_page_by_page_walk(where):
    # Coverage finds L1 gaps with whole-array steps; it must ask L2 exactly the questions, in
    # the same order, and give the answer of stepping through the pages one by one.
    keys = list(range(100, 100 + len(where)))
    pids = np.array([7 if w == "l1" else -1 for w in where], dtype=np.int64)
    in_l2 = {k for k, w in zip(keys, where, strict=True) if w == "l2"}
    fast, slow = _PrefixOnlyL2(in_l2), _PrefixOnlyL2(in_l2)
    tiering = Tiering.__new__(Tiering)
    tiering.l2 = fast
    got = Tiering.coverage(tiering, keys, pids)
    assert got == _coverage_page_by_page(slow, keys, pids.tolist())
    assert fast.asked == slow.asked
    tiering.l2 = None  # without a host tier, coverage ends at the first page not in L1
    first_gap = next((i for i, w in enumerate(where) if w != "l1"), len(where))
    assert Tiering.coverage(tiering, keys, pids) == first_gap


def _rank_over_l2(**kw):
    """(host tier, manager): one metadata-only rank over an L2 of its own; `kw` go to the
    manager."""
    l2 = LocalHostCache(capacity_bytes=1 << 20, metadata_only=True)
    return l2, make_manager(tiny_geometry(), l2=l2, metadata_only=True, **kw)


def _two_ranks_sharing_l2(tier=LocalHostCache):
    """(host tier, manager a, manager b): two metadata-only ranks over one shared L2 of class
    `tier`."""
    g = tiny_geometry()
    shared = tier(capacity_bytes=1 << 20, metadata_only=True)
    return (
        shared,
        make_manager(g, l2=shared, metadata_only=True),
        make_manager(g, l2=shared, metadata_only=True),
    )


def test_coverage_continues_through_l2_gaps_and_l1_runs():
    l2, cache = _rank_over_l2(pages=32)
    keys = KeyChain(P).append_tokens(token_stream(1, 41))
    _turn(cache, "a", keys, 41, checkpoints=[40])
    # Pages 0..9 in L1 and L2. Remove page 3 from L1 only and page 6 from both.
    pages = cache._pages
    for i in (3, 6):
        pid = pages.index.get(keys[i])
        pages.pin([pid])
        pages.unregister(pid)
        pages.unpin([pid])
    l2.remove(ObjectKind.PAGE, [keys[6]])
    m = cache.match(keys, 41)
    assert m.mla_covered_tokens == 24  # 0-2 L1, 3 from L2, 4-5 L1, 6 nowhere
    assert m.num_tokens == 0  # the only checkpoint (at 40) is not covered
    l2.remove(ObjectKind.PAGE, [keys[3]])
    assert cache.match(keys, 41).mla_covered_tokens == 12
    cache.check_integrity()


class _Unaware(LocalHostCache):
    """A host tier whose version misses a change (as another process's eviction would)."""

    def presence_version(self) -> int:
        return 0


@pytest.mark.parametrize("tier", [LocalHostCache, _Unaware])
def test_object_vanishing_between_match_and_allocate_shrinks_the_hit(tier):
    shared, a, b = _two_ranks_sharing_l2(tier)
    keys = KeyChain(P).append_tokens(token_stream(2, 33))
    _turn(a, "w", keys, 33, checkpoints=[16, 32])
    m = b.match(keys, 33)
    assert (m.num_tokens, m.l2_tokens) == (32, 32)
    shared.remove(ObjectKind.PAGE, [keys[5]])  # another rank's traffic evicts it meanwhile
    h = b.allocate("r", keys, 33, match=m)
    assert (h.num_cached_tokens, h.l2_cached_tokens) == (16, 16)
    # A tier that reports the change gets the prefix matched again; otherwise the stale plan's
    # read fails and the hit shrinks to the checkpoint the readable pages still cover.
    assert b.stats().counters.l2_fetch_failures == (1 if tier is _Unaware else 0)
    b.release(h)
    b.check_integrity()


def test_a_vanished_l2_checkpoint_shrinks_the_hit_to_pages_already_read():
    # The stale plan reads every page, then finds its checkpoint gone: the second pass keeps the
    # pages the first read returned (none is read twice) and stops at the shallower checkpoint.
    shared, a, b = _two_ranks_sharing_l2(_Unaware)
    keys = KeyChain(P).append_tokens(token_stream(2, 33))
    _turn(a, "w", keys, 33, checkpoints=[16, 32])
    m = b.match(keys, 33)
    shared.remove(ObjectKind.CHECKPOINT, [keys[7]])
    hits = shared.stats().hits
    h = b.allocate("r", keys, 33, match=m)
    assert (h.num_cached_tokens, h.l2_cached_tokens) == (16, 16)
    assert shared.stats().hits == hits + 8 + 1  # 8 pages once, the checkpoint at 16 tokens
    assert b.stats().counters.l2_fetch_failures == 1
    b.release(h)
    b.check_integrity()


def test_a_match_is_reused_only_while_neither_tier_changed():
    _, a, b = _two_ranks_sharing_l2()
    keys = KeyChain(P).append_tokens(token_stream(3, 33))
    _turn(a, "w", keys[:4], 17, checkpoints=[16])
    m = b.match(keys, 33)
    assert m.num_tokens == 16 and b._index.usable(m, keys, 33) is m
    _turn(a, "x", keys, 33, checkpoints=[32])  # another rank publishes a deeper prefix
    assert b._index.usable(m, keys, 33).num_tokens == 32


def test_a_history_published_turn_by_turn_from_two_ranks_is_stored_once():
    # Turn by turn, each publish stores only the pages after the history already in L2 (found
    # by the prefix check), whichever rank published the earlier turns.
    shared, a, b = _two_ranks_sharing_l2()
    keys = KeyChain(P).append_tokens(token_stream(5, 49))
    _turn(a, "t1", keys[:4], 17, checkpoints=[16])
    _turn(b, "t2", keys[:8], 33, checkpoints=[32])  # another rank: it finds the start in L2
    _turn(a, "t3", keys, 49, checkpoints=[48])
    assert shared.prefix_present(ObjectKind.PAGE, keys) == 12
    s = shared.stats()
    assert (s.puts, s.objects) == (12 + 3, 12 + 3)  # every page and checkpoint exactly once
    shared.check_integrity()


def test_l1_checkpoint_wins_ties_and_l2_extends_deeper():
    _, cache = _rank_over_l2()
    keys = KeyChain(P).append_tokens(token_stream(3, 33))
    _turn(cache, "w", keys, 33, checkpoints=[16, 32])
    entry = cache._ckpts.get(keys[7])
    cache._ckpts.remove(entry)  # the deeper checkpoint only in L2 now
    m = cache.match(keys, 33)
    assert (m.num_tokens, m.checkpoint_tier, m.l1_tokens) == (32, "l2", 32)
    assert cache.match(keys, 17).checkpoint_tier == "l1"


def test_a_rank_without_prefix_caching_publishes_its_turns_but_keeps_nothing():
    # A P/D decode rank: its requests arrive with their whole cache and never look a prefix up.
    g = tiny_geometry()
    shared = LocalHostCache(capacity_bytes=1 << 20, metadata_only=True)
    decode = make_manager(g, l2=shared, metadata_only=True, pages=16, prefix_caching=False)
    prefill = make_manager(g, l2=shared, metadata_only=True)
    keys = KeyChain(P).append_tokens(token_stream(6, 33))
    _turn(decode, "t1", keys, 33, checkpoints=[32])
    assert decode.match(keys, 33).num_tokens == 0  # nothing is matched on this rank
    s = decode.stats()
    assert s.pages.cached == 0 and s.pages.free == s.pages.total  # freed, not cached
    assert decode._pages.index.lookup(keys).max() == -1  # no page was ever indexed
    assert shared.prefix_present(ObjectKind.PAGE, keys) == 8  # the turn reached the host tier
    m = prefill.match(keys, 33)  # another rank resumes it from there
    assert (m.num_tokens, m.l2_tokens, m.checkpoint_tier) == (32, 32, "l2")
    # Page pressure on the rank evicts nothing and writes nothing back: its pages are free.
    h = decode.allocate("t2", keys, 33)
    assert h.num_cached_tokens == 0 and decode.stats().counters.pages_evicted == 0
    decode.release(h)
    decode.check_integrity()
    with pytest.raises(CacheConfigError):
        make_manager(g, prefix_caching="no")


def test_a_publish_larger_than_the_host_tier_counts_only_what_it_keeps():
    # Room for 6 pages (with the turn's checkpoint already in L2); the turn has 8 missing pages:
    # its write evicts the checkpoint, then its own first two pages.
    g = tiny_geometry()
    l2 = LocalHostCache(capacity_bytes=6 * g.mla_page_bytes + 40, metadata_only=True)
    cache = make_manager(g, l2=l2, metadata_only=True)
    keys = KeyChain(P).append_tokens(token_stream(7, 33))
    l2.put_many(ObjectKind.CHECKPOINT, keys[7:8], [32])
    h = cache.allocate("a", keys, 33)
    cache.checkpoint(h, 32, kind=CheckpointKind.TURN_END)
    assert cache.publish(h) == 6
    assert cache.stats().counters.objects_published == 6
    assert l2.contains(ObjectKind.PAGE, keys[:8]).tolist() == [False] * 2 + [True] * 6
    assert l2.contains(ObjectKind.CHECKPOINT, keys[7:8]).tolist() == [False]
    cache.release(h)
    cache.check_integrity()


def test_a_publish_around_pages_already_in_l2_writes_only_the_missing_ones():
    # Pages 2 and 3 are in L2 already (another path wrote them): the prefix check finds none,
    # and the missing pages are two stretches, written in one batch that is no single run.
    l2, cache = _rank_over_l2()
    keys = KeyChain(P).append_tokens(token_stream(8, 33))
    l2.put_many(ObjectKind.PAGE, keys[2:4], [2, 3])
    h = cache.allocate("a", keys, 33)
    cache.checkpoint(h, 16, kind=CheckpointKind.TURN_END)
    cache.checkpoint(h, 32, kind=CheckpointKind.TURN_END)
    assert cache.publish(h) == 6 + 2
    assert l2.contains(ObjectKind.PAGE, keys[:8]).all()
    assert l2.contains(ObjectKind.CHECKPOINT, keys[3:8:4]).tolist() == [True, True]
    assert (l2.stats().puts, len(l2._runs.run_slots[: l2._runs._used])) == (2 + 6 + 2, 0)
    assert cache.publish(h) == 0  # all there now
    cache.release(h)
    cache.check_integrity()
