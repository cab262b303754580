"""Moving a request's cache bytes from a prefill engine to a decode engine, then telling it.

One interface, `Transport`, two ways to move the bytes:

- `MooncakeTransport`: Mooncake's transfer engine (`mooncake.engine.TransferEngine`). Each side
  registers its device tier; the prefill side writes the byte ranges one-sidedly into the
  decode side's registered memory (`batch_transfer_sync_write`), over TCP (`protocol="tcp"`,
  what a CPU machine has) or RDMA (`protocol="rdma"`, `device_name` the NICs) where present.
  Metadata goes peer to peer (`P2PHANDSHAKE`): no metadata server, no etcd.
- `SocketTransport` (the base class itself), the fallback where the package is missing: the
  bytes go over a plain TCP connection to the decode side's listener, which checks each range
  against its regions and receives it in place.

Every transport runs a listener: a TCP server on a port the OS picks, one thread per
connection, one message per connection, each answered. After writing, the prefill side sends
"arrived" (with the first token) or "failed"; the decode side acks, or refuses a request it no
longer waits for. The socket fallback's data goes to the same listener, so a socket sender can
reach any decode side. Every connect, read and write is bounded by `timeout_s`; a peer that is
gone (refused, reset, silent) raises `HandoffError` naming it. A Mooncake write cannot be
abandoned once started: Mooncake bounds it itself (`MC_TRANSFER_TIMEOUT`, set to `timeout_s`
unless already set; a handshake with a peer that accepts but never answers takes up to 60 s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from tokenspeed.cache.handoff import ByteRange

from .messages import HandoffError

logger = logging.getLogger("tokenspeed.runtime.pd")

_LEN = struct.Struct("!I")
_MAX_HEADER = 64 << 20


# ---------------------------------------------------------------------------------- framing
def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def _send_msg(conn: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    conn.sendall(_LEN.pack(len(body)) + body)


def _recv_msg(conn: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"message of {n} bytes is too large")
    message = json.loads(_recv_exact(conn, n))
    if not isinstance(message, dict):
        raise ConnectionError("a message must be a JSON object")
    return message


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes, for a socket (copied to the host first if on a device)."""
    return memoryview((t if t.device.type == "cpu" else t.cpu()).numpy())


def _recv_into(conn: socket.socket, t: torch.Tensor) -> None:
    """Receive exactly t.numel() bytes into the uint8 tensor `t` (in place on the host)."""
    host = t if t.device.type == "cpu" else torch.empty(t.numel(), dtype=torch.uint8)
    view, got, n = memoryview(host.numpy()), 0, t.numel()
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        got += k
    if host is not t:
        t.copy_(host)


class _Listener:
    """A TCP server: each connection brings one message, handed with the connection to
    `handle`, whose returned dict is the reply."""

    def __init__(
        self, host: str, handle: Callable[[dict, socket.socket], dict], timeout_s: float
    ) -> None:
        self._handle = handle
        self._timeout = timeout_s
        self._server = socket.create_server((host, 0), backlog=64)
        self._server.settimeout(0.2)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"tokenspeed-pd-listen-{self.address}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._timeout)
            try:
                message = _recv_msg(conn)
                reply = self._handle(message, conn)
            except Exception as exc:  # a bad or broken message costs its connection only
                logger.warning("P/D listener %s: %r", self.address, exc)
                reply = {"ok": False, "error": repr(exc)}
            with contextlib.suppress(OSError):
                _send_msg(conn, reply)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        self._thread.join(timeout=5.0)


# -------------------------------------------------------------------------------- transports
class Transport:
    """The socket transport, and the interface every transport has.

    Decode side: `register` its regions, `set_acceptor` (which request ids it waits for), hand
    out `endpoint()` in its destinations, and drain `arrivals()` (the notifications received:
    dicts with "type" "arrived" or "failed", "rid", and "first" / "error"). Prefill side:
    `register` its regions, then per request `write` the byte ranges into a peer's endpoint and
    `notify` it. `close` stops the listener (the caller first makes sure no write is running).
    """

    kind = "socket"

    def __init__(self, host: str = "127.0.0.1", *, timeout_s: float = 30.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.host = host
        self.timeout_s = float(timeout_s)
        self._regions: dict[str, torch.Tensor] = {}
        self._arrivals: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._accepts: Callable[[Hashable], str | None] = lambda rid: "no request is awaited here"
        self._listener = _Listener(host, self._on_message, self.timeout_s)

    @property
    def address(self) -> str:
        """host:port of this side's listener (notifications, and the socket fallback's data)."""
        return self._listener.address

    def register(self, regions: Mapping[str, torch.Tensor]) -> None:
        """This side's device-tier regions (flat uint8 tensors: `device_regions`), which writes
        read from (prefill side) or land in (decode side)."""
        for name, t in regions.items():
            if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"region {name!r} must be a flat contiguous uint8 tensor")
        self._regions = dict(regions)

    def set_acceptor(self, accepts: Callable[[Hashable], str | None]) -> None:
        """Decode side: `accepts(rid)` is None while `rid` waits for its transfer, else why it
        does not (called on the listener's threads: it must only read)."""
        self._accepts = accepts

    def endpoint(self) -> dict:
        """How a prefill side reaches this one (JSON values; goes in a `Destination`)."""
        return {"kind": self.kind, "address": self.address}

    def arrivals(self) -> list[dict]:
        """The notifications received since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._arrivals.get_nowait())
            except queue.Empty:
                return out

    # ---- prefill side
    def write(self, peer: dict, rid: str | int, ranges: Sequence[ByteRange]) -> None:
        """Write `ranges` from this side's regions into the peer's (its `endpoint()`); returns
        once all have landed. Raises HandoffError (the bytes may be partly written)."""
        self._check_src(ranges)
        address = peer["address"]
        header = {
            "type": "data",
            "rid": rid,
            "ranges": [[r.region, r.dst_offset, r.nbytes] for r in ranges],
        }
        with self._connect(address, "write") as conn:
            try:
                _send_msg(conn, header)
                go = _recv_msg(conn)
                if not go.get("ok"):
                    raise HandoffError(
                        f"decode side at {address} refused request {rid!r}: {go.get('error')}"
                    )
                for r in ranges:
                    conn.sendall(_host_bytes(self._regions[r.region][_span(r, "src")]))
                done = _recv_msg(conn)
            except (OSError, ConnectionError, ValueError) as exc:
                raise self._peer_error(address, f"writing request {rid!r}", exc) from exc
        if not done.get("ok"):
            raise HandoffError(
                f"decode side at {address} failed to take request {rid!r}: {done.get('error')}"
            )

    def notify(self, peer: dict, message: dict) -> None:
        """Send one notification ("arrived" / "failed") to the peer's listener and wait for
        its ack. Raises HandoffError when the peer is gone or refuses it."""
        address = peer["address"]
        with self._connect(address, "notify") as conn:
            try:
                _send_msg(conn, message)
                reply = _recv_msg(conn)
            except (OSError, ConnectionError, ValueError) as exc:
                what = f"notifying request {message.get('rid')!r}"
                raise self._peer_error(address, what, exc) from exc
        if not reply.get("ok"):
            raise HandoffError(
                f"decode side at {address} refused the notification of request "
                f"{message.get('rid')!r}: {reply.get('error')}"
            )

    def close(self) -> None:
        self._listener.close()

    # ---- helpers
    def _connect(self, address: str, doing: str) -> socket.socket:
        try:
            conn = socket.create_connection(_split(address), timeout=self.timeout_s)
        except (OSError, ValueError) as exc:
            raise self._peer_error(address, doing, exc) from exc
        conn.settimeout(self.timeout_s)
        return conn

    def _peer_error(self, address: str, doing: str, exc: BaseException) -> HandoffError:
        if isinstance(exc, TimeoutError):
            why = f"did not answer within {self.timeout_s:g} s"
        elif isinstance(exc, ConnectionRefusedError):
            why = "is gone (connection refused)"
        else:
            why = f"is gone or broke the connection ({exc!r})"
        return HandoffError(f"{doing}: the peer at {address} {why}")

    def _check_src(self, ranges: Sequence[ByteRange]) -> None:
        sizes = {k: v.numel() for k, v in self._regions.items()}
        for r in ranges:
            size = sizes.get(r.region)
            if size is None or r.src_offset < 0 or r.src_offset + r.nbytes > size:
                raise HandoffError(f"{r} lies outside this side's region {r.region!r}")

    def _on_message(self, message: dict, conn: socket.socket) -> dict:
        kind, rid = message.get("type"), message.get("rid")
        why = self._accepts(rid)
        if kind in ("arrived", "failed"):
            # Queued even when refused: either way the write has ended, so the decode side
            # may free a destination it kept for it.
            self._arrivals.put(message)
            return {"ok": True} if why is None or kind == "failed" else {"ok": False, "error": why}
        if why is not None:
            return {"ok": False, "error": why}
        if kind == "data":
            return self._receive(message, conn)
        return {"ok": False, "error": f"unknown message type {kind!r}"}

    def _receive(self, message: dict, conn: socket.socket) -> dict:
        """The socket fallback's data: check every range, say go, receive them in place."""
        ranges = [ByteRange(region, 0, offset, n) for region, offset, n in message["ranges"]]
        sizes = {k: v.numel() for k, v in self._regions.items()}
        for r in ranges:
            size = sizes.get(r.region)
            if size is None or r.dst_offset < 0 or r.nbytes <= 0 or r.dst_offset + r.nbytes > size:
                return {"ok": False, "error": f"{r} lies outside region {r.region!r}"}
        _send_msg(conn, {"ok": True})
        for r in ranges:
            _recv_into(conn, self._regions[r.region][_span(r, "dst")])
        return {"ok": True}


SocketTransport = Transport


def _span(r: ByteRange, side: str) -> slice:
    offset = r.src_offset if side == "src" else r.dst_offset
    return slice(offset, offset + r.nbytes)


class MooncakeTransport(Transport):
    """Mooncake's transfer engine: one-sided writes into the decode side's registered memory.

    protocol: "tcp", or "rdma" with `device_name` the RDMA NICs to use ("" lets Mooncake
    pick). metadata_server: "P2PHANDSHAKE" (peers exchange segment metadata directly), or an
    HTTP metadata server / etcd address. Writes go in batches of at most `max_batch` ranges.
    A peer whose endpoint is not a Mooncake one (a socket-only decode side) is written to
    through its listener instead.
    """

    kind = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        timeout_s: float = 30.0,
        max_batch: int = 1024,
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise HandoffError(
                f"Mooncake's transfer engine is not installed ({exc}); use SocketTransport"
            ) from exc
        super().__init__(host, timeout_s=timeout_s)
        # Mooncake reads its transfer timeout from the environment when the engine starts.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, math.ceil(timeout_s))))
        self.protocol = protocol
        self.max_batch = max_batch
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, metadata_server, protocol, device_name)
        if rc != 0:
            self._listener.close()
            raise HandoffError(
                f"Mooncake transfer engine did not start on {host} ({protocol}, metadata "
                f"{metadata_server}): status {rc}"
            )
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, regions: Mapping[str, torch.Tensor]) -> None:
        if any(t.device.type != "cpu" for t in regions.values()) and not _mooncake_gpu():
            raise HandoffError(
                "this Mooncake build cannot reach device memory (no GPU support); install its "
                "CUDA build, or use SocketTransport"
            )
        super().register(regions)
        for name, t in self._regions.items():
            rc = self._engine.register_memory(t.data_ptr(), t.numel())
            if rc != 0:
                raise HandoffError(f"Mooncake could not register region {name!r}: status {rc}")
            self._registered.append(t.data_ptr())

    def endpoint(self) -> dict:
        return {
            **super().endpoint(),
            "session": self.session,
            "regions": {k: [t.data_ptr(), t.numel()] for k, t in self._regions.items()},
        }

    def write(self, peer: dict, rid: str | int, ranges: Sequence[ByteRange]) -> None:
        if peer.get("kind") != self.kind:
            super().write(peer, rid, ranges)
            return
        self._check_src(ranges)
        regions = peer["regions"]
        src, dst, lengths = [], [], []
        for r in ranges:
            base, size = regions.get(r.region, (None, 0))
            if base is None or r.dst_offset < 0 or r.dst_offset + r.nbytes > size:
                raise HandoffError(f"{r} lies outside the decode side's region {r.region!r}")
            src.append(self._regions[r.region].data_ptr() + r.src_offset)
            dst.append(base + r.dst_offset)
            lengths.append(r.nbytes)
        session = peer["session"]
        for at in range(0, len(src), self.max_batch):
            part = slice(at, at + self.max_batch)
            rc = self._engine.batch_transfer_sync_write(
                session, src[part], dst[part], lengths[part]
            )
            if rc != 0:
                raise HandoffError(
                    f"writing request {rid!r}: the Mooncake write to {session} failed (status "
                    f"{rc}): the decode side is gone, or refused the write"
                )

    def close(self) -> None:
        super().close()
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()


def _mooncake_gpu() -> bool:
    """Whether the installed Mooncake transfer engine can read and write GPU memory."""
    try:
        import mooncake.engine as engine
    except ImportError:
        return False
    return bool(getattr(engine, "SUPPORT_CUDA", False))


def make_transport(
    kind: str = "auto",
    host: str = "127.0.0.1",
    *,
    device: torch.device | str = "cpu",
    **options,
) -> Transport:
    """`kind`: "mooncake", "socket", or "auto": Mooncake when its package imports (and, for an
    engine on a GPU, `device`, when it was built with GPU support), else the socket fallback.
    `options` go to the transport's constructor."""
    if kind == "socket":
        return SocketTransport(host, **options)
    if kind == "mooncake":
        return MooncakeTransport(host, **options)
    if kind != "auto":
        raise ValueError(f"transport kind must be 'auto', 'mooncake' or 'socket', got {kind!r}")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        usable, why = False, "mooncake is not installed"
    else:
        usable = torch.device(device).type == "cpu" or _mooncake_gpu()
        why = "this mooncake build has no GPU support"
    if not usable:
        logger.info("%s: P/D transfers go over plain sockets", why)
        return SocketTransport(host, **{k: v for k, v in options.items() if k == "timeout_s"})
    return MooncakeTransport(host, **options)
