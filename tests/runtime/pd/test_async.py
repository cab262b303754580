"""The P/D engines behind `AsyncEngine`, as the HTTP roles drive them: `submit` admits on the
decode side, `generate` prefills on the prefill side, `run_exclusive` sends; the loop does not
step while only transfers are pending; a kept destination is freed once the writer is known to
be gone."""

import asyncio
import contextlib

import pytest

from tokenspeed.runtime import Engine
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine, make_transport

from ..conftest import tokens
from .common import CONFIG, GREEDY, no_request_holds_cache, run_engine


@pytest.fixture
def pair(tiny):
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport("socket"))
    d = DecodeEngine(tiny, None, CONFIG, transport=make_transport("socket"))
    yield p, d
    p.close()
    d.close()


def count_steps(engine) -> list[int]:
    """Count the engine's steps (a list holding the count)."""
    count = [0]
    step = engine.step

    def counted():
        count[0] += 1
        return step()

    engine.step = counted
    return count


def run(coro, timeout_s: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_a_request_through_both_async_engines_gives_the_reference_tokens(tiny, pair):
    p, d = pair
    ap, ad = AsyncEngine(p), AsyncEngine(d)
    prompt = tokens(70, seed=3)  # chunked: the prefill budget is 48
    p_steps, d_steps = count_steps(p), count_steps(d)

    async def main():
        items = ad.submit("r", lambda e: e.admit("r", prompt, GREEDY))
        async with contextlib.aclosing(items):
            destination = await anext(items)
            assert destination is not None and d.waiting() == ["r"]
            # Only a transfer is awaited on the decode side: its loop looks, but never steps.
            await asyncio.sleep(0.3)
            assert d_steps[0] == 0
            async with contextlib.aclosing(ap.generate("r", prompt, GREEDY)) as outs:
                first = await anext(outs)
                assert not first.finished and p.held() == ["r"]
                held_at = p_steps[0]
                await asyncio.sleep(0.3)  # held: the prefill side's loop does not step either
                assert p_steps[0] == held_at
                future = await ap.run_exclusive(lambda e: e.send("r", destination))
                await asyncio.wrap_future(future)
            outs = [out async for out in items]
        # Cumulative: it starts with the first token, from the prefill side.
        assert outs[0].token_ids[:1] == first.token_ids
        await ap.wait_idle()
        return outs[-1]

    last = run(main())
    agg = run_engine(Engine(tiny, None, CONFIG), [("r", prompt, GREEDY)])["r"]
    assert last.finished and last.token_ids == agg.token_ids
    assert not p.held() and not p.has_unfinished()  # freed by the loop's next look
    no_request_holds_cache(p)
    no_request_holds_cache(d)


def test_submit_yields_none_alone_when_nothing_was_put_in(tiny, pair):
    _, d = pair
    ad = AsyncEngine(d)

    async def main():
        return [item async for item in ad.submit("x", lambda e: None)]

    assert run(main()) == [None]
    assert not d.has_unfinished()


def test_a_kept_destination_is_freed_once_the_writer_is_known_gone(tiny, pair):
    _, d = pair
    assert d.admit("k", tokens(30, seed=4), GREEDY) is not None
    assert d.abort("k")  # a write may be coming: kept
    d.step()
    assert d.destinations_held == 1
    assert not d.abort("k", writer_gone=True)  # it had ended already; its pages go now
    assert d.destinations_held == 0
    no_request_holds_cache(d)
