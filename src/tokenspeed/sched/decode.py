"""Continuous decode batching for one rank, with P/D decode admission and preemption.

P/D mode: `add` queues a request for decode admission as soon as it is routed (independent of its
prefill); `admit_pending` reserves destination pages FIFO while they last; `start` joins a request
whose transfer has landed. Aggregated mode: `start` joins a request straight out of prefill.

Each `schedule` takes the running requests (join order, up to the largest graph size), makes sure
each has pages for the steps ahead and pads the batch to a captured size. When a row cannot get a
page, the youngest rows are preempted (their prefix checkpointed and published, pages released)
and left in `preempted` for the caller to route again. At a request's end its history up to the
last full page is checkpointed and published, so the conversation's next turn reuses it; the
engine keeps each row's state at its latest page boundary for that snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Hashable

from tokenspeed.sched.batch import DecodeBatch, pad_batch_size
from tokenspeed.sched.cache_port import AdmissionError, CachePort
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.prefill import SaveState
from tokenspeed.sched.request import Request, RequestState
from tokenspeed.sched.router import DecodeLoad


class DecodeScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CachePort,
        *,
        disaggregated: bool,
        save_state_on_preempt: SaveState | None = None,
    ) -> None:
        """save_state_on_preempt: writes a preempted row's kept state into its turn-end
        checkpoint slot (preemption happens inside `schedule`, which has no `save_state`
        argument); None (a simulator without device state): such checkpoints stay unwritten."""
        if cache.page_size != config.page_size:
            raise ValueError(
                f"cache page_size {cache.page_size} != scheduler page_size {config.page_size}"
            )
        self.config = config
        self.cache = cache
        self.disaggregated = disaggregated
        self.pending: deque[Request] = deque()  # P/D: waiting for destination pages
        self.admitted: dict[Hashable, Request] = {}  # P/D: pages reserved, transfer not landed
        self.running: dict[Hashable, Request] = {}  # decoding, in join order
        self.preempted: list[Request] = []  # back in WAITING; the caller routes them again
        self.aborted: list[Request] = []  # aborted by the scheduler itself; the caller drains
        self._joined_at: dict[Hashable, int] = {}  # rid -> cached tokens when it joined
        self.save_state_on_preempt = save_state_on_preempt

    # ---- admission (P/D) ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a routed request for decode admission; its prefill may run meanwhile."""
        if not self.disaggregated:
            raise RuntimeError("decode admission is a P/D step; aggregated ranks call start()")
        # As for prefill: a duplicate id would fail admission at the head of the queue forever.
        if (
            req.rid in self.running
            or req.rid in self.admitted
            or any(r.rid == req.rid for r in self.pending)
        ):
            raise ValueError(f"request id {req.rid!r} is already queued or running on this rank")
        self.pending.append(req)

    def admit_pending(self) -> list[Request]:
        """Reserve destination pages for queued requests, oldest first, while they fit."""
        admitted = []
        while self.pending:
            if len(self.running) + len(self.admitted) >= self.config.max_decode_batch:
                break
            req = self.pending[0]
            try:
                fits = self._try_admit(req)
            except AdmissionError as exc:
                # It holds nothing here: it ends, and the requests behind it go on.
                self.pending.popleft()
                req.abort(f"admission failed: {exc}")
                self.aborted.append(req)
                continue
            if not fits:
                if self.running or self.admitted:
                    break  # wait for pages to free up
                # Nothing else holds this rank's pages, so the request can never fit here.
                self.pending.popleft()
                req.abort("needs more device pages than the decode rank has")
                self.aborted.append(req)
                continue
            self.pending.popleft()
            self.admitted[req.rid] = req
            admitted.append(req)
        return admitted

    def _try_admit(self, req: Request) -> bool:
        need = -(-req.prefill_target // self.config.page_size) + self.config.decode_reserve_pages
        if self.cache.free_pages() < need or self.cache.acquire(req, 0) is None:
            return False
        if not self.cache.reserve(req, req.prefill_target):
            self.cache.release(req)
            return False
        return True

    def is_admitted(self, rid: Hashable) -> bool:
        return rid in self.admitted

    # ---- joining -------------------------------------------------------------------------------
    def start(self, req: Request) -> None:
        """Join the running batch: the request's cache for its whole sequence is on this rank."""
        if self.disaggregated:
            if req.rid not in self.admitted:
                raise KeyError(f"request {req.rid!r} was not admitted on this decode rank")
            # Before leaving `admitted`: a request that ended meanwhile raises here and keeps its
            # reservation where abort() finds it.
            req.move(RequestState.DECODING)
            del self.admitted[req.rid]
        elif req.state is not RequestState.DECODING:
            raise ValueError(f"request {req.rid!r} is {req.state.value}, not decoding")
        # The last output token is the next step's input; its KV is not written yet.
        req.num_computed = req.seq_len - 1
        self.running[req.rid] = req
        self._joined_at[req.rid] = req.num_computed

    def load(self) -> DecodeLoad:
        busy = len(self.running) + len(self.admitted) + len(self.pending)
        return DecodeLoad(busy, self.cache.free_pages())

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    # ---- batch formation -----------------------------------------------------------------------
    def schedule(
        self, max_steps: int = 1, *, others_hold_pages: bool = False
    ) -> DecodeBatch | None:
        """The next decode batch, with pages reserved for `batch.steps` (<= max_steps) steps.

        others_hold_pages: other users of this rank's cache (prefills in aggregated mode) hold
            pages, so a lone row that cannot grow is preempted, not aborted as too long.
        """
        if max_steps <= 0:
            raise ValueError("max_steps must be positive")
        rows = list(self.running.values())[: self.config.max_decode_batch]
        while rows:
            steps = min(max_steps, min(r.max_new_tokens - r.num_output for r in rows))
            fit = self._reserve(rows, steps)
            if fit > 0:
                return DecodeBatch(
                    tuple(rows), pad_batch_size(len(rows), self.config.decode_batch_sizes), fit
                )
            victim = rows.pop()  # the youngest row makes room for the older ones
            if rows or len(self.running) > 1 or self.admitted or others_hold_pages:
                self._preempt(victim)
            else:
                self._abort_here(victim, "sequence outgrew the rank's device cache")
        return None

    def _reserve(self, rows: list[Request], steps: int) -> int:
        """Reserve pages for `steps` steps of every row; returns the steps all rows can take."""
        reserve = self.cache.reserve  # answers True at once when the pages are there already
        fit = steps
        for req in rows:
            if not reserve(req, req.num_computed + steps):
                fit = min(fit, self.cache.covered(req) - req.num_computed)
        if fit < steps:
            # Some row got fewer pages; the steps every row can take is what the batch runs.
            fit = min(self.cache.covered(r) - r.num_computed for r in rows)
        return max(fit, 0)

    # ---- results -------------------------------------------------------------------------------
    def complete(
        self,
        batch: DecodeBatch,
        steps: int = 1,
        finished: Collection[Hashable] = (),
        save_state: SaveState | None = None,
        *,
        live_state: bool = True,
    ) -> list[Request]:
        """Record `steps` completed steps of `batch`; returns the requests that finished.

        A row finishes at its max_new_tokens or, when its rid is in `finished`, after the last of
        these steps (an EOS the engine sampled). Rows no longer running (aborted or preempted
        while the step ran) are skipped, recognised by the request object: a new request under a
        reused id is not one of this batch's rows. A finishing row's history is checkpointed at its
        last full page; unless the live state is exactly there, the checkpoint slot goes to
        `save_state(request, position, slot)`, which writes the state the engine kept when the
        row last crossed a page boundary. live_state=False: the rows' live states may be past
        these steps (an engine that ran more steps of the batch before reporting them), so the
        checkpoint always comes from `save_state`.
        """
        if not 0 < steps <= batch.steps:
            raise ValueError(f"steps must be in 1..{batch.steps}, got {steps}")
        done = []
        running = self.running
        for req in batch.requests:
            # By identity, not id: a row aborted while the step ran may have a successor under
            # the same id (added and started meanwhile), which this step did not advance.
            if running.get(req.rid) is not req:
                continue  # aborted or preempted while the step ran
            req.num_computed += steps
            req.num_output += steps
            if req.num_output >= req.max_new_tokens or req.rid in finished:
                self._publish_history(req, save_state, live_state)
                # Only now: if publishing raised, the request is still here to be aborted.
                del running[req.rid]
                self.cache.release(req)
                req.move(RequestState.FINISHED)
                done.append(req)
        return done

    def _publish_history(
        self, req: Request, save_state: SaveState | None, live_state: bool = True
    ) -> None:
        """Checkpoint and publish up to the last full page, if decoding completed a page."""
        page = self.config.page_size
        joined = self._joined_at.pop(req.rid)
        end = req.num_computed - req.num_computed % page
        if end > joined - joined % page:
            live = live_state and end == req.num_computed
            slot = self.cache.checkpoint(req, end, turn_end=True, from_live=live)
            if slot is not None and not live and save_state is not None:
                save_state(req, end, slot)
            self.cache.publish(req, end)

    # ---- removal -------------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        if req.preemptions >= self.config.max_preemptions:
            self._abort_here(req, f"preempted {req.preemptions} times without finishing")
            return
        try:
            self._publish_history(req, self.save_state_on_preempt)
        except Exception as exc:  # e.g. the device copy of its state failed
            # Its progress is not saved, so it cannot resume: it ends here, and the batch goes on.
            self._abort_here(req, f"preemption could not save its state: {exc!r}")
            return
        del self.running[req.rid]
        self.cache.release(req)
        req.preempt()
        self.preempted.append(req)

    def _abort_here(self, req: Request, reason: str) -> None:
        del self.running[req.rid]
        self._joined_at.pop(req.rid, None)
        self.cache.release(req)
        req.abort(reason)
        self.aborted.append(req)

    def preempt(self, rid: Hashable) -> Request | None:
        """Preempt a running request on the caller's behalf (it lands in `preempted`)."""
        req = self.running.get(rid)
        if req is not None:
            self._preempt(req)
        return req

    def abort(self, rid: Hashable, reason: str) -> Request | None:
        """Drop whatever this rank holds for `rid`; a decoding request becomes ABORTED.

        A request still pending or admitted here is in its prefill stage: its lifecycle belongs to
        the prefill side, so only the reservation is dropped and the caller aborts it there (or
        it already ended there). Returns the request, or None when nothing was held.
        """
        for i, req in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                return req
        req = self.admitted.pop(rid, None)
        if req is not None:
            self.cache.release(req)
            return req
        req = self.running.pop(rid, None)
        if req is not None:
            self._joined_at.pop(rid, None)
            self.cache.release(req)
            if not req.done:
                req.abort(reason)
        return req
