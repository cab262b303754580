"""`Engine.load()` / `AsyncEngine.load()`: the load snapshot a gateway reads, through a request's
life (queued, running, finished, aborted), and never computed while a step runs on the worker
thread."""

import asyncio
import threading
import time

from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.load import LoadSnapshot

from .conftest import tokens


def make_engine(model, max_num_seqs: int = 2) -> Engine:
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_model_len=256, page_size=16, enable_cuda_graph=False
    )
    return Engine(model, None, config)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_new_engine_is_idle_with_every_page_free(tiny):
    load = make_engine(tiny).load()
    assert isinstance(load, LoadSnapshot)
    assert (load.running, load.waiting, load.outstanding_tokens) == (0, 0, 0)
    assert load.used_pages == load.cached_pages == 0
    assert load.free_pages == load.available_pages == load.total_pages > 0
    d = load.as_dict()
    assert d["outstanding_tokens"] == 0 and d["available_pages"] == load.total_pages


def test_the_snapshot_follows_requests_from_queue_to_end(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    prompts = [tokens(40, seed=i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, greedy(5))
    queued = engine.load()
    assert (queued.running, queued.waiting) == (0, 3)
    assert queued.outstanding_prefill_tokens == 3 * 40
    assert queued.outstanding_decode_tokens == 3 * 5
    engine.step()  # two admitted (max_num_seqs), prefilled, one token each
    running = engine.load()
    assert (running.running, running.waiting) == (2, 1)
    assert running.outstanding_prefill_tokens == 40  # the third prompt, still queued
    assert running.outstanding_decode_tokens == 2 * 4 + 5
    assert running.used_pages == 2 * 3  # 41 tokens each: 3 pages of 16
    assert running.used_pages + running.free_pages + running.cached_pages == running.total_pages
    assert engine.abort(0)
    while engine.has_unfinished():
        engine.step()
    done = engine.load()
    assert (done.running, done.waiting, done.outstanding_tokens, done.used_pages) == (0, 0, 0, 0)
    assert done.cached_pages > 0  # the finished turns stay matchable
    assert done.available_pages == done.total_pages
    engine.check_integrity()


def test_async_load_never_reads_the_engine_during_a_threaded_step(tiny):
    """While a step runs on the worker thread, load() answers the snapshot taken as that step
    started (reading the scheduler's queues mid-step could race); between steps, a fresh one.
    run_exclusive runs between two steps."""
    engine = make_engine(tiny)
    real_step, in_step = engine.step, threading.Event()

    def slow_step():
        in_step.set()
        time.sleep(0.05)
        try:
            return real_step()
        finally:
            in_step.clear()

    engine.step = slow_step
    real_load, loads_in_step = engine.load, []

    def load():
        loads_in_step.append(in_step.is_set())
        return real_load()

    engine.load = load

    async def main():
        server = AsyncEngine(engine, step_thread=True)
        seen, exclusive = [], []

        async def consume():
            async for _ in server.generate("a", tokens(20, seed=1), greedy(4)):
                seen.append(server.load())

        task = asyncio.ensure_future(consume())
        while not in_step.is_set():
            await asyncio.sleep(0.001)
        during = server.load()  # the step that admits "a" is running
        exclusive.append(await server.run_exclusive(lambda e: in_step.is_set()))
        await task
        await server.wait_idle()
        return during, seen, exclusive, server.load()

    during, seen, exclusive, after = asyncio.run(main())
    assert not any(loads_in_step)
    assert (during.running, during.waiting) == (0, 1)  # as the step started
    assert exclusive == [False]
    assert all(s.running + s.waiting <= 1 for s in seen)
    assert (after.running, after.waiting, after.used_pages) == (0, 0, 0)
    engine.check_integrity()
