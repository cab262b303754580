"""`PrefillEngine`: an engine that runs prefills only and hands each request on to a decoder.

    p = PrefillEngine(model, tokenizer, config)          # a transport of its own by default
    p.add_request("a", prompt_ids, params)
    while "a" not in p.held():                           # the prefill samples the first token
        p.step()
    handoff = p.export("a")                              # what must move (and the first token)
    future = p.send("a", destination)                    # destination: DecodeEngine.admit(...)
    future.result(timeout=30)                            # written, and the decode side told
    p.step()                                             # (or p.poll_transfers()): freed here

A completed prefill is held (`RequestState.TRANSFERRING`, pinned by the prefill scheduler in
its P/D mode): its pages and its live KDA slot, the state at the prompt's end, stay as they
are until the transfer to the decode side has completed, then are released at the engine's
next step; or until the request is aborted (`abort`), which frees them, but never while a
write is still reading them (the abort then waits for the write to end). A request that ends
with its first token (max_tokens=1, a stop) finishes here as on any engine: nothing to hand
off. The engine's own outputs of a held request end with its prefill's: the first token,
not finished; the decode engine's outputs carry the request on from there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Hashable

import attrs

from tokenspeed.cache import HostCache
from tokenspeed.model import KimiForCausalLM

from ..config import EngineConfig
from ..tokenizer import Tokenizer
from .messages import Destination, FirstToken, Handoff, HandoffError, wire_id
from .side import HandoffSide
from .transport import Transport

logger = logging.getLogger("tokenspeed.runtime.pd")


@attrs.define
class TransferStats:
    """The writes of a prefill engine's sends that landed: how many, their bytes and the
    seconds the transport took for them (write calls only, one at a time on the send thread;
    the notification after each is not counted). bandwidth = bytes / seconds."""

    writes: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        self.writes += 1
        self.bytes += nbytes
        self.seconds += seconds

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second over every write (None before the first)."""
        return self.bytes / self.seconds if self.seconds > 0 else None


class PrefillEngine(HandoffSide):
    """An `Engine` whose completed prefills are held for a transfer instead of decoded.

    transport: moves the bytes (`make_transport()` by default: Mooncake when installed, else
    sockets); closed with the engine when the engine made it.
    transport_host: the address the default transport listens on (its endpoint's host).
    """

    def __init__(
        self,
        model: KimiForCausalLM,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        l2: HostCache | None = None,
        *,
        transport: Transport | None = None,
        transport_host: str = "127.0.0.1",
    ) -> None:
        super().__init__(
            model, tokenizer, config, l2, transport=transport, transport_host=transport_host
        )
        # The prefill scheduler's P/D mode: a completed prefill stays pinned (TRANSFERRING)
        # until `release`, and never joins this rank's decode rows.
        self.scheduler.prefill.disaggregated = True
        self._sender = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenspeed-pd-send"
        )
        self._sending: dict[Hashable, concurrent.futures.Future] = {}
        # Destinations sent to (rid, address, deadline) until they expire: each is written
        # once. After a failed send the decode side frees it, so a second write could land in
        # pages another request has taken since.
        self._spent: dict[tuple, float] = {}
        self._abort_after_send: dict[Hashable, str] = {}
        self.transfer_stats = TransferStats()

    # ------------------------------------------------------------------ the held requests
    def held(self) -> list[Hashable]:
        """Requests prefilled and held for their transfer, oldest first."""
        return list(self.scheduler.prefill.pinned)

    def _held_request(self, request_id: Hashable):
        req = self.scheduler.prefill.pinned.get(request_id)
        if req is None or request_id in self._abort_after_send:
            record = self._records.get(request_id)
            state = "unknown here" if record is None else "not held for a transfer"
            if record is not None and record.finish_reason is not None:
                state = f"finished ({record.finish_reason}) on the prefill side"
            raise HandoffError(f"request {request_id!r} is {state}")
        return req

    def export(self, request_id: Hashable) -> Handoff:
        """What must move for a held request: its first token, and where its cache is (the
        pages holding the prompt's MLA rows, the live slot holding its KDA state at the
        prompt's end; `Handoff.ranges(destination)` gives the byte ranges). Raises
        HandoffError when the request is not held."""
        req = self._held_request(request_id)
        record = self._records[request_id]
        n = req.prompt_len
        extent = self.cache.export_extent(self.port.handle(request_id), n)
        first = FirstToken(
            token=record.output_ids[0],
            logprob=record.logprobs[0] if record.logprobs else None,
            top_logprobs=record.top_logprobs[0] if record.top_logprobs else None,
        )
        return Handoff(
            request_id=wire_id(request_id),
            num_tokens=n,
            first=first,
            layout=self.layout,
            extent=extent,
        )

    def send(
        self, request_id: Hashable, destination: Destination
    ) -> concurrent.futures.Future[None]:
        """Move a held request to `destination` (from the decode engine's `admit`): its byte
        ranges are written through the transport, then the decode side is notified, with the
        first token. Returns a future that completes when both are done, or raises
        HandoffError. Until the future is done the request stays held; afterwards the engine's
        next step (or `poll_transfers`) frees it on success, and keeps it held on failure (send
        it elsewhere, or abort it)."""
        if request_id in self._sending:
            raise HandoffError(f"request {request_id!r} is already being sent")
        handoff = self.export(request_id)
        ranges = handoff.ranges(destination)
        now = time.time()
        if now >= destination.deadline:
            raise HandoffError(
                f"the destination of request {request_id!r} expired before its transfer started"
            )
        self._spent = {k: t for k, t in self._spent.items() if t > now}
        key = (handoff.request_id, destination.endpoint.get("address"), destination.deadline)
        if key in self._spent:
            raise HandoffError(
                f"request {request_id!r} was already sent to this destination; a destination "
                "takes one write (admit the request again for another)"
            )
        self._spent[key] = destination.deadline
        future = self._sender.submit(self._transfer, handoff, destination, ranges)
        self._sending[request_id] = future
        return future

    def _transfer(self, handoff: Handoff, destination: Destination, ranges) -> None:
        """On the sender thread: write, then notify ("arrived", or "failed" best effort)."""
        peer, rid = destination.endpoint, handoff.request_id
        try:
            if time.time() >= destination.deadline:  # queued behind another send meanwhile
                raise HandoffError(f"the destination of request {rid!r} expired before its write")
            start = time.perf_counter()
            self.transport.write(peer, rid, ranges)
            self.transfer_stats.record(sum(r.nbytes for r in ranges), time.perf_counter() - start)
        except BaseException as exc:
            try:
                self.transport.notify(peer, {"type": "failed", "rid": rid, "error": str(exc)})
            except HandoffError as gone:
                logger.warning("request %r: could not report the failed write: %s", rid, gone)
            raise
        self.transport.notify(
            peer, {"type": "arrived", "rid": rid, "first": handoff.first.as_dict()}
        )

    def poll_transfers(self) -> list[tuple[Hashable, BaseException | None]]:
        """Settle the sends that ended: a request sent is freed; one whose send failed stays
        held (unless aborted meanwhile: then it is freed now). Returns (request id, error or
        None) for each. The engine calls this at the start of every step."""
        settled = []
        for rid, future in list(self._sending.items()):
            if not future.done():
                continue
            del self._sending[rid]
            error = future.exception()
            reason = self._abort_after_send.pop(rid, None)
            if reason is not None:
                self.scheduler.abort(rid, reason)  # its outcome was reported at the abort
            elif error is None:
                self.release(rid)
            else:
                logger.warning("request %r: transfer failed: %s", rid, error)
            settled.append((rid, error))
        return settled

    def release(self, request_id: Hashable) -> None:
        """The held request's transfer is done: free its cache here and forget it. (`send`
        does this itself; call it after moving the bytes by other means.)"""
        if request_id in self._sending:
            raise HandoffError(f"request {request_id!r} is still being sent")
        req = self._held_request(request_id)
        self.scheduler.prefill.release(req)
        self._records.pop(request_id, None)
        self.keeper.forget(request_id)
        self.sampler.forget(request_id)

    @property
    def transfers_in_flight(self) -> int:
        return len(self._sending)

    def only_transfers_pending(self) -> bool:
        """Settle the sends that ended (`poll_transfers`); then whether a step would do nothing:
        no prefill to run, no output to report, every unfinished request held for its transfer
        (a driver may wait and ask again instead of stepping; `AsyncEngine` does)."""
        self.poll_transfers()
        return not self._aborted and not self.scheduler.has_work

    # ------------------------------------------------------------------ engine overrides
    def plan_step(self):
        self.poll_transfers()
        return super().plan_step()

    def abort(self, request_id: Hashable, reason: str = "aborted by the caller") -> bool:
        """As `Engine.abort`; a held request being sent is reported aborted at once, and its
        cache freed once the write has ended (the transfer may still have delivered it)."""
        future = self._sending.get(request_id)
        record = self._records.get(request_id)
        if future is None or record is None or record.finish_reason is not None:
            return super().abort(request_id, reason)
        self._abort_after_send[request_id] = reason
        record.finish("abort", abort_reason=reason)
        self._aborted.append(record)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the sends in flight (they read this engine's memory), then close."""
        _, pending = concurrent.futures.wait(list(self._sending.values()), timeout=timeout_s)
        if pending:
            logger.warning("closing with %d P/D sends still running", len(pending))
        self._sender.shutdown(wait=not pending)
        super().close()
