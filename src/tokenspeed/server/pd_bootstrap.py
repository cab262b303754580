"""The P/D bootstrap rendezvous: how a decode worker's `Destination` reaches the prefill worker
that computes the same request.

The gateway (`smg --pd-disaggregation`) sends each request to a prefill worker and a decode worker
at once, with `bootstrap_host` / `bootstrap_port` (the prefill worker's rendezvous, as registered
with the gateway) and `bootstrap_room` (random, one per prompt). The prefill worker runs a
`BootstrapServer` there. The decode worker, once it has admitted the request, opens a
`Rendezvous`: it connects, registers the room's destination, and keeps the connection until the
prefill side says how the handoff ended. Either side may come first: a registration waits for its
request on the prefill side, and a prefilled request waits for its registration, each for at most
`timeout_s`; a completion k of n of a prompt is room (bootstrap_room, k).

Messages, each way: a 4-byte big-endian length, then a JSON object.

    D -> P  {"type": "register", "room": R, "index": k, "destination": {...}}
    P -> D  {"type": "registered"}                       at once (or the outcome, if known)
    D -> P  {"type": "cancel"}                           optional: the decode side gave up
    P -> D  the outcome, then P closes the connection:
            {"type": "sent"}             written and notified: the arrival is on its way
            {"type": "finished"}         the request ended on P with its first token (a stop, or
                                         max_tokens 1): nothing is sent, D computes it itself
            {"type": "aborted", "error"} ended on P before any write (aborted, refused, expired,
                                         a cancel): nothing was written, nothing will be
            {"type": "failed", "error"}  the write failed; it has ended

A decode side that disconnects before the outcome counts as a cancel. Every read has a timeout
(`io_timeout_s` for a message that is due, the room's lifetime for the outcome); a peer that
sends something else than this protocol loses its connection, nothing more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import struct
from collections.abc import Awaitable, Callable

logger = logging.getLogger("tokenspeed.server")

_LEN = struct.Struct("!I")
MAX_MESSAGE_BYTES = 4 << 20  # a Destination is a few KB (its page ids)
OUTCOMES = ("sent", "finished", "aborted", "failed")
SEND_BOUND_S = 60.0  # longer than any send runs (the transport's timeouts bound it)

Key = tuple[int, int]  # (bootstrap_room, completion index within the prompt)


class BootstrapError(RuntimeError):
    """The rendezvous failed: the peer is unreachable, silent, gone, or broke the protocol."""


def encode(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return _LEN.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, timeout_s: float) -> dict | None:
    """The next message, or None when the peer closed the connection. Raises TimeoutError past
    `timeout_s`, BootstrapError on a malformed message."""
    async with asyncio.timeout(timeout_s):
        try:
            head = await reader.readexactly(_LEN.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise BootstrapError("the peer closed the connection mid-message") from None
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE_BYTES:
            raise BootstrapError(f"a message of {n} bytes is too large")
        try:
            body = await reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise BootstrapError("the peer closed the connection mid-message") from None
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise BootstrapError(f"a message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise BootstrapError("a message must be a JSON object")
    return message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------- the prefill side
class Registration:
    """A decode side's registration of one room: its destination (JSON, for `Destination`),
    and the connection its outcome goes back on (`reply`)."""

    def __init__(self, key: Key, destination: dict, writer: asyncio.StreamWriter) -> None:
        self.key = key
        self.destination = destination
        self.taken = False  # a prefilled request took it: the outcome is that request's
        self.cancelled = False  # the decode side gave up (a cancel, or its connection dropped)
        self.replied = asyncio.Event()
        self._writer = writer

    def reply(self, outcome: dict) -> None:
        """Send the outcome and close (once; later calls do nothing)."""
        if self.replied.is_set():
            return
        self.replied.set()
        with contextlib.suppress(Exception):  # the decode side may be gone: nobody to tell
            self._writer.write(encode(outcome))
        self._writer.close()


class _Room:
    def __init__(self, expires: float) -> None:
        self.expires = expires  # event loop time
        self.registration: Registration | None = None
        self.waiter: asyncio.Future | None = None  # a prefilled request waiting (`take`)
        self.outcome: dict | None = None  # the request ended without a handoff: the answer
        self.cancelled = False  # the decode side gave up before any request took it


class BootstrapServer:
    """The prefill worker's rendezvous (an asyncio TCP server on `host:port`, port 0: a free one).

    timeout_s: how long a room waits for its other half (a registration for its request, a
        prefilled request for its registration, an answer for a late registration).
    on_cancel: awaited with a room's key when its decode side gives up on a registration that a
        request has taken (abort that request: its send, if running, then fails or lands).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float,
        io_timeout_s: float = 10.0,
        on_cancel: Callable[[Key], Awaitable[None]] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout_s = float(timeout_s)
        self.io_timeout_s = float(io_timeout_s)
        self.on_cancel = on_cancel
        self._rooms: dict[Key, _Room] = {}
        self._ended: collections.deque[tuple[float, Key]] = collections.deque()  # for expiry
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def rooms_open(self) -> int:
        """Rooms holding a registration, a waiting request or an answer (for tests, metrics)."""
        self._expire()
        return len(self._rooms)

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, backlog=1024, limit=MAX_MESSAGE_BYTES
            )
        except OSError as exc:
            from .config import ServerConfigError

            raise ServerConfigError(
                f"cannot listen for P/D bootstrap on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("P/D bootstrap (prefill side) listening on %s:%d", self.host, self.port)

    async def close(self) -> None:
        """Stop listening; every registration still open is answered "aborted"."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for room in self._rooms.values():
            if room.registration is not None:
                room.registration.reply(_aborted("the prefill worker is shutting down"))
            if room.waiter is not None and not room.waiter.done():
                room.waiter.set_exception(BootstrapError("the prefill worker is shutting down"))
        self._rooms.clear()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # ---- the prefill role's calls
    def cancelled(self, key: Key) -> bool:
        """Whether the decode side gave up on this room before its request came."""
        room = self._rooms.get(key)
        return room is not None and room.cancelled

    async def take(self, key: Key, timeout_s: float | None = None) -> Registration:
        """The registration of a prefilled request's room: at once when it came first, else when
        it comes. Raises TimeoutError past `timeout_s` (default: the server's), BootstrapError
        when the room is taken already or was given up."""
        self._expire()
        loop = asyncio.get_running_loop()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = _Room(loop.time() + timeout_s)
        if room.cancelled:
            raise BootstrapError(f"the decode worker gave up on room {key}")
        if (
            room.outcome is not None
            or room.waiter is not None
            or (room.registration is not None and room.registration.taken)
        ):
            raise BootstrapError(f"room {key} is in use by another request")
        reg = room.registration
        if reg is not None:
            reg.taken = True
            return reg
        room.waiter = waiter = loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiter)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return waiter.result()  # came just as the wait ended
            raise
        finally:
            if self._rooms.get(key) is room:
                room.waiter = None
                if room.registration is None or not room.registration.taken:
                    del self._rooms[key]

    def end(self, key: Key, outcome: dict) -> None:
        """The room's request ended on the prefill side without a handoff (at its first token,
        aborted, refused): a registration, now or within `timeout_s`, is answered `outcome`."""
        self._expire()
        room = self._rooms.get(key)
        if room is not None and room.registration is not None:
            room.registration.reply(outcome)
            del self._rooms[key]
            return
        if room is not None and room.cancelled:
            return  # the decode side has its answer
        if room is None:
            room = self._rooms[key] = _Room(0.0)
        room.outcome = outcome
        room.expires = asyncio.get_running_loop().time() + self.timeout_s
        self._ended.append((room.expires, key))

    def _expire(self) -> None:
        """Forget the answers kept for registrations that did not come in time."""
        if not self._ended:
            return
        now = asyncio.get_running_loop().time()
        while self._ended and self._ended[0][0] <= now:
            _, key = self._ended.popleft()
            room = self._rooms.get(key)
            if (
                room is not None
                and room.registration is None
                and room.waiter is None
                and (room.expires <= now)
            ):
                del self._rooms[key]

    # ---- one decode side's connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        reg = None
        try:
            reg = await self._register(reader, writer)
            if reg is not None:
                await self._watch(reg, reader)
        except asyncio.CancelledError:
            pass
        except (BootstrapError, TimeoutError, OSError) as exc:
            logger.warning("P/D bootstrap connection dropped: %r", exc)
        except Exception as exc:
            logger.error("P/D bootstrap connection failed: %r", exc, exc_info=exc)
        finally:
            self._handlers.discard(task)
            if reg is None or not reg.replied.is_set():
                writer.close()

    async def _register(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Registration | None:
        message = await read_message(reader, self.io_timeout_s)
        if message is None:  # a probe (the gateway checks that this port accepts connections)
            return None
        room_id, index = message.get("room"), message.get("index")
        destination = message.get("destination")
        if (
            message.get("type") != "register"
            or not _is_int(room_id)
            or not _is_int(index)
            or not isinstance(destination, dict)
        ):
            writer.write(encode({"type": "error", "error": "expected a register message"}))
            return None
        key = (room_id, index)
        self._expire()
        room = self._rooms.get(key)
        if room is not None and room.outcome is not None:
            writer.write(encode(room.outcome))  # its request ended here already
            del self._rooms[key]
            return None
        if room is not None and (room.registration is not None or room.cancelled):
            writer.write(encode({"type": "error", "error": f"room {key} is registered already"}))
            return None
        loop = asyncio.get_running_loop()
        if room is None:
            room = self._rooms[key] = _Room(loop.time() + self.timeout_s)
        reg = room.registration = Registration(key, destination, writer)
        writer.write(encode({"type": "registered"}))
        if room.waiter is not None and not room.waiter.done():
            reg.taken = True
            room.waiter.set_result(reg)
        return reg

    async def _watch(self, reg: Registration, reader: asyncio.StreamReader) -> None:
        """Until the outcome is sent: read the decode side's cancel (or see it disconnect), and
        answer a registration no request took within the room's lifetime. A taken one is
        answered by its request (bounded: `SEND_BOUND_S` at most, else "aborted" here)."""
        loop = asyncio.get_running_loop()
        room = self._rooms[reg.key]
        read: asyncio.Future | None = asyncio.ensure_future(
            read_message(reader, self.timeout_s + 2 * SEND_BOUND_S)
        )
        done = asyncio.ensure_future(reg.replied.wait())
        answer_by = None  # once taken: when its request must have answered
        try:
            while not reg.replied.is_set():
                now = loop.time()
                if reg.taken:
                    answer_by = now + SEND_BOUND_S if answer_by is None else answer_by
                    bound = answer_by - now
                    if bound <= 0:
                        reg.reply(_aborted("the prefill worker did not finish the handoff in time"))
                        break
                else:
                    bound = room.expires - now
                    if bound <= 0:
                        reg.reply(_aborted(f"no request for room {reg.key} came in time"))
                        break
                waits = {done} if read is None else {read, done}
                finished, _ = await asyncio.wait(
                    waits, timeout=bound, return_when=asyncio.FIRST_COMPLETED
                )
                if read is not None and read in finished:
                    try:
                        message = read.result()
                    except (BootstrapError, TimeoutError, OSError):
                        message = None
                    read = None
                    if message is not None and message.get("type") != "cancel":
                        read = asyncio.ensure_future(
                            read_message(reader, self.timeout_s + 2 * SEND_BOUND_S)
                        )
                        continue  # nothing this side acts on
                    await self._cancel(reg)  # a cancel, or the decode side is gone
        finally:
            if read is not None:
                read.cancel()
            done.cancel()
            if self._rooms.get(reg.key) is room and not room.cancelled:
                del self._rooms[reg.key]

    async def _cancel(self, reg: Registration) -> None:
        """The decode side gave up (a cancel, or its connection dropped)."""
        reg.cancelled = True
        if not reg.taken:
            # No request took it, so nothing runs for it here: answer now, and refuse a request
            # that comes for the room later (for the room's lifetime).
            room = self._rooms.get(reg.key)
            if room is not None:
                room.cancelled = True
                room.registration = None
                room.expires = asyncio.get_running_loop().time() + self.timeout_s
                self._ended.append((room.expires, reg.key))
            reg.reply(_aborted("cancelled by the decode side"))
            return
        if self.on_cancel is not None:
            try:
                await self.on_cancel(reg.key)
            except Exception as exc:
                logger.error("P/D bootstrap: cancelling room %s failed: %r", reg.key, exc)


def _aborted(error: str) -> dict:
    return {"type": "aborted", "error": error}


# -------------------------------------------------------------------------- the decode side
class Rendezvous:
    """The decode side's end of one room: `open` registers the destination, `outcome` waits
    for the prefill side's answer, `cancel` gives up, `close` drops the connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: dict | None,
        address: str,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.known: dict | None = outcome  # the outcome, once read
        self.address = address

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        room: int,
        index: int,
        destination: dict,
        *,
        timeout_s: float,
    ) -> Rendezvous:
        """Connect to the prefill worker's rendezvous and register the room's destination.
        Raises BootstrapError (unreachable, silent, refused) within `timeout_s`."""
        address = f"{host}:{port}"
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port, limit=MAX_MESSAGE_BYTES)
        except (OSError, TimeoutError) as exc:
            raise BootstrapError(
                f"cannot reach the prefill worker's bootstrap at {address}: {exc!r}"
            ) from None
        try:
            message = {"type": "register", "room": room, "index": index, "destination": destination}
            writer.write(encode(message))
            async with asyncio.timeout(timeout_s):
                await writer.drain()
            reply = await read_message(reader, timeout_s)
        except (OSError, TimeoutError, BootstrapError) as exc:
            writer.close()
            raise BootstrapError(
                f"registering room {room} at the prefill worker's bootstrap {address}: {exc!r}"
            ) from None
        if reply is None or reply.get("type") not in ("registered", *OUTCOMES):
            writer.close()
            why = "closed the connection" if reply is None else f"answered {reply!r}"
            raise BootstrapError(f"the prefill worker's bootstrap at {address} {why}")
        known = reply if reply["type"] in OUTCOMES else None
        if known is not None:
            writer.close()
        return cls(reader, writer, known, address)

    async def outcome(self, timeout_s: float) -> dict:
        """The prefill side's answer; {"type": "lost", "error": ...} when its connection broke
        or nothing came within `timeout_s` (a write may then still be landing)."""
        if self.known is not None:
            return self.known
        try:
            message = await read_message(self._reader, max(timeout_s, 0.0))
        except TimeoutError:
            message = {"type": "lost", "error": f"no answer within {timeout_s:.0f} s"}
        except (BootstrapError, OSError) as exc:
            message = {"type": "lost", "error": repr(exc)}
        if message is None:
            message = {"type": "lost", "error": "the prefill worker closed the connection"}
        elif message.get("type") not in OUTCOMES:
            message = {"type": "lost", "error": f"unexpected answer {message!r}"}
        self.known = message
        self.close()
        return message

    def cancel(self) -> None:
        """Tell the prefill side this request is given up (best effort; the outcome follows)."""
        if self.known is None and not self._writer.is_closing():
            with contextlib.suppress(Exception):
                self._writer.write(encode({"type": "cancel"}))

    def close(self) -> None:
        self._writer.close()
