"""POST /v1/completions and /v1/chat/completions: one parsed call run on the role, answered
whole (JSON) or streamed (SSE). Below them, what a gateway reads of this worker (GET /v1/loads,
/server_info, /model_info; see `loads`).

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
from datetime import UTC, datetime
from importlib import metadata

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
try:
    VERSION = metadata.version("tokenspeed")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"


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


# What a gateway reads. smg (and SGLang's router) poll GET /loads or /v1/loads and parse SGLang's
# schema: {"timestamp", "dp_rank_count", "loads": [one entry per data-parallel rank]}; a 200 in
# another shape counts as "no load route". At registration they probe /v1/models (`owned_by`),
# /server_info, /model_info and /version (/server_info without /version: an SGLang-like worker)
# and label the worker from them (max_running_requests, which smg's P/D admission needs, among
# them). Our own numbers (`LoadSnapshot`, the admission count) ride along under "tokenspeed".


async def loads(request: web.Request) -> web.Response:
    """GET /v1/loads (and /loads): this worker's one rank in SGLang's load schema, and under
    "tokenspeed" the engine's `LoadSnapshot` with the server's admission count and cap. Tokens
    are pages times page_size; `num_waiting_uncached_tokens` is the prompt work still to do
    (queued prompts less their prefix hit, and the rest of chunked prefills), `token_usage` the
    share of device pages held by requests (cached pages are evictable: not counted),
    `utilization` running / max_num_seqs, `gen_throughput` generated tokens per second over the
    last second or more between two reads. The query (smg's `?include=...`) is ignored."""
    state = state_of(request)
    load = state.role.load()
    metrics = state.role.metrics
    capacity = load.total_pages * load.page_size
    used = load.used_pages * load.page_size
    rank = {
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_waiting_uncached_tokens": load.outstanding_prefill_tokens,
        "num_total_reqs": load.running + load.waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + load.outstanding_prefill_tokens,
        "max_total_num_tokens": capacity,
        "max_running_requests": load.max_num_seqs,
        "token_usage": round(used / capacity, 4) if capacity else 0.0,
        "gen_throughput": round(state.decode_rate.read(metrics.decode_tokens), 2),
        "cache_hit_rate": round(metrics.hit_rate, 4),
        "utilization": round(load.running / load.max_num_seqs, 4) if load.max_num_seqs else 0.0,
    }
    body = {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": VERSION,
        "dp_rank_count": 1,
        "loads": [rank],
        "tokenspeed": {
            "model": state.model.name,
            "role": state.role.name,
            **load.as_dict(),
            "pending": state.admission.pending,
            "max_pending": state.admission.max_pending,
            "accepting": not state.admission.closed,
        },
    }
    return _json(body)


def _json(body: dict) -> web.Response:
    return web.Response(body=sse.dumps(body), content_type="application/json")


def _disaggregation_mode(role: str) -> str:
    """SGLang's name for what a worker does: "null" (prefill and decode here), else the role."""
    return "null" if role == "aggregated" else role


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info: the settings a gateway labels this worker with (SGLang's names beside
    ours: max_running_requests is max_num_seqs, context_length max_model_len)."""
    state = state_of(request)
    load = state.role.load()
    model = state.model
    body = {
        "engine": "tokenspeed",
        "version": VERSION,
        "model_path": model.name,
        "served_model_name": model.name,
        "max_model_len": model.max_model_len,
        "context_length": model.max_model_len,
        "max_num_seqs": load.max_num_seqs,
        "max_running_requests": load.max_num_seqs,
        "page_size": load.page_size,
        "max_total_num_tokens": load.total_pages * load.page_size,
        "role": state.role.name,
        "disaggregation_mode": _disaggregation_mode(state.role.name),
        "dp_size": 1,
        "max_pending": state.admission.max_pending,
        "active_requests": state.admission.pending,
        "uptime_seconds": round(time.time() - state.started, 3),
    }
    return _json(body)


async def model_info(request: web.Request) -> web.Response:
    """GET /model_info: the model as SGLang describes it (a generation model; its context limit,
    the longest prompt, its vocabulary and end-of-sequence tokens)."""
    model = state_of(request).model
    eos = list(model.tokenizer.eos_token_ids) if model.tokenizer is not None else []
    body = {
        "model_path": model.name,
        "served_model_name": model.name,
        "is_generation": True,
        "max_context_length": model.max_model_len,
        "max_req_input_len": model.max_model_len - 1,
        "vocab_size": model.vocab_size,
        "eos_token_ids": eos,
    }
    return _json(body)
