"""`AsyncEngine`: the engine behind an asyncio API, for embedding in a server.

    engine = AsyncEngine(Engine(model, tokenizer, config))
    async for out in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=64)):
        send(out.outputs[0].token_ids)      # every step that moved the request
    await engine.abort("req-2")

One background task steps the engine while any request is unfinished; each request gets a queue
of its outputs. By default a step runs in the event loop's thread: the loop waits for it, and
requests that arrive meanwhile join the next step. With `step_thread=True` each step runs on a
worker thread instead, so that the loop keeps serving the server's I/O while the model computes
(a step may take tens of milliseconds, a long prefill more). The two threads still share the
GIL: a loop that is busy in Python slows the step down, since every kernel launch has to win the
GIL back (a CPU engine beside a busy loop is the worst case). The engine itself is touched only
under one lock: by the step, by `generate` adding a request and by `abort`, so none of them ever
overlaps a step. A consumer that goes away while a step runs has its request aborted right after
that step.

Outputs are cumulative (each holds every token so far), so a consumer that falls behind gets
the newest one when it asks again, never a backlog: a stalled client costs one output's memory,
not one per step. A request id may be used again once its request has ended.

A step that fails costs only the requests of its batch: the engine aborts them and their
consumers get a final output with finish_reason "abort" and the error in `abort_reason`; the
others go on. Any other failure of the loop reaches every consumer as the exception, and the
request of each consumer it reached is aborted (nobody can read it any more).

P/D engines (`runtime/pd/`): `submit(request_id, add)` puts a request in by any call of the
engine (a `DecodeEngine.admit`), yielding what that call returned before the outputs. While
every unfinished request only waits for a transfer (an engine whose `only_transfers_pending()`
says so: a prefill held for its send, a destination waiting for its bytes) the loop does not
step: it polls that every `transfer_poll_s`, or at once when a request comes or goes.

An `AsyncEngine` serves one event loop at a time. Used from a new loop once the old one has
stopped (a second `asyncio.run`, say), it waits for a step still running on its worker thread and
aborts the requests the old loop's consumers held: nobody can read them any more. `close()`
aborts everything, delivers the last outputs and stops the worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TypeVar

import attrs
import torch

from .engine import Engine, StepError
from .load import LoadSnapshot
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.runtime")

T = TypeVar("T")


class AsyncEngineClosed(RuntimeError):
    """`generate` on an `AsyncEngine` after `close()`."""


@attrs.frozen
class _LoopFailure:
    """The exception that ended the stepping task, with its traceback as caught: every consumer
    raises it from there, not from the frames the other consumers' raises added."""

    error: Exception
    traceback: TracebackType | None


class _Stream:
    """What one consumer has not read yet: the newest output (a newer one replaces it, as outputs
    are cumulative; a final one is never replaced) or the loop's failure."""

    def __init__(self) -> None:
        self._item: RequestOutput | _LoopFailure | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | _LoopFailure) -> None:
        held = self._item
        if isinstance(held, _LoopFailure) or (held is not None and held.finished):
            return
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | _LoopFailure:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


class AsyncEngine:
    transfer_poll_s = 0.002  # while only transfers are pending: how often to look again

    def __init__(self, engine: Engine, *, step_thread: bool = False):
        self.engine = engine
        self._streams: dict[Hashable, _Stream] = {}
        # Per event loop (see `_bind`): the loop served, its lock and its stepping task.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()  # held while the engine is in use (a step, an add, an abort)
        self._wake = asyncio.Event()  # something changed: stop waiting for transfers
        self._loop_task: asyncio.Task | None = None
        self._leaving: list[Hashable] = []  # consumers gone during a step: abort after it
        self._closed = False
        self._worker: ThreadPoolExecutor | None = None
        self._running_step: Future | None = None  # the worker thread's current step
        self._last_load: LoadSnapshot | None = None  # what load() answers during a step
        if step_thread:
            # One thread, always the same: torch keeps some state per thread (the current
            # device and stream), set once for it here.
            self._worker = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="tokenspeed-step",
                initializer=_use_device,
                initargs=(next(engine.model.parameters()).device,),  # "cuda" with its index
            )
            weakref.finalize(self, self._worker.shutdown, wait=False)

    def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        session: Hashable | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; the last one has `finished` set. A consumer
        that stops early aborts the request once the iterator is closed: `break` out of
        `async for` closes it only when it is garbage collected, so wrap the iterator in
        `contextlib.aclosing` to abort at once."""

        def add(engine: Engine) -> bool:
            engine.add_request(request_id, prompt_token_ids, params, prompt=prompt, session=session)
            return True

        return self._outputs(request_id, add, announce=False)

    def submit(self, request_id: Hashable, add: Callable[[Engine], T | None]) -> AsyncIterator:
        """`generate` for a request that `add(engine)` puts in the engine (run between two
        steps; a `DecodeEngine.admit`, say): yields what `add` returned, then the request's
        outputs as `generate` does. When `add` returns None it put nothing in (no room now):
        that None is the only item. When it raises, nothing was put in either."""
        return self._outputs(request_id, add, announce=True)

    async def _outputs(
        self, request_id: Hashable, add: Callable[[Engine], object], announce: bool
    ) -> AsyncIterator:
        await self._bind()
        if self._closed:
            raise AsyncEngineClosed("this AsyncEngine is closed")
        stream = _Stream()
        async with self._lock:
            value = add(self.engine)
            if value is not None:
                self._streams[request_id] = stream
        if value is None:
            yield None
            return
        self._ensure_loop()
        ended = False
        try:
            if announce:
                yield value
            while True:
                out = await stream.get()
                if isinstance(out, _LoopFailure):
                    # Not `ended`: the request may still run in the engine, and nobody can read
                    # it now, so it is aborted as for any consumer that leaves.
                    raise out.error.with_traceback(out.traceback)
                ended = out.finished
                yield out
                if ended:
                    return
        finally:
            # The id may already name a newer request (ours ended, a retry reused it): that one
            # is not ours to forget or abort.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if not ended:
                    self._consumer_left(request_id)

    def _consumer_left(self, request_id: Hashable) -> None:
        """Abort the request of a consumer that stopped listening (no await: this runs in a
        generator being closed). During a step the abort waits for the step's end."""
        if self._lock.locked():
            self._leaving.append(request_id)
        elif not self.engine.abort(request_id):
            return
        self._ensure_loop()  # report the abort (or apply it after the step)

    async def abort(self, request_id: Hashable) -> bool:
        await self._bind()
        async with self._lock:
            aborted = self.engine.abort(request_id)
        if aborted:
            self._ensure_loop()
        return aborted

    def load(self) -> LoadSnapshot:
        """The engine's load (runtime/load.py), from the event loop's thread: computed now, or
        while a step runs on the worker thread, as it was when that step started."""
        if self._running_step is None or self._running_step.done():
            self._last_load = self.engine.load()
        return self._last_load

    async def run_exclusive(self, fn: Callable[[Engine], T]) -> T:
        """fn(engine) between two steps, never during one (an integrity check, cache stats, a
        P/D send or abort). What fn changed is reported by the steps that follow."""
        await self._bind()
        async with self._lock:
            result = fn(self.engine)
        if self.engine.has_unfinished():
            self._ensure_loop()
        return result

    async def wait_idle(self) -> None:
        """Wait until the engine has nothing left to run or report: every request has ended and
        its last output is waiting for its consumer (for a graceful shutdown, say)."""
        await self._bind()
        while self._loop_task is not None and not self._loop_task.done():
            await asyncio.wait([self._loop_task])

    async def close(self) -> None:
        """Stop serving: abort every request (their consumers get a final "abort" output), wait
        until that is reported, and stop the worker thread. Later `generate` calls raise
        `AsyncEngineClosed`. The `Engine` itself stays usable (and open: `engine.close()`)."""
        await self._bind()
        self._closed = True
        async with self._lock:
            for request_id in list(self._streams):
                self.engine.abort(request_id, "the AsyncEngine was closed")
        self._ensure_loop()
        await self.wait_idle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    async def _bind(self) -> None:
        """Serve the running event loop. On a new loop (the old one has stopped), first let a
        step of the old loop finish on the worker thread, and abort the requests whose consumers
        lived on the old loop: they can never read again, and their streams belong to it."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        old = self._loop
        if old is not None and old.is_running():
            raise RuntimeError("this AsyncEngine serves another event loop, which is running")
        self._loop = loop
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task = None
        async with self._lock:  # the new loop's other callers wait for this
            if self._running_step is not None:
                await asyncio.wait([asyncio.wrap_future(self._running_step)])
            orphans = [*self._leaving, *self._streams]
            self._leaving, self._streams = [], {}
            for request_id in orphans:
                self.engine.abort(request_id, "its event loop ended")
        if self.engine.has_unfinished():
            self._ensure_loop()

    def _ensure_loop(self) -> None:
        """Start the stepping task if none runs. Not from outside the loop served (a consumer
        closed by the garbage collector after its loop ended): the next loop steps then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if loop is not self._loop:
            return
        self._wake.set()  # a request came or went: a loop waiting for transfers looks again
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                async with self._lock:
                    while self._leaving:
                        request_id = self._leaving.pop()
                        if request_id not in self._streams:  # else a new request took the id
                            self.engine.abort(request_id)
                    if not self.engine.has_unfinished():
                        return
                    self._wake.clear()
                    waiting = self._only_transfers_pending()
                    if not waiting:
                        outputs = await self._run_step()
                if waiting:  # nothing to step until a transfer ends or a request comes
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.transfer_poll_s)
                    continue
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                await asyncio.sleep(0)  # let handlers consume and new requests arrive
        except Exception as exc:  # a failing loop must not leave consumers waiting forever
            logger.error("the AsyncEngine loop failed: %r", exc, exc_info=exc)
            failure = _LoopFailure(exc, exc.__traceback__)
            for stream in self._streams.values():
                stream.put(failure)
            # Not re-raised: every consumer gets it, and nobody awaits this task's result.

    def _only_transfers_pending(self) -> bool:
        """A P/D engine whose unfinished requests all wait for transfers: a step would do
        nothing (it settles the transfers that ended as it answers)."""
        check = getattr(self.engine, "only_transfers_pending", None)
        return check is not None and check()

    async def _run_step(self) -> list[RequestOutput]:
        """One step, inline or on the worker thread."""
        if self._worker is None:
            return self._step()
        self._last_load = self.engine.load()  # ~10 us: what load() answers meanwhile
        self._running_step = self._worker.submit(self._step)
        step = asyncio.wrap_future(self._running_step)
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            # A step cannot stop half way: keep the engine (the lock) until it has ended.
            await asyncio.wait([step])
            raise

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except StepError as exc:
            if not exc.aborted:
                raise  # nothing was given up, so the next step would fail the same way
            # Those requests end aborted with the next step's outputs; the others go on.
            logger.error("%s", exc, exc_info=exc.__cause__)
            return []


def _use_device(device: torch.device) -> None:
    """Make the engine's GPU the worker thread's current one (a thread starts on GPU 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
