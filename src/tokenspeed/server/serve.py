"""Run the app on a socket until SIGTERM / SIGINT, then shut down gracefully.

Shutdown: stop admitting (new calls get 503, /health says "shutting_down"), close the listening
socket, abort every request still running (a non-streaming call answers 503; a stream gets an
error event and `data: [DONE]`), let the handlers finish (at most `shutdown_timeout_s`), close
the role. The engine itself is the caller's to close.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

from aiohttp import web

from .admission import Admission
from .app import build_app
from .config import ServerConfig, ServerConfigError
from .role import Role
from .served_model import ServedModel
from .state import ServerState

logger = logging.getLogger("tokenspeed.server")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one, chosen now). ServerConfigError when the
    address cannot be bound (in use, not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise ServerConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def serve(
    role: Role,
    model: ServedModel,
    config: ServerConfig,
    *,
    announce: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
    shutdown_timeout_s: float = 5.0,
) -> None:
    """Serve until SIGTERM or SIGINT (or `stop` is set). `announce` gets one line naming the URL
    once the socket listens: "serving MODEL on http://HOST:PORT"."""
    state = ServerState(role, model, config, Admission(config.max_pending))
    app = build_app(state)
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    sock = listen(config.host, config.port)
    await runner.setup()
    host, port = sock.getsockname()[:2]
    site = web.SockSite(runner, sock)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    try:
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        await site.start()
        shown = f"[{host}]" if ":" in host else host
        announce(f"serving {model.name} on http://{shown}:{port} (role {role.name})")
        await stop.wait()
        logger.info("shutting down: no new requests; aborting the ones in flight")
    finally:
        state.admission.closed = True
        await site.stop()  # no new connections
        await role.close()  # in-flight requests end aborted; their handlers answer
        await runner.cleanup()
        for sig in signals:
            loop.remove_signal_handler(sig)
