"""P/D handoff between two engines in one process: the tokens of one aggregated engine."""

import threading
import time

import attrs
import pytest

from tokenspeed.runtime import Engine, RequestError, SamplingParams
from tokenspeed.runtime.pd import (
    DecodeEngine,
    Destination,
    Handoff,
    HandoffError,
    PrefillEngine,
    SocketTransport,
    make_transport,
)

from ..conftest import reference, tokens
from .common import CONFIG, GREEDY, no_request_holds_cache, run_engine, run_pd


@pytest.fixture
def pair(tiny, request):
    """A prefill engine and a decode engine over the same model, closed after the test."""
    kind = getattr(request, "param", "mooncake")
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport(kind))
    d = DecodeEngine(tiny, None, CONFIG, transport=make_transport(kind))
    yield p, d
    p.close()
    d.close()


# Lengths off and on the page grid (P = 16), one above the prefill budget (48: chunked).
LENGTHS = (37, 5, 120, 16, 64, 1, 100)
REQUESTS = [(f"r{n}", tokens(n, seed=n), GREEDY) for n in LENGTHS]


@pytest.fixture(scope="module")
def aggregated(tiny):
    """Per request of REQUESTS: (one aggregated engine's token ids, the model's own greedy
    decoding of it alone); computed once for every transport and admission order below."""
    agg = run_engine(Engine(tiny, None, CONFIG), REQUESTS)
    return {rid: (agg[rid].token_ids, reference(tiny, prompt, 12)) for rid, prompt, _ in REQUESTS}


@pytest.mark.parametrize("pair", ["mooncake", "socket"], indirect=True)
@pytest.mark.parametrize("admit_early", [False, True])
def test_pd_gives_the_tokens_of_one_aggregated_engine(aggregated, pair, admit_early):
    p, d = pair
    requests = REQUESTS
    done, dests = run_pd(p, d, requests, admit_early=admit_early)
    for rid, _, _ in requests:
        agg, alone = aggregated[rid]
        assert done[rid].token_ids == agg, rid
        assert done[rid].token_ids == alone, rid
        assert done[rid].outputs[0].finish_reason == "length"
        assert len(done[rid].token_ids) == 12  # the first token came from the prefill side
    # The state at the prompt's end is not page-aligned for most of them; a long one was
    # prefilled in chunks.
    assert any(dests[r].num_tokens % 16 for r in dests)
    assert max(dests[r].num_tokens for r in dests) > CONFIG.prefill_token_budget
    no_request_holds_cache(p)
    no_request_holds_cache(d)


def test_a_second_turn_on_the_decode_side(tiny, pair):
    """Turn 1 via P/D; turn 2 via P/D again (the decode side reuses its own pages of turn 1),
    and the same turn 2 run locally on the decode engine (it hits the pages it received)."""
    p, d = pair
    agg = Engine(tiny, None, CONFIG)
    first = tokens(70, seed=1)
    a1 = run_engine(agg, [("t1", first, GREEDY)])["t1"]
    out1 = run_pd(p, d, [("t1", first, GREEDY)])[0]["t1"]
    assert out1.token_ids == a1.token_ids
    second = first + out1.token_ids + tokens(9, seed=2)
    a2 = run_engine(agg, [("t2", second, GREEDY)])["t2"]
    done, dests = run_pd(p, d, [("t2", second, GREEDY)])
    assert done["t2"].token_ids == a2.token_ids == reference(tiny, second, 12)
    # The decode side had [0, 80) of it (turn 1's history up to its last full page): only the
    # pages past it were written.
    assert dests["t2"].extent.first_page == 80 // 16
    assert done["t2"].metrics.cached_tokens == 80
    local = run_engine(d, [("t2-local", second, GREEDY)])["t2-local"]
    assert local.token_ids == a2.token_ids
    assert local.metrics.cached_tokens >= 80
    no_request_holds_cache(p)
    no_request_holds_cache(d)


def test_every_page_can_come_from_the_prefill_side(tiny):
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport("socket"))
    d = DecodeEngine(tiny, None, CONFIG, transport=make_transport("socket"), reuse_prefix=False)
    try:
        first = tokens(40, seed=3)
        out1 = run_pd(p, d, [("t1", first, GREEDY)])[0]["t1"]
        second = first + out1.token_ids + tokens(5, seed=4)
        done, dests = run_pd(p, d, [("t2", second, GREEDY)])
        assert dests["t2"].extent.first_page == 0
        assert done["t2"].token_ids == reference(tiny, second, 12)
    finally:
        p.close()
        d.close()


def test_sampler_state_and_logprobs_travel_with_the_first_token(tiny, pair):
    p, d = pair
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, min_tokens=4),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=10, frequency_penalty=0.5),
    ]
    requests = [(f"s{i}", tokens(20 + 7 * i, seed=30 + i), sp) for i, sp in enumerate(params)]
    agg = run_engine(Engine(tiny, None, CONFIG), requests)
    done, _ = run_pd(p, d, requests)
    for rid, _, _ in requests:
        assert done[rid].token_ids == agg[rid].token_ids, rid
    got, want = done["s0"].outputs[0], agg["s0"].outputs[0]
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert [t for t, _ in got.top_logprobs[0]] == [t for t, _ in want.top_logprobs[0]]


def test_handoff_and_destination_survive_json(tiny, pair):
    import json

    p, d = pair
    prompt = tokens(21, seed=5)
    p.add_request("j", prompt, GREEDY)
    while "j" not in p.held():
        p.step()
    handoff = p.export("j")
    dest = d.admit("j", prompt, GREEDY)
    h2 = Handoff.from_dict(json.loads(json.dumps(handoff.as_dict())))
    d2 = Destination.from_dict(json.loads(json.dumps(dest.as_dict())))
    assert h2 == handoff and d2 == dest
    assert handoff.ranges(dest) == h2.ranges(d2)
    assert handoff.num_tokens == 21 and handoff.extent.live_slot > 0
    assert handoff.nbytes == sum(r.nbytes for r in handoff.ranges(dest))
    foreign = attrs.evolve(dest, layout=attrs.evolve(dest.layout, fingerprint="other"))
    with pytest.raises(HandoffError, match="layouts differ"):
        p.send("j", foreign)
    p.send("j", d2).result(timeout=30)
    deadline = time.monotonic() + 60
    while d.has_unfinished():
        assert time.monotonic() < deadline
        d.step()
    p.step()
    no_request_holds_cache(p)
    no_request_holds_cache(d)


# ---------------------------------------------------------------------------- aborts, errors
def _held(p, rid, prompt, params=GREEDY):
    p.add_request(rid, prompt, params)
    deadline = time.monotonic() + 60
    while rid not in p.held():
        assert time.monotonic() < deadline
        p.step()


def _free_pages_after_eviction(engine) -> int:
    """Free pages once every cached one is evicted: the starting count when nothing leaks."""
    stats = engine.cache.stats()
    engine.cache.evict(pages=stats.pages.total, checkpoints=stats.checkpoints.total)
    return engine.cache.stats().pages.free


def _drain(engine, rid, seconds: float = 30.0):
    """Step until `rid`'s final output comes; returns it."""
    deadline = time.monotonic() + seconds
    while True:
        assert time.monotonic() < deadline, f"no final output for {rid!r}"
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
        time.sleep(0.002)


def test_an_abort_before_the_transfer_frees_everything_on_both_sides(tiny, pair):
    p, d = pair
    start = (p.cache.stats().pages.free, d.cache.stats().pages.free)
    prompt = tokens(45, seed=6)
    # Prefill side: the held request is aborted; its cache goes.
    _held(p, "a", prompt)
    assert p.cache.stats().pages.used > 0
    assert p.abort("a")
    out = _drain(p, "a")
    assert out.outputs[0].finish_reason == "abort"
    with pytest.raises(HandoffError, match="unknown"):
        p.export("a")
    # Decode side: an admitted request is aborted before anything was written.
    assert d.admit("a", prompt, GREEDY) is not None
    assert d.cache.stats().pages.used > 0
    assert d.abort("a", writer_gone=True)
    assert _drain(d, "a").outputs[0].finish_reason == "abort"
    no_request_holds_cache(p)
    no_request_holds_cache(d)
    assert (_free_pages_after_eviction(p), _free_pages_after_eviction(d)) == start


def test_an_abort_on_the_decode_side_keeps_the_destination_until_the_write_ended(tiny, pair):
    p, d = pair
    prompt = tokens(30, seed=7)
    _held(p, "b", prompt)
    dest = d.admit("b", prompt, GREEDY)
    assert d.abort("b")  # a write may be coming: the destination stays
    assert _drain(d, "b").outputs[0].finish_reason == "abort"
    assert d.destinations_held == 1 and d.cache.stats().pages.used > 0
    # The prefill side writes anyway (the abort has not reached it): the decode side refuses
    # the request, and frees the destination now that the write has ended.
    with pytest.raises(HandoffError, match="aborted on the decode side"):
        p.send("b", dest).result(timeout=30)
    p.step()
    assert p.held() == ["b"]  # a failed send keeps it: the caller decides
    with pytest.raises(HandoffError, match="already sent"):
        p.send("b", dest)  # a destination takes one write: the decode side may reuse it
    d.step()
    assert d.destinations_held == 0
    no_request_holds_cache(d)
    p.abort("b")
    _drain(p, "b")
    no_request_holds_cache(p)


def test_a_destination_nothing_arrives_for_is_freed_after_its_deadline(tiny):
    d = DecodeEngine(
        tiny, None, CONFIG, transport=make_transport("socket"), deadline_s=0.2, grace_s=0.2
    )
    try:
        assert d.admit("c", tokens(25, seed=8), GREEDY) is not None
        out = _drain(d, "c", seconds=10)
        assert "did not arrive in time" in out.abort_reason
        no_request_holds_cache(d)
        # A fenced destination (aborted while waiting) is freed at the same time.
        assert d.admit("e", tokens(25, seed=8), GREEDY) is not None
        d.abort("e")
        _drain(d, "e")
        deadline = time.monotonic() + 10
        while d.destinations_held:
            assert time.monotonic() < deadline
            d.step()
            time.sleep(0.01)
        no_request_holds_cache(d)
    finally:
        d.close()


def test_an_expired_destination_is_never_written(tiny, pair):
    p, d = pair
    prompt = tokens(18, seed=9)
    _held(p, "x", prompt)
    dest = d.admit("x", prompt, GREEDY)
    with pytest.raises(HandoffError, match="expired"):
        p.send("x", attrs.evolve(dest, deadline=time.time() - 1))
    assert p.held() == ["x"]
    p.send("x", dest).result(timeout=30)  # the real one still works
    _drain(d, "x")
    p.step()
    no_request_holds_cache(p)


class _GatedTransport(SocketTransport):
    """A socket transport whose writes wait for `gate` (a transfer that takes its time)."""

    def __init__(self) -> None:
        super().__init__(timeout_s=30)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def write(self, peer, rid, ranges):
        self.writing.set()
        assert self.gate.wait(30)
        super().write(peer, rid, ranges)


def test_an_abort_while_the_write_runs_frees_only_after_it(tiny):
    transport = _GatedTransport()
    p = PrefillEngine(tiny, None, CONFIG, transport=transport)
    d = DecodeEngine(tiny, None, CONFIG, transport=make_transport("socket"))
    try:
        prompt = tokens(50, seed=10)
        _held(p, "w", prompt)
        future = p.send("w", d.admit("w", prompt, GREEDY))
        assert transport.writing.wait(10)
        assert p.abort("w")
        assert _drain(p, "w").outputs[0].finish_reason == "abort"  # reported at once...
        assert p.cache.stats().pages.used > 0  # ...but the pages stay while the write reads
        transport.gate.set()
        future.result(timeout=30)
        p.step()
        no_request_holds_cache(p)
        # The decode side got the request all the same (the abort did not reach it).
        out = _drain(d, "w")
        assert out.token_ids == reference(tiny, prompt, 12)
    finally:
        transport.gate.set()
        p.close()
        d.close()
        transport.close()


def test_a_decode_side_that_is_gone_fails_the_send_and_keeps_the_request(tiny, pair):
    p, d = pair
    prompt = tokens(33, seed=11)
    _held(p, "g", prompt)
    dest = d.admit("g", prompt, GREEDY)
    d.transport.close()  # the decode side goes away
    t0 = time.monotonic()
    with pytest.raises(HandoffError, match="gone|refused|failed"):
        p.send("g", dest).result(timeout=60)
    assert time.monotonic() - t0 < 60
    p.step()
    assert p.held() == ["g"]
    assert p.abort("g")
    _drain(p, "g")
    no_request_holds_cache(p)


def test_requests_that_end_on_the_prefill_side_have_nothing_to_hand_off(tiny, pair):
    p, d = pair
    prompt = tokens(12, seed=12)
    one = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(RequestError, match="first token"):
        d.admit("o", prompt, one)
    p.add_request("o", prompt, one)
    out = _drain(p, "o")
    assert out.outputs[0].finish_reason == "length" and len(out.token_ids) == 1
    assert not p.held()
    with pytest.raises(HandoffError, match="unknown"):
        p.export("o")
    with pytest.raises(RequestError, match="str or an int"):
        d.admit(("tuple", 1), prompt, GREEDY)
    no_request_holds_cache(p)
    no_request_holds_cache(d)
