"""`AsyncEngine` as a server uses it: request ids reused, consumers that stall or linger, more
than one event loop, shutdown, and a loop that fails."""

import asyncio
import contextlib
import gc
import time
import traceback

import pytest

from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.async_engine import AsyncEngine, AsyncEngineClosed

from .conftest import reference, tokens

BOTH = pytest.mark.parametrize("step_thread", [False, True], ids=["inline", "thread"])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(model) -> Engine:
    """Eager steps (no graphs to capture on a GPU); `idle_pages` for `assert_idle`."""
    engine = Engine(
        model,
        None,
        EngineConfig(max_num_seqs=4, max_model_len=256, page_size=16, enable_cuda_graph=False),
    )
    engine.idle_pages = engine.cache.available_pages
    return engine


def slow_steps(engine: Engine, seconds: float) -> list[int]:
    """Make every step take `seconds` longer (the GIL free meanwhile); returns a flag that is
    [1] while a step runs."""
    real, running = engine.step, [0]

    def step():
        running[0] = 1
        try:
            time.sleep(seconds)
            return real()
        finally:
            running[0] = 0

    engine.step = step
    return running


def assert_idle(engine: Engine) -> None:
    """Nothing runs, and every page is free or cached (evictable) again, as in a new engine."""
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.cache.available_pages == engine.idle_pages


@BOTH
def test_a_retry_under_the_same_id_is_not_touched_by_the_consumer_it_replaces(tiny, step_thread):
    """A's request has ended but its handler is still busy with the final output when B reuses
    the id (which the engine allows). Before, A's exit forgot B's queue and aborted B's request,
    and B waited forever."""
    prompt = tokens(11, seed=3)

    async def main():
        server = AsyncEngine(make_engine(tiny), step_thread=step_thread)
        handed_over, retry_running = asyncio.Event(), asyncio.Event()

        async def first():
            async for out in server.generate("x", prompt, greedy(2)):
                if out.finished:
                    handed_over.set()
                    await retry_running.wait()  # still sending the last chunk...
            return out  # ... and only now does the iterator close

        async def retry():
            await handed_over.wait()
            outs = []
            async for out in server.generate("x", prompt, greedy(5)):
                outs.append(out)
                retry_running.set()
            return outs[-1]

        outs = await asyncio.wait_for(asyncio.gather(first(), retry()), timeout=10)
        await server.wait_idle()
        return outs, server.engine

    (a, b), engine = asyncio.run(main())
    want = reference(tiny, prompt, 5)
    assert a.token_ids == want[:2]
    assert b.outputs[0].finish_reason == "length" and b.token_ids == want
    assert_idle(engine)


def test_a_consumer_leaving_during_the_step_that_ends_its_request_spares_a_retry(tiny):
    """Threaded: A walks away while the step that finishes its request runs, so its abort waits
    for the step's end; B takes the id first. Before, the deferred abort then hit B."""
    prompt = tokens(9, seed=5)

    async def main():
        engine = make_engine(tiny)
        running = slow_steps(engine, 0.1)
        server = AsyncEngine(engine, step_thread=True)
        stream = server.generate("x", prompt, greedy(2))
        await anext(stream)  # the prefill's token; the step that ends "x" starts now
        while not running[0]:
            await asyncio.sleep(0.001)
        await stream.aclose()  # gone mid-step: its abort is deferred to the step's end
        retry = server.generate("x", prompt, greedy(4))  # waits for that step to end
        outs = [out async for out in retry]
        await server.wait_idle()
        return outs[-1], engine

    out, engine = asyncio.run(main())
    assert out.outputs[0].finish_reason == "length"
    assert out.token_ids == reference(tiny, prompt, 4)
    assert_idle(engine)


@BOTH
def test_a_stalled_consumer_gets_the_newest_output_not_a_backlog(tiny, step_thread):
    """Outputs are cumulative: one that stops reading while its request generates 40 tokens then
    finds the final output alone, not 39 stale ones, each a copy of every token so far."""
    prompt = tokens(13, seed=8)

    async def main():
        server = AsyncEngine(make_engine(tiny), step_thread=step_thread)
        seen = []
        async with contextlib.aclosing(server.generate("s", prompt, greedy(40))) as stream:
            seen.append(await anext(stream))
            await server.wait_idle()  # stalled until the request has ended
            seen.extend([out async for out in stream])
        return seen, server.engine

    seen, engine = asyncio.run(main())
    assert len(seen) == 2 and len(seen[0].token_ids) == 1
    assert seen[1].finished and seen[1].token_ids == reference(tiny, prompt, 40)
    assert_idle(engine)


@BOTH
def test_one_engine_serves_one_event_loop_after_another(tiny, step_thread):
    """Two `asyncio.run`s in a row (tests, notebooks). The first leaves behind a stream it never
    finished reading. Before, with the worker thread, the lock stayed bound to the first loop
    (the second failed) and the abandoned stream's stepping task kept it held (the second hung).
    Now the second loop takes over: the abandoned request is aborted, the new ones run."""
    prompts = [tokens(10, seed=s) for s in (20, 21, 22)]
    server = AsyncEngine(make_engine(tiny), step_thread=step_thread)
    kept = []

    async def first():
        async def read(rid, prompt):
            return [out async for out in server.generate(rid, prompt, greedy(3))][-1]

        outs = await asyncio.gather(read("a", prompts[0]), read("b", prompts[1]))
        stream = server.generate("c", prompts[2], greedy(50))
        await anext(stream)
        kept.append(stream)  # never read again, never closed
        return outs

    async def second():
        async def read(rid, prompt):
            return [out async for out in server.generate(rid, prompt, greedy(4))][-1]

        outs = await asyncio.wait_for(
            asyncio.gather(read("a", prompts[0]), read("d", prompts[2])), timeout=30
        )
        await server.wait_idle()
        return outs

    a1, b1 = asyncio.run(first())
    a2, d2 = asyncio.run(second())
    assert a1.token_ids == reference(tiny, prompts[0], 3)
    assert b1.token_ids == reference(tiny, prompts[1], 3)
    assert a2.token_ids == reference(tiny, prompts[0], 4)
    assert d2.token_ids == reference(tiny, prompts[2], 4)
    assert_idle(server.engine)  # "c" went with the first loop
    del kept[:]
    gc.collect()  # closing the old stream now is harmless
    assert_idle(server.engine)


@BOTH
def test_close_aborts_what_runs_and_refuses_more(tiny, step_thread):
    prompt = tokens(12, seed=40)

    async def main():
        server = AsyncEngine(make_engine(tiny), step_thread=step_thread)

        async def consume():
            return [out async for out in server.generate("a", prompt, greedy(200))][-1]

        running = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        await server.close()
        last = await running
        with pytest.raises(AsyncEngineClosed):
            await anext(server.generate("b", prompt, greedy(2)))
        return last, server

    last, server = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert last.abort_reason == "the AsyncEngine was closed"
    assert len(last.token_ids) < 200
    if step_thread:
        with pytest.raises(RuntimeError, match="shutdown"):  # the worker thread is gone
            server._worker.submit(int)
    assert_idle(server.engine)


@BOTH
def test_a_failing_loop_reaches_every_consumer_once_and_is_not_left_unretrieved(tiny, step_thread):
    """A failure outside a step's batch (here the scheduler's) ends every stream with that
    exception, each raised from where the loop caught it (not piling up the other consumers'
    frames), and the stepping task does not end with an exception nobody retrieves."""

    async def main():
        engine = make_engine(tiny)
        server = AsyncEngine(engine, step_thread=step_thread)
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))

        def broken(**kwargs):
            raise LookupError("scheduler bug")

        engine.scheduler.schedule = broken

        async def consume(rid):
            try:
                async for _ in server.generate(rid, tokens(6, seed=len(rid)), greedy(3)):
                    pass
            except LookupError as exc:
                return exc.__traceback__
            raise AssertionError("no error reached the consumer")

        tracebacks = await asyncio.wait_for(
            asyncio.gather(*(consume(r) for r in ("a", "bb", "ccc"))), timeout=30
        )
        # A later request starts a new stepping task (it fails the same way), and the failed
        # one is dropped: had it ended with its exception, dropping it would report that.
        tracebacks.append(await asyncio.wait_for(consume("dddd"), timeout=30))
        await server.wait_idle()
        gc.collect()
        await asyncio.sleep(0)
        return tracebacks, unretrieved

    tracebacks, unretrieved = asyncio.run(main())
    depths = {len(traceback.extract_tb(tb)) for tb in tracebacks}
    assert len(depths) == 1, depths  # the same frames for each consumer
    assert not unretrieved


@BOTH
def test_a_loop_failure_aborts_the_requests_of_the_consumers_it_reached(tiny, step_thread):
    """A failure outside a step's batch (the scheduler's, once) ends every stream with the
    exception. Before, the requests behind those streams kept running in the engine with nobody
    to read them: holding cache, their ids taken, stepped only when some later request woke the
    loop. Now a consumer that raised the failure is gone like any other, and its request is
    aborted; the ids are free again and the engine goes back to idle."""
    prompts = {rid: tokens(20, seed=60 + i) for i, rid in enumerate(("a", "b"))}

    async def main():
        engine = make_engine(tiny)
        server = AsyncEngine(engine, step_thread=step_thread)
        real, calls = engine.scheduler.schedule, []

        def flaky(**kwargs):
            calls.append(1)
            if len(calls) == 3:  # both requests have their first token by now
                raise LookupError("scheduler hiccup")
            return real(**kwargs)

        engine.scheduler.schedule = flaky

        async def consume(rid):
            with pytest.raises(LookupError, match="hiccup"):
                async for _ in server.generate(rid, prompts[rid], greedy(40)):
                    pass

        await asyncio.wait_for(asyncio.gather(consume("a"), consume("b")), timeout=30)
        await asyncio.wait_for(server.wait_idle(), timeout=30)
        assert_idle(engine)
        retry = [out async for out in server.generate("a", prompts["a"], greedy(3))][-1]
        await server.wait_idle()
        return retry, engine

    retry, engine = asyncio.run(main())
    assert retry.token_ids == reference(tiny, prompts["a"], 3)
    assert_idle(engine)
