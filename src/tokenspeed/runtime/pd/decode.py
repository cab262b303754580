"""`DecodeEngine`: an engine that also takes requests prefilled on another engine.

    d = DecodeEngine(model, tokenizer, config)           # a transport of its own by default
    destination = d.admit("a", prompt_ids, params)       # None: no room now, try later
    ...the prefill engine writes into `destination` and notifies (PrefillEngine.send)...
    while d.has_unfinished():
        for out in d.step():                             # first the prefill's token, then more
            ...

`admit` checks the request as `add_request` does and allocates its destination as any
admission does: pages for the prompt (its own prefix hit, when it has one, stays: only the
pages past it are written) and a live KDA slot. The request then waits (TRANSFERRING) for the
prefill side's notification, which brings the first token; the engine's next step appends that
token (never sampling it; a sampler that keeps per-request state, a seeded generator, penalty
counts, min_tokens, is advanced past it as if it had sampled it), and the request joins the
decode rows exactly where a local prefill would have left it: its history is the prompt plus
the first token, its state the prompt's. Its pages become matchable here, as any decode row's,
at the first page boundary its decoding reaches (the rolling checkpoint) and at its turn end.
The engine still serves ordinary requests (`add_request`), so a later turn may run here too.

Waits are bounded: a destination carries a deadline (now + `deadline_s`) after which the
prefill side starts no write; one that nothing arrived for by the deadline plus `grace_s`
(longer than any write may run) is aborted and freed. A request aborted while it waits is
reported at once, but its destination is kept until the prefill side says its write ended (or
failed) or that same time has passed, since a one-sided write cannot be stopped from here;
`abort(..., writer_gone=True)` frees it at once when the caller knows no write will come.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import attrs
import torch

from tokenspeed.cache import HostCache
from tokenspeed.model import KimiForCausalLM
from tokenspeed.sched import Request, RequestState
from tokenspeed.sched.cache_port import AdmissionError

from ..config import EngineConfig
from ..request_record import RequestError, RequestRecord
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .messages import Destination, FirstToken, HandoffError, wire_id
from .side import HandoffSide
from .transport import Transport

logger = logging.getLogger("tokenspeed.runtime.pd")


@attrs.define(eq=False)
class _Waiting:
    request: Request
    free_at: float  # Unix time: no write can land after this


class DecodeEngine(HandoffSide):
    """An `Engine` that admits requests prefilled elsewhere (`admit`).

    transport: receives the bytes and the notifications (`make_transport()` by default);
        closed with the engine when the engine made it.
    transport_host: the address the default transport listens on (its endpoint's host).
    deadline_s: how long a destination stays valid for the prefill side to start writing.
    grace_s: how long after the deadline a write may still land (default: the transport's
        timeout plus 5 s); only then is a destination nothing arrived for freed.
    reuse_prefix: start a request from this rank's own cached prefix when it has one (only
        the pages past it are written); False: every page comes from the prefill side.
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
        deadline_s: float = 60.0,
        grace_s: float | None = None,
        reuse_prefix: bool = True,
    ) -> None:
        super().__init__(
            model, tokenizer, config, l2, transport=transport, transport_host=transport_host
        )
        self.transport.set_acceptor(self._accepts)
        self.deadline_s = float(deadline_s)
        self.grace_s = self.transport.timeout_s + 5.0 if grace_s is None else float(grace_s)
        self.reuse_prefix = reuse_prefix
        self._waiting: dict[Hashable, _Waiting] = {}  # admitted, nothing arrived yet
        self._fenced: dict[Hashable, _Waiting] = {}  # aborted while waiting, not yet freed

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        session: Hashable | None = None,
    ) -> Destination | None:
        """Take a request whose prompt another engine prefills: allocate its destination and
        return it (for that engine's `send`), or None when the cache has no room now (nothing
        is kept then). Raises RequestError (nothing kept) when the request cannot be served:
        the checks of `add_request`, an id not a str or int, or a request that ends with its
        first token (max_tokens 1: nothing to decode)."""
        params = params or SamplingParams()
        try:
            rid = wire_id(request_id)
        except HandoffError as exc:
            raise RequestError(str(exc)) from None
        if rid in self._records or rid in self._fenced or self.port.holds(rid):
            raise RequestError(f"request id {rid!r} is already in use")
        record = self._new_record(rid, prompt_token_ids, params, prompt, session)
        req, ids = record.sched, record.prompt_ids
        if req.max_new_tokens < 2:
            raise RequestError(
                f"request {rid!r} ends with its first token (max_tokens {params.max_tokens}, "
                f"{len(ids)} prompt tokens of {self.config.max_model_len}): the prefill side "
                "finishes it"
            )
        try:
            hit = self.port.acquire(req, len(ids) - 1 if self.reuse_prefix else 0)
        except AdmissionError as exc:
            raise HandoffError(f"request {rid!r}: could not set up its destination: {exc}") from exc
        if hit is None:
            return None
        try:
            if not self.port.reserve(req, len(ids)):
                self.port.release(req)
                return None
            extent = self.cache.import_extent(self.port.handle(rid), len(ids))
        except BaseException:
            if self.port.holds(rid):
                self.port.release(req)
            raise
        req.num_computed = req.num_cached = hit
        req.move(RequestState.PREFILLING)
        req.move(RequestState.TRANSFERRING)
        self.sampler.register(rid, params, ids)
        self._records[rid] = record
        deadline = time.time() + self.deadline_s
        self._waiting[rid] = _Waiting(req, deadline + self.grace_s)
        return Destination(
            request_id=rid,
            num_tokens=len(ids),
            layout=self.layout,
            extent=extent,
            endpoint=self.transport.endpoint(),
            deadline=deadline,
        )

    def waiting(self) -> list[Hashable]:
        """Requests admitted whose transfer has not arrived yet."""
        return list(self._waiting)

    @property
    def destinations_held(self) -> int:
        """Destinations still allocated for requests not decoding yet (waiting or fenced)."""
        return len(self._waiting) + len(self._fenced)

    def _accepts(self, rid: Hashable) -> str | None:
        # On the transport's listener threads: reads only.
        if rid in self._waiting:
            return None
        if rid in self._fenced:
            return f"request {rid!r} was aborted on the decode side"
        return f"request {rid!r} is not awaited on the decode side (never admitted, or expired)"

    # ------------------------------------------------------------------ arrivals
    def poll_transfers(self) -> list[Hashable]:
        """Apply the notifications received: an arrived request joins the decode rows, a
        failed one is aborted; free the destinations whose time is up. Returns the ids of the
        requests that arrived. The engine calls this at the start of every step."""
        arrived = []
        for message in self.transport.arrivals():
            rid = message.get("rid")
            fenced = self._fenced.pop(rid, None)
            if fenced is not None:
                self.port.release(fenced.request)  # its write has ended: nothing lands now
                continue
            if rid not in self._waiting:
                logger.warning("P/D notification for request %r, not awaited here", rid)
                continue
            if message.get("type") == "arrived":
                if self._arrive(rid, FirstToken.from_dict(message["first"])):
                    arrived.append(rid)
            else:
                reason = f"transfer failed on the prefill side: {message.get('error')}"
                self._end_waiting(rid, reason, writer_gone=True)
        now = time.time()
        for rid, w in list(self._waiting.items()):
            if now > w.free_at:
                self._end_waiting(rid, "its transfer did not arrive in time", writer_gone=True)
        for rid, w in list(self._fenced.items()):
            if now > w.free_at:
                del self._fenced[rid]
                self.port.release(w.request)
        return arrived

    def _arrive(self, rid: Hashable, first: FirstToken) -> bool:
        """The request's bytes are in place: append its first token and join the decode rows.
        False when it ended instead (reported at the step)."""
        req = self._waiting.pop(rid).request
        record = self._records[rid]
        if not 0 <= first.token < self.model.config.vocab_size:
            self._end(record, req, f"the prefill side sent token {first.token}, not a token id")
            return False
        record.append(first.token)
        if record.params.logprobs is not None and first.logprob is not None:
            record.logprobs.append(first.logprob)
            record.top_logprobs.append(list(first.top_logprobs or ()))
        now = time.monotonic()
        m = record.metrics
        m.first_scheduled_time = m.first_token_time = m.last_token_time = now
        m.cached_tokens = req.num_cached
        req.num_computed = req.prompt_len
        req.num_output = 1
        req.move(RequestState.DECODING)
        try:
            self._replay_first_token(record, first.token)
            reason = record.stop.check(record.output_ids)
        except Exception as exc:
            self._end(record, req, f"could not take its first token: {exc!r}")
            return False
        if reason is not None:
            # The prefill side would have finished it (same checks): finish it here as well.
            record.stop_reason = reason
            record.finish("stop")
            self.port.release(req)
            req.move(RequestState.FINISHED)
            self._aborted.append(record)  # delivered (and forgotten) at the next step
            return False
        self.scheduler.decode.start(req)
        return True

    def _replay_first_token(self, record: RequestRecord, token: int) -> None:
        """Advance the sampler's state of this request past its first token, as sampling it
        would have: sample once from logits that allow only that token (a seeded request's
        generator makes the same draws as for any logits; penalties and min_tokens count it)."""
        p = record.params
        if not (p.penalized or p.min_tokens > 0 or (p.seed is not None and not p.greedy)):
            return
        logits = torch.full((1, self.model.config.vocab_size), float("-inf"), device=self.device)
        logits[0, token] = 0.0
        got = int(self.sampler.sample(logits, [p], [record.rid]).tokens[0])
        if got != token:
            raise RuntimeError(f"the sampler replayed token {token} as {got}")

    def _end(self, record: RequestRecord, req: Request, reason: str) -> None:
        """Abort a request whose destination nobody writes any more: free it now."""
        req.abort(reason)
        record.finish("abort", abort_reason=reason)
        self.port.release(req)
        self._aborted.append(record)

    def _end_waiting(self, rid: Hashable, reason: str, *, writer_gone: bool) -> None:
        w = self._waiting.pop(rid)
        record = self._records[rid]
        if writer_gone:
            self._end(record, w.request, reason)
            return
        w.request.abort(reason)
        record.finish("abort", abort_reason=reason)
        self._aborted.append(record)
        self._fenced[rid] = w  # freed when the prefill side reports, or at w.free_at

    def only_transfers_pending(self) -> bool:
        """Apply the notifications received (`poll_transfers`); then whether a step would do
        nothing: no request to decode or prefill, no output to report, every unfinished one
        waiting for its transfer (a driver may wait and ask again instead of stepping)."""
        self.poll_transfers()
        return not self._aborted and not self.scheduler.has_work

    # ------------------------------------------------------------------ engine overrides
    def plan_step(self):
        self.poll_transfers()
        return super().plan_step()

    def abort(
        self,
        request_id: Hashable,
        reason: str = "aborted by the caller",
        *,
        writer_gone: bool = False,
    ) -> bool:
        """As `Engine.abort`. A request still waiting for its transfer is reported aborted at
        the next step; its destination is freed when the prefill side reports its write ended,
        or failed, or at its deadline plus the grace period (a write may be landing). With
        writer_gone=True (the caller knows no write was started or will be) it is freed now;
        so is the destination of one aborted earlier and still kept (returns False: it had
        ended already)."""
        if writer_gone and request_id in self._fenced:
            self.port.release(self._fenced.pop(request_id).request)
            return False
        if request_id not in self._waiting:
            return super().abort(request_id, reason)
        self._end_waiting(request_id, reason, writer_gone=writer_gone)
        return True
