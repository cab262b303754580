"""An aggregated (non-P/D) rank: prefill chunks and decode rows share every forward and one cache.

Each step puts every running decode row in the batch first (one token each), then fills what is
left of the token budget with prefill chunks (chunked prefill). A prefill that completes joins the
decode rows of the next step directly; there is no transfer. New prefills are admitted only while
decoding plus prefilling requests stay within the largest decode graph size.

When no prefill is pending the caller may ask for several decode steps at once (the simulator
does, to skip over steps in which nothing changes; an engine with multi-step decoding, to run
them without returning to the host); otherwise a plan is one forward.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

from tokenspeed.sched.batch import StepPlan
from tokenspeed.sched.cache_port import CachePort
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.decode import DecodeScheduler
from tokenspeed.sched.prefill import PrefillScheduler, SaveState
from tokenspeed.sched.request import Request, RequestState


class AggregatedScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CachePort,
        *,
        save_state_on_preempt: SaveState | None = None,
    ) -> None:
        """save_state_on_preempt: as for `DecodeScheduler` (an engine passes the same callback
        it gives `complete`)."""
        self.config = config
        self.cache = cache
        self.prefill = PrefillScheduler(config, cache, disaggregated=False)
        self.decode = DecodeScheduler(
            config, cache, disaggregated=False, save_state_on_preempt=save_state_on_preempt
        )

    def add(self, req: Request) -> None:
        # The prefill side checks its own queues; a decoding request holds cache under its id
        # too, and a duplicate's admission would fail on it at every step.
        if req.rid in self.decode.running:
            raise ValueError(f"request id {req.rid!r} is already queued or running on this rank")
        self.prefill.add(req)

    def outstanding_tokens(self) -> int:
        return self.prefill.outstanding_tokens()

    @property
    def has_work(self) -> bool:
        return self.prefill.has_work or self.decode.has_work

    def schedule(self, max_decode_steps: int = 1) -> StepPlan:
        steps = 1 if self.prefill.has_work else max_decode_steps
        decode = self.decode.schedule(max_steps=steps, others_hold_pages=bool(self.prefill.running))
        rows = decode.size if decode is not None else 0
        budget = self.config.prefill_token_budget - rows
        live = len(self.decode.running) + len(self.prefill.running)
        prefill = None
        if budget >= self.config.page_size:
            prefill = self.prefill.schedule(
                budget=budget,
                admit_limit=max(self.config.max_decode_batch - live, 0),
                others_hold_pages=bool(self.decode.running),
            )
        return StepPlan(prefill=prefill, decode=decode)

    def complete(
        self,
        plan: StepPlan,
        decode_steps: int = 1,
        finished: Collection[Hashable] = (),
        save_state: SaveState | None = None,
        *,
        live_state: bool = True,
    ) -> list[Request]:
        """Record a finished step; returns requests that finished (decode end or one-token answer).

        `decode_steps` may exceed 1 only for a decode-only plan; `live_state` as for
        `DecodeScheduler.complete`.
        """
        if plan.prefill is not None and decode_steps != 1:
            raise ValueError("a plan with prefill chunks is a single forward")
        done = []
        if plan.decode is not None:
            done.extend(
                self.decode.complete(
                    plan.decode, decode_steps, finished, save_state, live_state=live_state
                )
            )
        if plan.prefill is not None:
            # Chunk by chunk: a request whose prefill ended joins the decode batch at once, so
            # that if a later chunk's completion raises, no request is left between the two.
            for chunk in plan.prefill.chunks:
                req = self.prefill.complete_chunk(chunk, save_state, finished)
                if req is None:
                    continue
                if req.state is RequestState.DECODING:
                    self.decode.start(req)
                else:
                    done.append(req)
        return done

    def abort(self, rid: Hashable, reason: str) -> Request | None:
        return self.prefill.abort(rid, reason) or self.decode.abort(rid, reason)

    def take_preempted(self) -> list[Request]:
        """Requests preempted here (back in WAITING); the caller routes them again."""
        out, self.decode.preempted = self.decode.preempted, []
        return out

    def take_aborted(self) -> list[Request]:
        out = self.prefill.aborted + self.decode.aborted
        self.prefill.aborted, self.decode.aborted = [], []
        return out
