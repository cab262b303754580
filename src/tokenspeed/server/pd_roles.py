"""`PrefillRole` and `DecodeRole`: the two halves of a prefill/decode split behind smg.

    tokenspeed serve tiny --role prefill --port 8100 --bootstrap-port 8998
    tokenspeed serve tiny --role decode --port 8200
    smg launch --pd-disaggregation --prefill http://127.0.0.1:8100 8998 \\
        --decode http://127.0.0.1:8200

smg's HTTP P/D mode sends each request to both workers at once, the same JSON with three fields
added: `bootstrap_host`, `bootstrap_port` (the prefill worker's rendezvous) and `bootstrap_room`
(random; lists of them for a batch of prompts, one per prompt). The client gets the decode
worker's answer; the prefill worker's is read by smg only for its status. So:

- the decode worker admits the request (`DecodeEngine.admit`: pages and a live KDA slot, retried
  while it has no room, up to `timeout_s`), registers the `Destination` with the prefill
  worker's `BootstrapServer` (pd_bootstrap.py) and streams the request from its first token on;
- the prefill worker prefills it, takes the room's registration (waiting up to `timeout_s` for
  it), sends the cache (`PrefillEngine.send`), tells the decode side "sent", and answers its own
  HTTP request with the first token (finish_reason "length": a whole completion, or one chunk
  and [DONE]).

Both engines name the request `room-R-k` (room R, completion k of the prompt's n): the transfer
is matched by that id. The pieces that end a request on one side tell the other: an abort on the
prefill side (its client gone, a failed send, no registration in time) answers the registration
"aborted" and the decode side frees its destination at once; a decode client that goes away
before the handoff cancels the room (the prefill side aborts its request); a decode worker that
dies drops its rendezvous connections, which counts as a cancel. A request that ends with its
first token (max_tokens 1, which the decode worker knows up front, or a stop at that token,
which only the prefill side sees: it answers "finished") is computed on the decode worker itself
(greedy: the same token; the prefill worker's answer is only read for its status).

A P/D worker refuses a generation request without the bootstrap fields with 400: it is one half
of a pair and serves only what the gateway sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Hashable, Sequence

import attrs
from aiohttp import web

from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.engine import RequestError
from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.pd import Destination
from tokenspeed.runtime.sampling_params import SamplingParams

from .errors import ApiError, bad_request
from .pd_bootstrap import SEND_BOUND_S, BootstrapError, BootstrapServer, Key, Rendezvous
from .role import EngineRole
from .state import state_of

logger = logging.getLogger("tokenspeed.server")

DEFAULT_PD_TIMEOUT_S = 60.0
DEFAULT_BOOTSTRAP_PORT = 8998  # as SGLang's
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_ADMIT_RETRY_S = 0.01


# ------------------------------------------------------------------- the bootstrap fields
@attrs.frozen
class Where:
    """Where one engine request meets its other half: the prefill worker's rendezvous, the
    room, and the completion's index within its prompt."""

    host: str
    port: int
    room: int
    index: int

    @property
    def key(self) -> Key:
        return (self.room, self.index)

    @property
    def request_id(self) -> str:
        """The engine request id on both workers (the transfer is matched by it)."""
        return f"room-{self.room}-{self.index}"


@attrs.define
class _Call:
    """The bootstrap fields of one HTTP call (one entry per prompt), and how many of its
    engine requests have started (`choice_outputs` starts them in choice order: completion
    k of prompt p is request p * n + k)."""

    hosts: list[str]
    ports: list[int]
    rooms: list[int]
    n: int
    started: int = 0

    def next(self) -> Where:
        i = self.started
        self.started += 1
        p, k = divmod(i, self.n)
        if p >= len(self.rooms):
            raise RequestError(
                f"bootstrap_room has {len(self.rooms)} rooms, fewer than the call's prompts"
            )
        return Where(self.hosts[p], self.ports[p], self.rooms[p], k)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "tokenspeed_pd_call", default=None
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_bootstrap(body: object) -> _Call | None:
    """The bootstrap fields of a request body (None when it has none); 400 when malformed."""
    if not isinstance(body, dict) or all(body.get(f) is None for f in FIELDS):
        return None
    missing = [f for f in FIELDS if body.get(f) is None]
    if missing:
        raise bad_request(f"'{missing[0]}' is required with the other bootstrap fields", missing[0])
    values = [body[f] for f in FIELDS]
    if any(isinstance(v, list) for v in values):
        if not all(isinstance(v, list) for v in values) or len({len(v) for v in values}) != 1:
            raise bad_request(
                "bootstrap_host, bootstrap_port and bootstrap_room must be all scalars or all "
                "lists of one length (one per prompt)",
                "bootstrap_room",
            )
        hosts, ports, rooms = values
    else:
        hosts, ports, rooms = ([v] for v in values)
    if not rooms:
        raise bad_request("bootstrap_room must not be empty", "bootstrap_room")
    if not all(isinstance(h, str) and h for h in hosts):
        raise bad_request("bootstrap_host must be a non-empty string", "bootstrap_host")
    if not all(_is_int(p) and 0 < p < 65536 for p in ports):
        raise bad_request("bootstrap_port must be a port number", "bootstrap_port")
    if not all(_is_int(r) and 0 <= r < 1 << 64 for r in rooms):
        raise bad_request("bootstrap_room must be an integer in [0, 2^64)", "bootstrap_room")
    n = body.get("n")
    return _Call(hosts, ports, rooms, n if _is_int(n) and n >= 1 else 1)


_UNREAD = object()  # a body left for the handler to refuse (too large, not JSON)


async def _read_call(request: web.Request) -> _Call | object | None:
    limit = state_of(request).config.max_body_bytes
    if request.content_length is None or request.content_length > limit:
        return _UNREAD
    try:
        body = json.loads(await request.read())  # kept by aiohttp: the handler reads it again
    except (ValueError, RecursionError, web.HTTPException):
        return _UNREAD
    return parse_bootstrap(body)


def _middleware(side: str):
    @web.middleware
    async def bootstrap_fields(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "POST" or request.path not in GENERATION_PATHS:
            return await handler(request)
        call = await _read_call(request)
        if call is _UNREAD:
            return await handler(request)  # its own error (or the role's: no bootstrap fields)
        if call is None:
            raise ApiError(
                400,
                f"this worker is the {side} half of a prefill/decode split: send generation "
                "requests through the P/D gateway (smg --pd-disaggregation), which adds "
                "bootstrap_host, bootstrap_port and bootstrap_room",
                code="missing_bootstrap",
            )
        token = _CALL.set(call)
        try:
            return await handler(request)
        finally:
            _CALL.reset(token)

    return bootstrap_fields


def _where() -> Where | RequestError:
    """This engine request's place in the current call (raised in the request's stream)."""
    call = _CALL.get()
    if call is None:
        return RequestError("a P/D worker needs the gateway's bootstrap fields")
    try:
        return call.next()
    except RequestError as exc:
        return exc


def _aborted(error: str) -> dict:
    return {"type": "aborted", "error": error}


async def _final(outs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last output of a request that was just aborted (or ended)."""
    async for out in outs:
        if out.finished:
            return out
    raise RuntimeError("the request's outputs ended without a final one")


# ----------------------------------------------------------------------------- the roles
class _PDRole(EngineRole):
    name = "pd"

    def __init__(self, engine: AsyncEngine, *, timeout_s: float, io_timeout_s: float) -> None:
        if not timeout_s > 0 or not io_timeout_s > 0:
            raise ValueError("P/D timeouts must be positive")
        super().__init__(engine)
        self.timeout_s = float(timeout_s)
        self.io_timeout_s = float(io_timeout_s)
        self._tasks: set[asyncio.Task] = set()

    def install(self, app: web.Application) -> None:
        """Add what this role needs to the app: the middleware reading the bootstrap fields."""
        app.middlewares.append(_middleware(self.name))

    async def close(self) -> None:
        await super().close()
        await self._stop_tasks()

    def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        # The engine request is named by the bootstrap fields (`_where`), not `request_id`.
        return self._generate(_where(), prompt_token_ids, params, prompt)

    def _generate(self, where, ids, params, prompt) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class PrefillRole(_PDRole):
    """Prefills each request on a `PrefillEngine` and hands it to the decode worker that
    registered its room (`BootstrapServer` on `host:bootstrap_port`, started with the app)."""

    name = "prefill"

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        host: str = "127.0.0.1",
        bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
        timeout_s: float = DEFAULT_PD_TIMEOUT_S,
        io_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(engine, timeout_s=timeout_s, io_timeout_s=io_timeout_s)
        self.bootstrap = BootstrapServer(
            host,
            bootstrap_port,
            timeout_s=timeout_s,
            io_timeout_s=io_timeout_s,
            on_cancel=self._on_cancel,
        )
        self._active: dict[Key, Hashable] = {}  # room -> the engine request computing it

    def install(self, app: web.Application) -> None:
        super().install(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        await self.bootstrap.start()

    async def _stop(self, app: web.Application) -> None:
        await self.bootstrap.close()

    async def close(self) -> None:
        await self.bootstrap.close()  # requests waiting for a registration end now
        await super().close()

    async def _on_cancel(self, key: Key) -> None:
        rid = self._active.get(key)
        if rid is not None:
            reason = "the decode worker gave up on it"
            await self.engine.run_exclusive(lambda engine: engine.abort(rid, reason))

    async def _generate(self, where, ids, params, prompt) -> AsyncIterator[RequestOutput]:
        if isinstance(where, Exception):
            raise where
        key, rid = where.key, where.request_id
        if key in self._active:
            raise RequestError(f"bootstrap_room {where.room} is in use by another request here")
        if self.bootstrap.cancelled(key):
            raise RequestError(f"the decode worker gave up on bootstrap_room {where.room}")
        self._active[key] = rid
        answered = False  # the room's decode side has its outcome (or will, from a task)
        reg = None
        try:
            async with contextlib.aclosing(self.engine.generate(rid, ids, params, prompt)) as outs:
                first = await anext(outs)
                if first.finished:  # ended with its first token, or aborted: nothing to send
                    done = first.outputs[0].finish_reason != "abort"
                    self.bootstrap.end(
                        key, {"type": "finished"} if done else _aborted(str(first.abort_reason))
                    )
                    answered = True
                    yield first
                    return
                try:
                    reg = await self.bootstrap.take(key)
                    why = "the decode worker gave up on it" if reg.cancelled else None
                except TimeoutError:
                    why = f"no decode worker registered it within {self.timeout_s:g} s"
                except BootstrapError as exc:
                    why = str(exc)
                if why is None:
                    answered = True  # by `_send` if it is cancelled, else just below
                    outcome = await self._send(rid, reg)
                    reg.reply(outcome)
                    if outcome["type"] == "sent":
                        # Freed here now (the loop would at its next look, within ms).
                        await self.engine.run_exclusive(lambda engine: engine.poll_transfers())
                        yield _handed_off(first)
                        return
                    why = f"handoff {outcome['type']}: {outcome.get('error')}"
                if reg is None:
                    self.bootstrap.end(key, _aborted(why))
                else:
                    reg.reply(_aborted(why))
                answered = True
                await self.engine.run_exclusive(lambda engine: engine.abort(rid, why))
                yield await _final(outs)
        finally:
            if self._active.get(key) == rid:
                del self._active[key]
            if not answered:  # the consumer left (smg closed the connection) or a failure
                if reg is None:
                    self.bootstrap.end(key, _aborted("the prefill request ended"))
                else:
                    reg.reply(_aborted("the prefill request ended"))

    async def _send(self, rid: Hashable, reg) -> dict:
        """Send the held request to the registered destination: the outcome for the decode
        side. A consumer that leaves meanwhile leaves the answer to a task (the write goes on)."""
        try:
            destination = Destination.from_dict(reg.destination)
            future = await self.engine.run_exclusive(lambda e: e.send(rid, destination))
        except asyncio.CancelledError:  # before the send started (waiting for the engine)
            reg.reply(_aborted("the prefill request ended"))
            raise
        except Exception as exc:  # refused before any write: a foreign or expired destination
            return _aborted(f"could not send: {exc}")
        try:
            await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self._spawn(self._answer_when_sent(future, reg))
            raise
        except Exception as exc:
            return {"type": "failed", "error": str(exc)}
        return {"type": "sent"}

    async def _answer_when_sent(self, future, reg) -> None:
        try:
            await asyncio.wrap_future(future)
        except Exception as exc:
            reg.reply({"type": "failed", "error": str(exc)})
        else:
            reg.reply({"type": "sent"})


def _handed_off(first: RequestOutput) -> RequestOutput:
    """The prefill worker's answer once the request is handed off: its first token, finished
    ("length", as SGLang's prefill servers answer)."""
    seq = attrs.evolve(first.outputs[0], finish_reason="length")
    return attrs.evolve(first, outputs=[seq], finished=True)


@attrs.define
class _Watch:
    local: bool = False  # the prefill side ended it at its first token: compute it here


class DecodeRole(_PDRole):
    """Admits each request on a `DecodeEngine`, registers its destination with the prefill
    worker named by the bootstrap fields, and streams it from its first token on."""

    name = "decode"

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        timeout_s: float = DEFAULT_PD_TIMEOUT_S,
        io_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(engine, timeout_s=timeout_s, io_timeout_s=io_timeout_s)

    def install(self, app: web.Application) -> None:
        super().install(app)
        app.on_cleanup.append(lambda app: self._stop_tasks())

    async def _generate(self, where, ids, params, prompt) -> AsyncIterator[RequestOutput]:
        if isinstance(where, Exception):
            raise where
        rid = where.request_id
        limit = self.engine.engine.config.max_model_len
        if min(params.max_tokens, limit - len(ids)) < 2:
            # It ends with its first token: the prefill worker finishes it there without a
            # handoff, and the answer the client gets is computed here.
            async for out in self._local(rid, ids, params, prompt):
                yield out
            return
        items, destination = await self._admit(rid, ids, params, prompt)
        watch = _Watch()
        async with contextlib.aclosing(items):
            try:
                rendezvous = await Rendezvous.open(
                    where.host,
                    where.port,
                    where.room,
                    where.index,
                    destination.as_dict(),
                    timeout_s=self.io_timeout_s,
                )
            except BootstrapError as exc:
                await self._abort_waiting(rid, str(exc), writer_gone=True)
                yield await _final(items)
                return
            watcher = asyncio.ensure_future(self._watch(rid, rendezvous, destination, watch))
            self._tasks.add(watcher)
            watcher.add_done_callback(self._tasks.discard)
            ended = False
            try:
                async for out in items:
                    ended = out.finished
                    if ended and watch.local:
                        break
                    yield out
            finally:
                if not ended and not watcher.done():
                    # The client left before the handoff ended: give the room up.
                    watcher.cancel()
                    self._spawn(self._give_up(rid, rendezvous, destination))
        if watch.local:
            async for out in self._local(rid, ids, params, prompt):
                yield out

    async def _local(self, rid, ids, params, prompt) -> AsyncIterator[RequestOutput]:
        local = self.engine.generate(f"{rid}-local", ids, params, prompt)
        async with contextlib.aclosing(local):
            async for out in local:
                yield out

    async def _admit(self, rid, ids, params, prompt) -> tuple[AsyncIterator, Destination]:
        """Admit the request (its destination allocated), retrying while there is no room."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            items = self.engine.submit(
                rid, lambda engine: engine.admit(rid, ids, params, prompt=prompt)
            )
            try:
                destination = await anext(items)
            except BaseException:
                await items.aclose()
                raise
            if destination is not None:
                return items, destination
            await items.aclose()
            if loop.time() >= deadline:
                raise ApiError(
                    503,
                    f"the decode worker had no room for this request for {self.timeout_s:g} s",
                    code="decode_full",
                )
            await asyncio.sleep(_ADMIT_RETRY_S)

    async def _abort_waiting(self, rid: Hashable, reason: str, *, writer_gone: bool) -> None:
        """Abort the request if it still waits for its transfer (not once it decodes)."""

        def abort(engine) -> None:
            if rid in engine.waiting():
                engine.abort(rid, reason, writer_gone=writer_gone)

        await self.engine.run_exclusive(abort)

    async def _watch(self, rid, rendezvous: Rendezvous, destination, watch: _Watch) -> None:
        """The prefill side's outcome: "sent" (the arrival follows through the transport), or
        the end of the request here (computed locally when it ended at its first token)."""
        bound = destination.deadline + self.engine.engine.grace_s - time.time() + 5.0
        outcome = await rendezvous.outcome(bound)
        kind = outcome["type"]
        if kind == "sent":
            return
        if kind == "finished":
            watch.local = True
            why = "the prefill worker ended it at its first token (computed here)"
        else:
            why = f"the prefill worker's handoff {kind}: {outcome.get('error')}"
        # After any answer the prefill side's write has ended, or never started; a lost
        # connection leaves the destination fenced until its deadline and grace.
        await self._abort_waiting(rid, why, writer_gone=kind != "lost")
        if kind == "lost":
            await self._free_when_fence_ends(destination)

    async def _give_up(self, rid, rendezvous: Rendezvous, destination: Destination) -> None:
        """The client left while the request waited for its transfer (its abort already
        fenced the destination): cancel the room, and once the prefill side answers (its write,
        if any, has ended) free the destination."""
        rendezvous.cancel()
        outcome = await rendezvous.outcome(self.io_timeout_s + SEND_BOUND_S)
        if outcome["type"] == "lost":
            await self._free_when_fence_ends(destination)
            return
        reason = "its client went away"
        await self.engine.run_exclusive(lambda engine: engine.abort(rid, reason, writer_gone=True))

    async def _free_when_fence_ends(self, destination: Destination) -> None:
        """A fenced destination is freed by the engine's first look past its deadline and
        grace: make sure one comes, even if no request keeps the engine stepping then."""
        grace = self.engine.engine.grace_s
        await asyncio.sleep(max(destination.deadline + grace - time.time(), 0.0) + 0.1)
        await self.engine.run_exclusive(lambda engine: engine.poll_transfers())
