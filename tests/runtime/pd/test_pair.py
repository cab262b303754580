"""`PDPair`: a prefill and a decode engine driven as one engine. The caller's ids (any
hashable) come back; greedy tokens are one aggregated engine's; an AgentX replay runs through
it as through one engine, moving bytes the transfer statistics count."""

import pytest

from tokenspeed.runtime import Engine, SamplingParams
from tokenspeed.runtime.agentx_replay import agentx_sessions, replay
from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine, make_transport
from tokenspeed.runtime.pd.pair import PDPair

from ..conftest import tokens
from .common import CONFIG, no_request_holds_cache, run_engine


@pytest.fixture
def pd(tiny):
    pair = PDPair(
        PrefillEngine(tiny, None, CONFIG, transport=make_transport("socket")),
        DecodeEngine(tiny, None, CONFIG, transport=make_transport("socket")),
    )
    yield pair
    pair.close()


def test_greedy_tokens_under_the_callers_ids(tiny, pd):
    lengths = (37, 5, 120, 16, 64)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 1, 5)]
    requests = [(("session", i), tokens(n, seed=i), params[i % 3]) for i, n in enumerate(lengths)]
    want = run_engine(Engine(tiny, None, CONFIG), requests)
    got = run_engine(pd, requests)
    assert set(got) == set(want)
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids, rid
    # Requests of max_tokens 1 end on the prefill side: no transfer.
    moved = sum(1 for _, _, p in requests if p.max_tokens > 1)
    stats = pd.prefill.transfer_stats
    assert stats.writes == moved and stats.bytes > 0 and stats.bandwidth > 0
    no_request_holds_cache(pd.prefill)
    no_request_holds_cache(pd.decode)
    m = pd.metrics
    assert len(m.ttfts) == len(requests)
    assert len(m.request_itls) == moved  # one mean ITL per request of more than one token


def test_agentx_replay_through_pd_matches_one_engine(tiny, pd):
    sessions, block = agentx_sessions(3, seed=5, scale=1 / 256, max_turns=2)
    one = replay(Engine(tiny, None, CONFIG), sessions, 2, block)
    through = replay(pd, sessions, 2, block)
    assert through["requests"] == one["requests"] > 0
    assert through["generated_tokens"] == one["generated_tokens"]
    # The prefill side never holds what the decode side generated: a later turn hits its
    # earlier prompt there, not the reply (one engine hits both; a shared L2 would too).
    assert 0 < through["prefix_hit_rate"] < one["prefix_hit_rate"]
    assert through["p90_interactivity_tok_s"] is not None
    assert pd.prefill.transfer_stats.writes > 0
    pd.check_integrity()


def test_a_reused_id_and_mismatched_pages_are_refused(tiny):
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport("socket"))
    other = CONFIG.evolve(page_size=32)
    d = DecodeEngine(tiny, None, other, transport=make_transport("socket"))
    try:
        with pytest.raises(ValueError, match="page sizes differ"):
            PDPair(p, d)
    finally:
        p.close()
        d.close()
