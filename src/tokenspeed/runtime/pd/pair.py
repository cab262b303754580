"""`PDPair`: a prefill engine and a decode engine driven as one engine, in one process.

What a P/D gateway does, without HTTP: every request is prefilled on the prefill engine,
admitted on the decode engine once held (retried while the decode side has no room), sent, and
decoded there. The pair offers the `Engine` calls a driver uses (`add_request`, `step`,
`has_unfinished`, `abort`, `metrics`, `check_integrity`, `close`), so the AgentX replay
(`runtime/agentx_replay.py`, `tokenspeed bench agentx --pd`) runs through P/D as it runs through
one engine: on a machine with two GPUs, prefill on one and decode on the other.

Request ids: the handoff takes str or int ids, so the pair gives each request a wire id of its
own and reports outputs under the caller's id (any hashable). Metrics: TTFT and the prefix hit
rate are the prefill side's (where the prompt was computed), inter-token latency spans the
first token (prefill side) to the last (decode side): `metrics` folds them per request.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import attrs

from ..metrics import EngineMetrics
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .decode import DecodeEngine
from .prefill import PrefillEngine


class PDPair:
    """`prefill` and `decode`: the two engines (same model and page size), closed with the
    pair. `poll_s`: how long a step sleeps when only transfers are in flight (so that a driver
    stepping in a loop does not spin)."""

    def __init__(self, prefill: PrefillEngine, decode: DecodeEngine, poll_s: float = 0.001):
        if prefill.config.page_size != decode.config.page_size:
            raise ValueError(
                f"the engines' page sizes differ ({prefill.config.page_size} vs "
                f"{decode.config.page_size}): a handoff moves whole pages"
            )
        self.prefill = prefill
        self.decode = decode
        self.poll_s = poll_s
        self.metrics = EngineMetrics()
        self._wire: dict[Hashable, str] = {}  # caller's id -> wire id
        self._caller: dict[str, Hashable] = {}
        self._args: dict[str, tuple] = {}  # wire id -> (prompt, params), for admit
        self._first: dict[str, object] = {}  # wire id -> the prefill side's RequestMetrics
        self._dest: dict[str, object] = {}
        self._sent: dict[str, object] = {}
        self._count = 0

    @property
    def config(self):
        """The prefill engine's `EngineConfig` (max_model_len: a request's limit)."""
        return self.prefill.config

    @property
    def model(self):
        return self.prefill.model

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        session: Hashable | None = None,
    ) -> None:
        """Queue a request on the prefill engine (RequestError as `Engine.add_request`)."""
        if request_id in self._wire:
            raise ValueError(f"request id {request_id!r} is already in use")
        wire = f"pd{self._count}"
        params = params or SamplingParams()
        self.prefill.add_request(wire, prompt_token_ids, params, prompt=prompt, session=session)
        self._count += 1
        self._wire[request_id], self._caller[wire] = wire, request_id
        self._args[wire] = (list(prompt_token_ids), params)

    def has_unfinished(self) -> bool:
        return bool(self._wire)

    def abort(self, request_id: Hashable, reason: str = "aborted by the caller") -> bool:
        wire = self._wire.get(request_id)
        if wire is None:
            return False
        on_prefill = self.prefill.abort(wire, reason)
        on_decode = self.decode.abort(wire, reason)
        return on_prefill or on_decode

    def step(self) -> list[RequestOutput]:
        """One step of each engine, with the admissions and sends between them; returns the
        outputs of requests that finished (on either side), under the caller's ids."""
        finished: list[RequestOutput] = []
        for out in self.prefill.step():
            wire = out.request_id
            if wire not in self._first and out.metrics.first_token_time is not None:
                self._first[wire] = out.metrics
                m = out.metrics
                self.metrics.record_admission(len(out.prompt_token_ids), m.cached_tokens)
                self.metrics.record_ttft(m.first_token_time - m.arrival_time)
            if out.finished:  # ended with its first token, or aborted before its transfer
                finished.append(self._finish(out))
        busy = self.prefill.scheduler.has_work or self.decode.scheduler.has_work
        for wire in self.prefill.held():
            sent = self._sent.get(wire)
            if sent is not None:
                if sent.done() and sent.exception() is not None:
                    # Still held after a failed write: nothing will move it; its abort is
                    # reported by the prefill engine's next step.
                    self.prefill.abort(wire, f"transfer failed: {sent.exception()}")
                continue
            if self._dest.get(wire) is None:
                self._dest[wire] = self.decode.admit(wire, *self._args[wire])
            if self._dest[wire] is not None:
                self._sent[wire] = self.prefill.send(wire, self._dest[wire])
        for out in self.decode.step():
            if out.finished:
                finished.append(self._finish(out))
        if not busy and not finished and self._wire:
            time.sleep(self.poll_s)  # only transfers in flight
        return finished

    def _finish(self, out: RequestOutput) -> RequestOutput:
        wire = out.request_id
        caller = self._caller.pop(wire)
        del self._wire[caller]
        self._args.pop(wire, None)
        self._dest.pop(wire, None)
        self._sent.pop(wire, None)
        first = self._first.pop(wire, None)
        if out.outputs[0].finish_reason != "abort" and first is not None:
            self.metrics.record_finished(
                first.first_token_time, out.metrics.last_token_time, len(out.token_ids)
            )
        return attrs.evolve(out, request_id=caller)

    def check_integrity(self) -> None:
        self.prefill.check_integrity()
        self.decode.check_integrity()

    def close(self) -> None:
        try:
            self.prefill.close()
        finally:
            self.decode.close()
