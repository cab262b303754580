"""POST /v1/completions and /v1/chat/completions: one parsed call run on the role, answered
whole (JSON) or streamed (SSE).

Errors found before the answer starts (the body, the engine refusing a prompt, overload) are
4xx / 503 JSON bodies. Once a stream has started, an error is sent as one `data:` event holding
the error object, then `data: [DONE]`. A client that goes away (a write fails, or aiohttp
cancels the handler when its connection closes) aborts every engine request of its call, which
frees their cache at the engine's next step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

from aiohttp import web

from tokenspeed.runtime.async_engine import AsyncEngineClosed
from tokenspeed.runtime.engine import RequestError
from tokenspeed.runtime.outputs import RequestOutput

from . import responses, sse
from .deltas import ChoiceDelta
from .errors import ApiError, bad_request, error_body
from .protocol import GenerationRequest, parse_chat, parse_completion
from .state import ServerState, state_of
from .streams import choice_outputs

logger = logging.getLogger("tokenspeed.server")


async def completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    call = parse_completion(await read_json(request, state), state.model)
    return await _run(request, state, call, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    call = parse_chat(await read_json(request, state), state.model)
    return await _run(request, state, call, "chatcmpl")


async def read_json(request: web.Request, state: ServerState) -> object:
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body{got} is larger than the limit of {limit} bytes")


async def _run(
    request: web.Request, state: ServerState, call: GenerationRequest, kind: str
) -> web.StreamResponse:
    state.admission.enter(call.num_requests)
    try:
        rid = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        outputs = choice_outputs(state.role, call, rid)
        async with contextlib.aclosing(outputs):
            if call.stream:
                return await _stream(request, state, call, rid, created, outputs)
            return await _whole(state, call, rid, created, outputs)
    finally:
        state.admission.leave(call.num_requests)


async def _first(outputs) -> tuple[int, RequestOutput]:
    """The call's first output; what the engine refuses becomes the ApiError."""
    try:
        return await anext(outputs)
    except RequestError as exc:
        raise bad_request(str(exc)) from None
    except AsyncEngineClosed:
        raise ApiError(503, "the server is shutting down", code="shutting_down") from None


def _aborted(state: ServerState, out: RequestOutput) -> ApiError:
    if state.admission.closed:
        return ApiError(503, "the server is shutting down", code="shutting_down")
    return ApiError(500, f"the generation was aborted: {out.abort_reason}")


async def _whole(state, call, rid, created, outputs) -> web.Response:
    finals: dict[int, RequestOutput] = {}
    item = await _first(outputs)
    while item is not None:
        index, out = item
        if out.finished:
            if out.outputs[0].finish_reason == "abort":
                raise _aborted(state, out)
            finals[index] = out
        item = await anext(outputs, None)
    body = responses.completion(
        rid, created, call.model, finals, len(call.params), call.chat, call.return_token_ids
    )
    return web.Response(body=sse.dumps(body), content_type="application/json")


async def _stream(request, state, call, rid, created, outputs) -> web.StreamResponse:
    n = len(call.params)
    chunks = responses.ChunkMaker(rid, created, call.model, call.chat, call.include_usage)
    deltas = [ChoiceDelta(call.params[i % n].stop) for i in range(call.num_requests)]
    started = [False] * call.num_requests
    finals: dict[int, RequestOutput] = {}
    ids = call.return_token_ids
    item = await _first(outputs)
    resp = web.StreamResponse(headers=sse.HEADERS)
    await resp.prepare(request)
    try:
        while item is not None:
            index, out = item
            seq = out.outputs[0]
            if out.finished and seq.finish_reason == "abort":
                error = _aborted(state, out)
                await resp.write(sse.event(error_body(error.status, error.message)))
                break
            text, new_ids = deltas[index].next(seq, out.finished)
            first = not started[index]
            if first or text or out.finished or (ids and new_ids):
                started[index] = True
                prompt_ids = out.prompt_token_ids if ids and first else None
                chunk = chunks.choice(
                    index,
                    text,
                    seq.finish_reason if out.finished else None,
                    new_ids if ids else None,
                    prompt_ids,
                    role=call.chat and first,
                )
                await resp.write(sse.event(chunk))
            if out.finished:
                finals[index] = out
            item = await anext(outputs, None)
        else:
            if call.include_usage:
                await resp.write(sse.event(chunks.usage(responses.usage_of(finals, n))))
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionError:
        logger.debug("client of %s went away mid-stream; its requests are aborted", rid)
    except Exception as exc:  # the stream has started: the error goes down it
        logger.error("stream %s failed: %r", rid, exc, exc_info=exc)
        with contextlib.suppress(ConnectionError):
            await resp.write(sse.event(error_body(500, f"the generation failed: {exc!r}")))
            await resp.write(sse.DONE)
            await resp.write_eof()
    return resp
