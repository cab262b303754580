"""What the P/D tests share: the engine options, a stand-in for the gateway, and references."""

from __future__ import annotations

import time

from tokenspeed.runtime import Engine, EngineConfig, SamplingParams

# As tests/runtime/test_multirank.py's OPTIONS, with a prefill budget that chunks long prompts.
OPTIONS = {
    "device": "cpu",
    "max_model_len": 512,
    "max_num_seqs": 4,
    "page_size": 16,
    "prefill_token_budget": 48,
    "checkpoint_interval_pages": 2,
}
CONFIG = EngineConfig(**OPTIONS)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run_engine(engine: Engine, requests, *, timeout_s: float = 120.0) -> dict:
    """Add (rid, prompt, params) requests to one engine and step it until they finish."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return done


def run_pd(prefill, decode, requests, *, timeout_s: float = 120.0, admit_early: bool = False):
    """What a gateway does: each request is prefilled on `prefill` and admitted on `decode`
    (once held on the prefill side; with admit_early, as soon as it is added, retried while
    the decode side has no room), sent, then decoded. Steps both engines until every request
    has finished on one side; checks both caches every step. Returns (outputs, destinations)."""
    args = {rid: (prompt, params) for rid, prompt, params in requests}
    for rid, prompt, params in requests:
        prefill.add_request(rid, prompt, params)
    dests, sends, done = {}, {}, {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(requests):
        assert time.monotonic() < deadline, f"P/D run did not finish in time: {sorted(done)}"
        for out in prefill.step():
            if out.finished:  # ended with its first token, or aborted there
                done[out.request_id] = out
        wanted = args if admit_early else prefill.held()
        for rid in wanted:
            if rid not in done and dests.get(rid) is None:
                dests[rid] = decode.admit(rid, *args[rid])
        for rid in prefill.held():
            if dests.get(rid) is not None and rid not in sends:
                sends[rid] = prefill.send(rid, dests[rid])
        for out in decode.step():
            if out.finished:
                done[out.request_id] = out
        prefill.check_integrity()
        decode.check_integrity()
        if not prefill.scheduler.has_work and not decode.scheduler.has_work:
            time.sleep(0.002)  # only transfers in flight
    for future in sends.values():
        future.result(timeout=30)
    prefill.step()  # settles the last sends: their requests are freed on the prefill side
    assert not prefill.held() and prefill.transfers_in_flight == 0
    return done, dests


def no_request_holds_cache(engine) -> None:
    """Every page and live slot is back: none used, all free or cached (evictable)."""
    engine.check_integrity()
    stats = engine.cache.stats()
    assert stats.requests == 0
    assert stats.pages.used == 0
    assert stats.live_slots.used == 0
    assert engine.cache.available_pages == stats.pages.total
