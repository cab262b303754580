"""The aiohttp application: routes, API key check, errors as OpenAI JSON bodies.

    POST /v1/completions        POST /v1/chat/completions     (handlers.py)
    GET  /v1/models             GET  /health                   GET /metrics
    GET  /v1/loads (and /loads)     GET /server_info     GET /model_info
                                (handlers.py: what a gateway such as smg reads)

aiohttp was chosen over FastAPI on uvicorn by measured overhead (benchmarks/serve_overhead.py,
docs/perf/serve.md): 1.5-1.7x less server CPU per request and 1.3-1.5x less per SSE event.

Every failure inside a handler is answered (an `ApiError` with its status, anything else 500,
logged) and the server goes on. Handlers are cancelled when their client disconnects
(`handler_cancellation`), which aborts the client's engine requests even before their first
token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from aiohttp import web

from . import handlers, sse
from .errors import ApiError, error_body
from .metrics import CONTENT_TYPE
from .state import STATE, ServerState, state_of

logger = logging.getLogger("tokenspeed.server")

_OPEN_PATHS = ("/health", "/metrics")  # no API key needed: probes and scrapers


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[_errors, _auth],
        client_max_size=state.config.max_body_bytes,
        handler_args={"handler_cancellation": True},
    )
    app[STATE] = state
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", handlers.loads)
    app.router.add_get("/loads", handlers.loads)  # smg asks here first
    app.router.add_get("/server_info", handlers.server_info)
    app.router.add_get("/model_info", handlers.model_info)
    # No /version: smg takes a worker answering both /version and /server_info for vLLM and
    # then reads none of /server_info's labels (max_running_requests among them).
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_fold_metrics)
    install = getattr(state.role, "install", None)  # P/D roles: their middleware and startup
    if install is not None:
        install(app)
    return app


FOLD_SECONDS = 5.0  # how often the engine's latency samples move into the histograms


async def _fold_metrics(app: web.Application):
    """Fold the engine's latency samples into /metrics' histograms every few seconds, scraped
    or not, so that the engine's sample lists stay short in a long-running server."""
    state = app[STATE]

    async def fold() -> None:
        while True:
            await asyncio.sleep(FOLD_SECONDS)
            state.metrics.fold(state.role.metrics)

    task = asyncio.create_task(fold())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=sse.dumps(body), status=status, headers=headers, content_type="application/json"
    )


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    counts = state_of(request).metrics.responses
    try:
        response = await handler(request)
    except ApiError as exc:
        response = json_response(exc.body(), exc.status, exc.headers)
    except web.HTTPException as exc:  # no such route (404), wrong method (405), ...
        if exc.status < 400:
            raise
        response = json_response(
            error_body(exc.status, f"{exc.reason}: {request.path}"), exc.status
        )
    except Exception as exc:
        logger.error("%s %s failed: %r", request.method, request.path, exc, exc_info=exc)
        response = json_response(error_body(500, f"internal error: {exc!r}"), 500)
    counts[response.status] += 1
    return response


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    key = state_of(request).config.api_key
    if key is not None and request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key):
            raise ApiError(
                401,
                "a valid API key is needed: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    model = state.model
    entry = {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "tokenspeed",
        "max_model_len": model.max_model_len,
    }
    return json_response({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    """200 {"status": "ok"} while serving, 503 while shutting down. ?integrity=1 also checks the
    cache's bookkeeping between two steps (500 with the error when it does not add up)."""
    state = state_of(request)
    if state.admission.closed:
        return json_response({"status": "shutting_down"}, 503)
    body: dict = {"status": "ok"}
    if request.query.get("integrity") in ("1", "true"):
        try:
            await state.role.check_integrity()
        except Exception as exc:
            logger.error("cache integrity check failed: %r", exc, exc_info=exc)
            return json_response({"status": "error", "integrity": repr(exc)}, 500)
        body["integrity"] = "ok"
    return json_response(body)


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    cache = await state.role.cache_stats()
    text = state.metrics.render(state.role.metrics, state.role.load(), cache)
    return web.Response(text=text, headers={"Content-Type": CONTENT_TYPE})
