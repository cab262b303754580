"""The engine outputs of one call, merged: every (choice index, cumulative output) of its
prompts x n engine requests, as they come. Closing the merged iterator early (a client gone, an
error) aborts every engine request of the call that has not ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tokenspeed.runtime.outputs import RequestOutput

from .protocol import GenerationRequest
from .role import Role


async def choice_outputs(
    role: Role, call: GenerationRequest, request_id: str
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Choice i is completion i % n of prompt i // n (engine request f"{request_id}-{i}")."""
    n = len(call.params)
    streams = [
        role.generate(f"{request_id}-{i}", prompt.token_ids, call.params[i % n], prompt.text)
        for i, prompt in enumerate(p for p in call.prompts for _ in range(n))
    ]
    if len(streams) == 1:  # the common case, without a task per output
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()  # a cancelled wait inside a stream aborts its request
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
