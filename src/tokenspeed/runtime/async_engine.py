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

A step that fails costs only the requests of its batch: the engine aborts them and their
consumers get a final output with finish_reason "abort" and the error in `abort_reason`; the
others go on. Any other failure of the loop reaches every consumer as the exception.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .engine import Engine, StepError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.runtime")


class AsyncEngine:
    def __init__(self, engine: Engine, *, step_thread: bool = False):
        self.engine = engine
        self._queues: dict[Hashable, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # held while the engine is in use (a step, an add, an abort)
        self._leaving: list[Hashable] = []  # consumers gone during a step: abort after it
        self._worker: ThreadPoolExecutor | None = None
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

    async def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        session: Hashable | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; the last one has `finished` set."""
        queue: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            self.engine.add_request(
                request_id, prompt_token_ids, params, prompt=prompt, session=session
            )
            self._queues[request_id] = queue
        self._ensure_loop()
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self._queues.pop(request_id, None) is not None:
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
        async with self._lock:
            aborted = self.engine.abort(request_id)
        if aborted:
            self._ensure_loop()
        return aborted

    async def wait_idle(self) -> None:
        """Wait until the engine has nothing left to run or report: every request has ended and
        its last output is in its consumer's queue (for a graceful shutdown, say)."""
        while self._loop_task is not None and not self._loop_task.done():
            await asyncio.wait([self._loop_task])

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                async with self._lock:
                    while self._leaving:
                        self.engine.abort(self._leaving.pop())
                    if not self.engine.has_unfinished():
                        return
                    outputs = await self._run_step()
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                await asyncio.sleep(0)  # let handlers consume and new requests arrive
        except Exception as exc:  # a failing loop must not leave consumers waiting forever
            for queue in self._queues.values():
                queue.put_nowait(exc)
            raise

    async def _run_step(self) -> list[RequestOutput]:
        """One step, inline or on the worker thread."""
        if self._worker is None:
            return self._step()
        step = asyncio.get_running_loop().run_in_executor(self._worker, self._step)
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
