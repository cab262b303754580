"""The schedulers over the real `CacheManager` (metadata-only) through `CacheManagerPort`."""

import pytest

from tokenspeed.cache import (
    CacheConfig,
    CacheGeometry,
    CacheManager,
    CheckpointPolicy,
    KeyChain,
    LocalHostCache,
)
from tokenspeed.cache.errors import IntegrityError
from tokenspeed.sched import Request, RequestState, SchedulerConfig
from tokenspeed.sched.cache_adapter import CacheManagerPort
from tokenspeed.sched.cache_port import AdmissionError
from tokenspeed.sched.decode import DecodeScheduler
from tokenspeed.sched.prefill import PrefillScheduler

P = 16
GEO = CacheGeometry(
    page_size=P,
    num_mla_layers=1,
    mla_row_width=8,
    num_kda_layers=1,
    kda_conv_shape=(4, 3),
    kda_recurrent_shape=(1, 4, 4),
)
CFG = SchedulerConfig(
    page_size=P, prefill_token_budget=256, checkpoint_interval_pages=4, decode_batch_sizes=(1, 2, 4)
)


def _cache(pages=200, l2=None):
    budget = CacheConfig.budget_for(GEO, pages=pages, live_requests=8, checkpoints=32)
    return CacheManager(
        GEO,
        CacheConfig(
            device_budget_bytes=budget,
            max_live_requests=8,
            num_checkpoint_slots=32,
            metadata_only=True,
            checkpoint_policy=CheckpointPolicy(interval_pages=4),
        ),
        l2=l2,
    )


def _request(rid, chain: KeyChain, new_blocks, new_tokens, out=4):
    chain.append_blocks(new_blocks, new_tokens, 64)
    prompt = chain.num_tokens
    chain.append_blocks([-rid - 1000], out, 64)
    return Request(rid, prompt, out, keys=chain.keys[:])


def test_prefix_is_reused_by_the_next_turn_and_by_another_rank_through_l2():
    l2 = LocalHostCache(capacity_bytes=10_000 * GEO.mla_page_bytes, metadata_only=True)
    a, b = _cache(l2=l2), _cache(l2=l2)
    port_a, port_b = CacheManagerPort(a), CacheManagerPort(b)
    sched_a = PrefillScheduler(CFG, port_a, disaggregated=False)
    chain = KeyChain(P)
    first = _request(1, chain, [1, 2, 3, 4], 250)
    sched_a.add(first)
    while first.state is RequestState.PREFILLING or first.state is RequestState.WAITING:
        sched_a.complete(sched_a.schedule())
    assert first.state is RequestState.DECODING
    port_a.release(first)
    # Interval checkpoints at 64, 128, 192 and the turn end at 240: the same prompt on the
    # same rank reuses 240 tokens (all but the last partial page).
    again = Request(2, first.prompt_len, 4, keys=first.keys)
    assert port_a.lookup(again, again.prompt_len - 1) == 240
    # Another rank sharing the host tier finds the published prefix there.
    assert port_b.lookup(again, again.prompt_len - 1) == 240
    hit = port_b.acquire(again, again.prompt_len - 1)
    assert hit == 240 and port_b.handle(2).l2_cached_tokens == 240
    port_b.release(again)
    for c in (a, b):
        c.check_integrity()
        assert c.stats().requests == 0


def test_pd_pair_over_real_caches_releases_everything():
    pre_cache, dec_cache = _cache(), _cache(pages=60)
    pre = PrefillScheduler(CFG, CacheManagerPort(pre_cache), disaggregated=True)
    dec = DecodeScheduler(CFG, CacheManagerPort(dec_cache), disaggregated=True)
    reqs = [_request(i, KeyChain(P), [10 * i + j for j in range(3)], 150, out=40) for i in range(4)]
    for r in reqs:
        pre.add(r)
        dec.add(r)
    finished, steps = [], 0
    while len(finished) < len(reqs) and steps < 10_000:
        steps += 1
        batch = pre.schedule()
        if batch is not None:
            pre.complete(batch)
        dec.admit_pending()
        for r in list(pre.pinned.values()):
            if dec.is_admitted(r.rid):
                dec.start(r)
                pre.release(r)
        db = dec.schedule(max_steps=8)
        if db is not None:
            finished += dec.complete(db, db.steps)
        for r in dec.preempted:  # requeue preempted requests (a router would)
            pre.add(r)
            dec.add(r)
        dec.preempted.clear()
    assert sorted(r.rid for r in finished) == [0, 1, 2, 3]
    assert all(r.num_output == 40 for r in finished)
    for c in (pre_cache, dec_cache):
        c.check_integrity()
        assert c.stats().requests == 0


def test_capacity_errors_become_not_now_answers():
    cache = _cache(pages=10)
    port = CacheManagerPort(cache)
    req = _request(1, KeyChain(P), [1, 2, 3], 150)
    assert port.acquire(req, req.prompt_len - 1) == 0
    assert port.reserve(req, 160)  # 10 pages: the whole pool
    assert not port.reserve(req, 176)  # an 11th page does not exist
    assert port.covered(req) == 160
    other = _request(2, KeyChain(P), [9], 20)
    assert port.acquire(other, other.prompt_len - 1) is None  # not even its first page
    assert not port.holds(2)
    port.release(req)
    assert port.acquire(other, other.prompt_len - 1) == 0
    port.release(other)
    cache.check_integrity()


def test_save_state_receives_slots_for_checkpoints_inside_a_chunk():
    cache = _cache()
    sched = PrefillScheduler(CFG, CacheManagerPort(cache), disaggregated=False)
    req = _request(1, KeyChain(P), [1, 2, 3], 150)
    sched.add(req)
    batch = sched.schedule()
    chunk = batch.chunks[0]
    assert (chunk.start, chunk.end, chunk.checkpoints) == (0, 150, (64, 128, 144))
    saved = []
    sched.complete(batch, save_state=lambda r, pos, slot: saved.append((r.rid, pos)))
    # None of them is the chunk end (150): the runner writes all three from kernel states.
    assert saved == [(1, 64), (1, 128), (1, 144)]


def _prefill_and_publish(port, req, checkpoints):
    assert port.acquire(req, req.prompt_len - 1) is not None
    assert port.reserve(req, req.prompt_len)
    for length in checkpoints:
        port.checkpoint(req, length, turn_end=length == checkpoints[-1], from_live=True)
    port.publish(req, checkpoints[-1])
    port.release(req)


def test_acquire_right_after_lookup_reuses_the_match_and_answers_the_same():
    l2 = LocalHostCache(capacity_bytes=10_000 * GEO.mla_page_bytes, metadata_only=True)
    a, b = _cache(l2=l2), _cache(l2=l2)
    port_a, port_b = CacheManagerPort(a), CacheManagerPort(b)
    chain = KeyChain(P)
    first = _request(1, chain, [1, 2, 3, 4], 250)
    _prefill_and_publish(port_a, first, [64, 128, 192, 240])
    nxt = _request(2, chain, [5, 6], 100)
    limit = nxt.prompt_len - 1
    walks = []
    index = b._index  # the prefix index walks the keys (the manager's match delegates to it)
    match = index.match
    index.match = lambda *args: walks.append(args) or match(*args)  # count the prefix walks
    assert port_b.lookup(nxt, limit) == 240
    assert port_b.acquire(nxt, limit) == 240 and len(walks) == 1  # reused, not walked again
    port_b.release(nxt)
    assert port_b.lookup(nxt, limit) == 240
    # Another rank publishes the next turn's prefix meanwhile: the plan is stale, and acquire
    # matches again, finding the deeper prefix.
    _prefill_and_publish(port_a, Request(3, nxt.prompt_len, 4, keys=nxt.keys), [352])
    assert port_b.acquire(nxt, limit) == 352 and len(walks) == 3
    port_b.release(nxt)
    for c in (a, b):
        c.check_integrity()


def test_sync_keys_hands_the_cache_keys_of_pages_completed_after_the_reservation():
    """A request whose keys grew without a new reservation (tokens sampled between two) can be
    checkpointed at the new page only once `sync_keys` passed the keys on."""
    cache = _cache()
    port = CacheManagerPort(cache)
    chain = KeyChain(P)
    chain.append_tokens(list(range(20)))  # one full page
    req = Request(1, 20, 40, keys=chain.keys)
    assert port.acquire(req, 0) == 0 and port.reserve(req, 60)
    handle = port.handle(1)
    assert handle.num_keys == 1
    chain.append_tokens(list(range(20, 40)))  # two full pages now, no reservation since
    assert handle.num_keys == 1
    port.sync_keys(req)
    assert handle.num_keys == 2 and handle.num_tokens == 60  # nothing else changed
    port.sync_keys(req)  # nothing new: a no-op
    assert handle.num_keys == 2
    cache.check_integrity()


@pytest.mark.parametrize("error", [RuntimeError("CUDA error"), MemoryError()])
def test_a_device_failure_in_acquire_is_an_admission_error_holding_nothing(error):
    cache = _cache()
    port = CacheManagerPort(cache)
    chain = KeyChain(P)
    req = _request(1, chain, [1], 40)
    free = cache.available_pages

    def failing(*args, **kwargs):
        raise error

    cache.allocate = failing
    with pytest.raises(AdmissionError, match=type(error).__name__) as info:
        port.acquire(req, 0)
    assert info.value.__cause__ is error
    assert not port.holds(1) and cache.available_pages == free


def test_a_cache_bug_in_acquire_is_not_an_admission_error():
    cache = _cache()
    port = CacheManagerPort(cache)

    def failing(*args, **kwargs):
        raise IntegrityError("bookkeeping")

    cache.allocate = failing
    with pytest.raises(IntegrityError):
        port.acquire(_request(1, KeyChain(P), [1], 20), 0)
