"""`AsyncEngine`: the engine behind an asyncio API, for embedding in a server.

    engine = AsyncEngine(Engine(model, tokenizer, config))
    async for out in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=64)):
        send(out.outputs[0].token_ids)      # every step that moved the request
    await engine.abort("req-2")

One background task steps the engine while any request is unfinished; each request gets a queue
of its outputs. The engine's step runs in the event loop's thread (compute-bound work released
between steps), so an `await` in a handler lets other requests join the next step.

A step that fails costs only the requests of its batch: the engine aborts them and their
consumers get a final output with finish_reason "abort" and the error in `abort_reason`; the
others go on. Any other failure of the loop reaches every consumer as the exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Hashable, Sequence

from .engine import Engine, StepError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.runtime")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[Hashable, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None

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
            if self._queues.pop(request_id, None) is not None and self.engine.abort(request_id):
                self._ensure_loop()  # report the abort of a consumer that went away

    async def abort(self, request_id: Hashable) -> bool:
        aborted = self.engine.abort(request_id)
        if aborted:
            self._ensure_loop()
        return aborted

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.engine.has_unfinished():
                for out in self._step():
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                await asyncio.sleep(0)  # let handlers consume and new requests arrive
        except Exception as exc:  # a failing loop must not leave consumers waiting forever
            for queue in self._queues.values():
                queue.put_nowait(exc)
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
