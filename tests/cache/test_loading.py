"""CacheManager loads from L2: layer-by-layer events, loads shared between requests, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenspeed.cache import KeyChain, LocalHostCache, TransferError

from .helpers import (
    live_state_matches,
    make_manager,
    pages_match,
    prefix_seed,
    token_stream,
    write_live_state,
    write_pages,
)

P = 4


def _published_then_evicted(cache, tokens):
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("writer", keys, len(tokens))
    write_pages(cache, h, 0, len(tokens) // P)
    write_live_state(cache, h, prefix_seed(tokens[: len(tokens) // P * P]))
    cache.checkpoint(h, len(tokens) // P * P)
    cache.release(h, publish=True)
    cache.evict(pages=1000, checkpoints=1000)
    return keys


def _gate_mla_layer(cache, layer):
    """Make the copy of one MLA layer wait for a gate, as a slow transfer would."""
    gate = threading.Event()
    copy = cache.storage._copy_page_layer

    def gated(index, idx, src):
        if index == layer:
            assert gate.wait(30)
        copy(index, idx, src)

    cache.storage._copy_page_layer = gated
    return gate


def test_forward_may_start_before_the_whole_prefix_arrived():
    cache = make_manager(l2=LocalHostCache(capacity_bytes=1 << 20), async_loads=True)
    tokens = token_stream(1, 33)
    keys = _published_then_evicted(cache, tokens)
    gate = _gate_mla_layer(cache, 1)
    h = cache.allocate("r", keys, 33)
    for layer in range(cache.geometry.num_kda_layers):
        h.load.wait_kda(layer)  # state is in place
    h.load.wait_mla(0)  # MLA layer 0 is in place: the forward can run up to layer 1
    assert not h.load.done()
    assert not any(e.query() for e in h.load.mla_events(1))
    gate.set()
    h.load.wait_mla(1)
    assert h.load.done()
    assert pages_match(cache, h, 0, 8)
    assert live_state_matches(cache, h, prefix_seed(tokens[:32]))
    cache.release(h)
    cache.check_integrity()
    cache.close()


def test_second_request_waits_on_the_first_requests_load():
    cache = make_manager(l2=LocalHostCache(capacity_bytes=1 << 20), async_loads=True)
    tokens = token_stream(2, 33)
    keys = _published_then_evicted(cache, tokens)
    gate = _gate_mla_layer(cache, 1)
    first = cache.allocate("first", keys, 33)  # loads the prefix from L2
    second = cache.allocate("second", keys, 33)  # finds it in L1, still arriving
    assert second.l2_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.page_ids[:8].tolist() == first.page_ids[:8].tolist()
    assert not second.load.done()  # borrowed the first request's layer events
    gate.set()
    second.load.synchronize()
    assert pages_match(cache, second, 0, 8)
    assert live_state_matches(cache, second, prefix_seed(tokens[:32]))
    cache.release(first)
    cache.release(second)
    cache.check_integrity()
    cache.close()


def test_failed_copy_raises_on_wait_and_its_pages_are_never_matched():
    cache = make_manager(l2=LocalHostCache(capacity_bytes=1 << 20), async_loads=True)
    tokens = token_stream(3, 33)
    keys = _published_then_evicted(cache, tokens)
    copy = cache.storage._copy_page_layer

    def broken(index, idx, src):
        raise RuntimeError("copy engine fault")

    cache.storage._copy_page_layer = broken
    h = cache.allocate("r", keys, 33)
    with pytest.raises(TransferError):
        h.load.wait_mla(0)
    cache.release(h)  # does not raise; drops the untrusted pages from the index
    cache.check_integrity()
    assert cache.match(keys, 33).l1_tokens == 0
    cache.storage._copy_page_layer = copy
    h = cache.allocate("again", keys, 33)  # reloaded from L2, correctly this time
    h.load.synchronize()
    assert h.num_cached_tokens == 32 and pages_match(cache, h, 0, 8)
    cache.release(h)
    cache.close()


@pytest.mark.parametrize(
    "device, async_loads",
    [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("fault", ["page_load_steps", "state_load_steps", "zero_live"])
def test_a_load_that_cannot_start_gives_everything_back(device, async_loads, fault):
    """Starting the L2 load raises (a device error while setting up the copies, or while
    zeroing the live state of a miss): allocate raises it, and every page, slot and checkpoint
    it took is back; nothing it registered stays matchable; a later request loads correctly."""
    cache = make_manager(
        l2=LocalHostCache(capacity_bytes=1 << 20), async_loads=async_loads, device=device
    )
    tokens = token_stream(4, 33)
    keys = _published_then_evicted(cache, tokens)
    other = KeyChain(P).append_tokens(token_stream(5, 9))  # a miss: its live state is zeroed
    before = cache.stats()
    real = getattr(cache.storage, fault)

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    setattr(cache.storage, fault, broken)
    with pytest.raises(RuntimeError, match="device fault"):
        if fault == "zero_live":
            cache.allocate("r", other, 9)
        else:
            cache.allocate("r", keys, 33)
    after = cache.stats()
    assert cache.get("r") is None and after.requests == 0
    assert after.live_slots == before.live_slots and after.checkpoints == before.checkpoints
    assert cache.available_pages == before.pages.total - before.pages.used  # all free again
    assert cache.match(keys, 33).l1_tokens == 0  # the pages that never arrived are not indexed
    cache.check_integrity()
    setattr(cache.storage, fault, real)
    h = cache.allocate("again", keys, 33)
    h.load.synchronize()
    assert h.num_cached_tokens == 32 and pages_match(cache, h, 0, 8)
    assert live_state_matches(cache, h, prefix_seed(tokens[:32]))
    cache.release(h)
    cache.check_integrity()
    cache.close()


@pytest.mark.gpu
def test_cuda_load_runs_on_a_copy_stream_with_per_layer_events():
    l2 = LocalHostCache(capacity_bytes=1 << 20)  # pinned payloads on a CUDA machine
    cache = make_manager(l2=l2, async_loads=True, device="cuda")
    tokens = token_stream(4, 33)
    keys = _published_then_evicted(cache, tokens)
    h = cache.allocate("r", keys, 33)
    assert h.l2_cached_tokens == 32
    for layer in range(cache.geometry.num_mla_layers):
        h.load.wait_mla(layer)  # the current stream waits on the copy stream's event
    for layer in range(cache.geometry.num_kda_layers):
        h.load.wait_kda(layer)
    torch.cuda.current_stream().synchronize()
    assert pages_match(cache, h, 0, 8)
    assert live_state_matches(cache, h, prefix_seed(tokens[:32]))
    cache.release(h)
    h = cache.allocate("r2", keys, 33)  # the promoted checkpoint now restores from L1
    assert live_state_matches(cache, h, prefix_seed(tokens[:32]))
    cache.release(h)
    cache.check_integrity()
    cache.close()


def test_release_with_publish_after_a_failed_load_releases_and_publishes_nothing():
    """A preempted request whose load failed is released with publish=True: the untrusted
    pages must not reach L2, and the release itself must complete (the handle was left live
    before, holding its pages and slot)."""
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    cache = make_manager(l2=l2, async_loads=True)
    tokens = token_stream(6, 33)
    keys = _published_then_evicted(cache, tokens)
    puts = l2.stats().puts

    def broken(index, idx, src):
        raise RuntimeError("copy engine fault")

    cache.storage._copy_page_layer = broken
    h = cache.allocate("r", keys, 33)
    cache.release(h, publish=True)  # does not raise
    assert h.released
    assert l2.stats().puts == puts
    assert cache.get("r") is None
    cache.check_integrity()
    assert cache.match(keys, 33).l1_tokens == 0
    cache.close()
