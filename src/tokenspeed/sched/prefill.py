"""Prefill batch formation for one rank: a FIFO queue, chunked prefill under a token budget.

Each `schedule()` fills the budget with chunks: first the requests already part-way through their
prefill (oldest first, so long prompts keep moving), then newly admitted ones from the queue.
Admission takes the request's reusable prefix from the cache; chunk ends follow
`chunking.chunk_end`. When a prefill completes, its prompt is checkpointed and published and the
request either finishes (one-token answers), goes to the decode stage on the same rank (aggregated
mode), or stays pinned in TRANSFERRING until its transfer is done (P/D mode). Pinned requests
keep their pages; that is the backpressure from decode admission onto prefill.

Driving it (engine or simulator): `add` requests, call `schedule()`, run the batch, call
`complete(batch)`; in P/D mode call `release(req)` once the transfer has landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable

from tokenspeed.sched.batch import PrefillBatch, PrefillChunk
from tokenspeed.sched.cache_port import AdmissionError, CachePort
from tokenspeed.sched.chunking import checkpoint_positions, chunk_end
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.request import Request, RequestState

SaveState = Callable[[Request, int, int], None]
"""`save_state(request, position, slot)`: write the request's KDA state at `position` into
checkpoint slot `slot` (an engine does this from the states it copied while they were live)."""


class PrefillScheduler:
    def __init__(self, config: SchedulerConfig, cache: CachePort, *, disaggregated: bool) -> None:
        if cache.page_size != config.page_size:
            raise ValueError(
                f"cache page_size {cache.page_size} != scheduler page_size {config.page_size}"
            )
        self.config = config
        self.cache = cache
        self.disaggregated = disaggregated
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}  # admitted, prefill not complete
        self.pinned: dict[Hashable, Request] = {}  # prefill done, waiting for the transfer
        self._queued_estimate: dict[Hashable, int] = {}  # rid -> tokens expected to compute
        self._queued_total = 0  # sum of _queued_estimate
        self.aborted: list[Request] = []  # aborted by the scheduler itself; caller drains

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request; its expected work (prompt minus current prefix hit) counts at once."""
        if req.state is not RequestState.WAITING:
            raise ValueError(f"request {req.rid!r} is {req.state.value}, not waiting")
        # A second live request under one id would take the first one's estimate, and its
        # admission would fail on the cache (the id holds cache) at the head of the queue, step
        # after step: the whole rank would stop.
        if req.rid in self._queued_estimate or req.rid in self.running or req.rid in self.pinned:
            raise ValueError(f"request id {req.rid!r} is already queued or running on this rank")
        hit = self.cache.lookup(req, self._hit_limit(req))
        self._set_estimate(req.rid, req.prefill_target - hit)
        self.waiting.append(req)

    def outstanding_tokens(self) -> int:
        """Tokens still to compute here, queued requests included (the router's load signal)."""
        return self._queued_total + sum(r.prefill_remaining for r in self.running.values())

    def _set_estimate(self, rid: Hashable, tokens: int | None) -> None:
        """Set (or with None, drop) a queued request's expected work."""
        self._queued_total -= self._queued_estimate.pop(rid, 0)
        if tokens is not None:
            self._queued_estimate[rid] = tokens
            self._queued_total += tokens

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- batch formation -----------------------------------------------------------------------
    def schedule(
        self,
        *,
        budget: int | None = None,
        admit_limit: int | None = None,
        others_hold_pages: bool = False,
    ) -> PrefillBatch | None:
        """Form the next prefill forward, or None when nothing can run now.

        budget: tokens for this forward (default: the configured prefill token budget).
        admit_limit: at most this many queued requests may be admitted (an aggregated rank near
            its decode cap admits only as many as it can later decode); None for no limit.
        others_hold_pages: other users of this rank's cache (decode rows in aggregated mode) will
            free pages later, so running out of pages is a wait, not a deadlock.
        """
        if budget is None:
            budget = self.config.prefill_token_budget
        while True:
            chunks, out_of_pages = self._fill(budget, admit_limit)
            if chunks:
                return PrefillBatch(tuple(chunks))
            if not out_of_pages or self.pinned or others_hold_pages:
                return None
            self._break_deadlock()

    def _fill(self, budget: int, admit_limit: int | None) -> tuple[list[PrefillChunk], bool]:
        cfg = self.config
        chunks: list[PrefillChunk] = []
        for req in list(self.running.values()):
            if budget < cfg.page_size or len(chunks) >= cfg.max_prefill_requests:
                return chunks, False
            chunk = self._next_chunk(req, budget)
            if chunk is None:
                return chunks, True  # later requests would not fit either
            if chunk.num_tokens:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        admitted = 0
        while (
            (admit_limit is None or admitted < admit_limit)
            and self.waiting
            and budget >= cfg.page_size
            and len(chunks) < cfg.max_prefill_requests
        ):
            req = self.waiting[0]
            try:
                hit = self.cache.acquire(req, self._hit_limit(req))
            except AdmissionError as exc:
                # It holds nothing: it ends here, and the requests behind it go on.
                self.waiting.popleft()
                self._set_estimate(req.rid, None)
                req.abort(f"admission failed: {exc}")
                self.aborted.append(req)
                continue
            if hit is None:
                # No room for another live request; keep FIFO order. Out of room: on a rank
                # that nothing else holds, it never will be (schedule() aborts it then).
                return chunks, True
            req.num_computed = req.num_cached = hit
            chunk = self._next_chunk(req, budget)
            if chunk is None:
                # Not even one page for it: stay queued (at the head) rather than hold a slot.
                self.cache.release(req)
                req.num_computed = req.num_cached = 0
                return chunks, True
            self.waiting.popleft()
            self._set_estimate(req.rid, None)
            req.move(RequestState.PREFILLING)
            self.running[req.rid] = req
            admitted += 1
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks, False

    def _break_deadlock(self) -> None:
        """Nothing can run for want of pages and nothing else will free any.

        Requeue the youngest running prefill at the queue head (its computed prefix is
        published, so little work is lost); one already preempted `max_preemptions` times is
        aborted instead (its pages free up just the same). A lone request that still cannot
        grow, or a queue head that cannot even start on an otherwise idle rank (its prefix hit
        alone fills the rank), needs more pages than the rank has: it is aborted too. Aborted
        requests are left in `aborted` for the caller.
        """
        if len(self.running) > 1:
            req = self.preempt(next(reversed(self.running)))
            assert req is not None
            if req.state is RequestState.WAITING:  # else aborted (see preempt)
                self._set_estimate(req.rid, req.prefill_target)
                self.waiting.appendleft(req)
            return
        rid = next(iter(self.running)) if self.running else self.waiting[0].rid
        req = self.abort(rid, "prompt needs more device pages than the rank has")
        assert req is not None
        self.aborted.append(req)

    def _next_chunk(self, req: Request, budget: int) -> PrefillChunk | None:
        """The request's next chunk within `budget` (possibly empty), or None when out of pages."""
        cfg = self.config
        start, target = req.num_computed, req.prefill_target
        interval = cfg.checkpoint_interval_tokens
        end = chunk_end(start, target, budget, page_size=cfg.page_size, interval=interval)
        if end > start and not self.cache.reserve(req, end):
            # Take a shorter (still aligned) chunk that the free pages can hold, if any.
            room = self.cache.covered(req) + self.cache.free_pages() * cfg.page_size - start
            end = chunk_end(
                start, target, min(budget, room), page_size=cfg.page_size, interval=interval
            )
            if end <= start or not self.cache.reserve(req, end):
                return None
        ckpts = checkpoint_positions(start, end, target, page_size=cfg.page_size, interval=interval)
        return PrefillChunk(req, start, end, ckpts, is_last=end == target)

    def _hit_limit(self, req: Request) -> int:
        # At least the last token is recomputed: its forward produces the next token's logits.
        return req.prefill_target - 1

    # ---- results -------------------------------------------------------------------------------
    def complete(
        self,
        batch: PrefillBatch,
        save_state: SaveState | None = None,
        finished: Collection[Hashable] = (),
    ) -> list[Request]:
        """Record a finished forward; returns the requests whose prefill is now complete.

        Checkpoints are taken at every `chunk.checkpoints` position: from the live state at the
        chunk's end, and for positions inside the chunk into a slot handed to
        `save_state(request, position, slot)`, which must write the kernel's state at that
        position there before returning (an engine with device tensors must pass it).
        Completed requests are FINISHED (output of one token, or their rid is in `finished`: the
        first token the engine sampled was an EOS), DECODING (aggregated) or TRANSFERRING (P/D,
        pinned here until `release`), their prompt published at its last full page and their
        first output token counted.
        """
        done = []
        for chunk in batch.chunks:
            req = self.complete_chunk(chunk, save_state, finished)
            if req is not None:
                done.append(req)
        return done

    def complete_chunk(
        self,
        chunk: PrefillChunk,
        save_state: SaveState | None = None,
        finished: Collection[Hashable] = (),
    ) -> Request | None:
        """`complete` of one chunk: its request if that ended its prefill, else None. If it
        raises (a state copy failed), the request is still running here, for the caller to
        abort; chunks completed before it are done with."""
        req = chunk.request
        if req.state is not RequestState.PREFILLING or req.rid not in self.running:
            return None  # aborted while the forward ran
        page = self.config.page_size
        req.num_computed = chunk.end
        turn_end = chunk.end - chunk.end % page if chunk.is_last else -1
        for pos in chunk.checkpoints:
            live = pos == chunk.end
            slot = self.cache.checkpoint(req, pos, turn_end=pos == turn_end, from_live=live)
            if slot is not None and not live and save_state is not None:
                save_state(req, pos, slot)
        if not chunk.is_last:
            return None
        if turn_end > req.num_cached:
            self.cache.publish(req, turn_end)
        del self.running[req.rid]  # only now: had anything above raised, it is still here
        req.num_output += 1
        if req.output_remaining <= 0 or req.rid in finished:
            req.move(RequestState.FINISHED)
            self.cache.release(req)
        elif self.disaggregated:
            req.move(RequestState.TRANSFERRING)
            self.pinned[req.rid] = req
        else:
            req.move(RequestState.DECODING)
        return req

    def release(self, req: Request) -> None:
        """The transfer of a pinned request has landed on its decode rank: free it here."""
        if self.pinned.pop(req.rid, None) is None:
            raise KeyError(f"request {req.rid!r} is not pinned on this rank")
        self.cache.release(req)

    # ---- removal -------------------------------------------------------------------------------
    def abort(self, rid: Hashable, reason: str) -> Request | None:
        """Abort a request held here (queued, running or pinned) and free what it holds.

        Returns it, or None if unknown here. A request another rank already aborted is only
        removed.
        """
        req = self._remove(rid, keep_prefix=False)
        if req is not None and not req.done:
            req.abort(reason)
        return req

    def preempt(self, rid: Hashable) -> Request | None:
        """Return a running or pinned request to WAITING, publishing what it computed.

        The request is not re-queued here: the caller routes it again (any rank may take it).
        As a decode preemption, it is aborted instead and left in `aborted` when it was already
        preempted `max_preemptions` times, or when its state cannot be saved (a device copy
        failed). The deadlock guard's preemptions come through here, so they are capped too.
        """
        req = self.running.get(rid) or self.pinned.get(rid)
        if req is None:
            return None
        if req.preemptions >= self.config.max_preemptions:
            self.abort(rid, f"preempted {req.preemptions} times without finishing")
            self.aborted.append(req)
            return req
        try:
            self._remove(rid, keep_prefix=True)
        except Exception as exc:
            # _remove has released it; its progress is not saved, so it ends here.
            req.abort(f"preemption could not save its state: {exc!r}")
            self.aborted.append(req)
            return req
        req.preempt()
        return req

    def _remove(self, rid: Hashable, *, keep_prefix: bool) -> Request | None:
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                self._set_estimate(rid, None)
                return req
        req = self.running.pop(rid, None) or self.pinned.pop(rid, None)
        if req is None:
            return None
        try:
            if (
                keep_prefix
                and req.state is RequestState.PREFILLING
                and req.num_computed > req.num_cached
            ):
                # Chunk ends are page-aligned and the live state sits exactly at num_computed, so
                # the computed prefix becomes reusable with one snapshot.
                self.cache.checkpoint(req, req.num_computed, turn_end=True, from_live=True)
                self.cache.publish(req, req.num_computed)
        finally:
            # Even if the snapshot failed: the request has left every queue here, so nothing
            # else would ever release what it holds.
            self.cache.release(req)
        return req
