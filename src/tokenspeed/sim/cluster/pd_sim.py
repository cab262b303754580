"""P/D cluster: prefill ranks and decode ranks, each a real scheduler over a real cache.

Flow of one request (docs/design.md, "One request's life"): the router picks a prefill rank (least
outstanding prefill work, or conversation affinity) and a decode rank (load); the `TransferGate`
decides whether the prefill is queued at once (independent admission) or after the decode rank has
reserved the destination (coupled). The transfer of KV pages and KDA state starts once both are
done, serialized on the decode rank's inbound link; until then the finished prefill stays pinned on
its prefill rank. When the transfer lands the prefill rank releases the request and it joins
the decode batch at the next step boundary. The first token reaches the client then.

Decode ranks advance several steps per event while their batch is unchanged (the scheduler
reserves the pages for all of them); a request that lands mid-run cuts the run at the step that
is in flight, exactly where a real engine would let it join.
"""

from __future__ import annotations

from tokenspeed.sched import (
    DecodeLoad,
    Request,
    RequestState,
    Router,
    RouterConfig,
    TransferGate,
)
from tokenspeed.sim.cluster.config import ClusterConfig
from tokenspeed.sim.cluster.event_loop import EventLoop
from tokenspeed.sim.cluster.ranks import DecodeRank, PrefillRank, build_cache
from tokenspeed.sim.cost import CostModel
from tokenspeed.workload import SessionSource


class PDSimulator(EventLoop):
    def __init__(
        self, config: ClusterConfig, workload: SessionSource, cost: CostModel, **kw
    ) -> None:
        super().__init__(config, workload, cost, **kw)
        tiers = self.host_tiers
        self.prefill = [
            PrefillRank(i, build_cache(config, config.prefill_live_requests, tiers[i]), config)
            for i in range(config.prefill_ranks)
        ]
        self.decode = [
            DecodeRank(
                i,
                build_cache(
                    config,
                    config.decode_live_requests,
                    tiers[config.prefill_ranks + i],
                    decode=True,
                ),
                config,
            )
            for i in range(config.decode_ranks)
        ]
        self.router = Router(
            RouterConfig(
                num_prefill_ranks=config.prefill_ranks,
                num_decode_ranks=config.decode_ranks,
                policy=config.routing,
            )
        )
        self.gate = TransferGate(config.admission)
        # What the router compares, per rank, kept between arrivals: every arrival needs all of
        # them, but only the ranks something happened on since the last one can have moved. A
        # rank is marked stale right after any scheduler call on it (`_prefill_moved`,
        # `_decode_moved`) and asked again at the next pick, so the router sees exactly the
        # values it would get by asking every rank.
        self._prefill_work = [0] * config.prefill_ranks
        self._decode_loads = [DecodeLoad(0, 0)] * config.decode_ranks
        self._stale_prefill = set(range(config.prefill_ranks))
        self._stale_decode = set(range(config.decode_ranks))

    @property
    def ranks(self):
        return self.prefill + self.decode

    # ---- routing ------------------------------------------------------------------------------
    def _admit_request(self, req: Request) -> None:
        for i in self._stale_prefill:
            self._prefill_work[i] = self.prefill[i].sched.outstanding_tokens()
        self._stale_prefill.clear()
        for i in self._stale_decode:
            self._decode_loads[i] = self.decode[i].sched.load()
        self._stale_decode.clear()
        p = self.router.pick_prefill(self._prefill_work, req.session)
        d = self.router.pick_decode(self._decode_loads)
        req.prefill_rank, req.decode_rank = p, d
        if self.gate.on_route(req.rid):
            self._queue_prefill(req)
        self.decode[d].sched.add(req)
        self._decode_moved(self.decode[d])
        self._admit_decode(self.decode[d])

    def _prefill_moved(self, rank: PrefillRank) -> None:
        """A scheduler call on `rank` may have changed its outstanding work."""
        self._stale_prefill.add(rank.idx)

    def _decode_moved(self, rank: DecodeRank) -> None:
        """A scheduler call on `rank` may have changed its load (queues or free pages)."""
        self._stale_decode.add(rank.idx)

    def _queue_prefill(self, req: Request) -> None:
        rank = self.prefill[req.prefill_rank]
        rank.sched.add(req)
        self._prefill_moved(rank)
        self._kick_prefill(rank)

    # ---- prefill ranks ------------------------------------------------------------------------
    def _kick_prefill(self, rank: PrefillRank) -> None:
        if rank.busy:
            return
        batch = rank.sched.schedule()
        self._prefill_moved(rank)
        self._drain_prefill_aborts(rank)
        if batch is None:
            return
        load_bytes = 0
        rank.admitted.intersection_update(rank.sched.running)  # drop requeued ones
        for chunk in batch.chunks:
            req = chunk.request
            if req.rid not in rank.admitted:  # first chunk of this admission
                load_bytes += self._record_admission(rank, req)
        spans = [(c.start, c.end) for c in batch.chunks]
        dt = max(self.cost.prefill_time(spans), self.cost.load_time(load_bytes))
        rank.batch, rank.busy = batch, True
        self.at(self.now + dt, self._prefill_done, rank)

    def _prefill_done(self, rank: PrefillRank) -> None:
        rank.busy = False
        done = rank.sched.complete(rank.batch)
        self._prefill_moved(rank)
        for req in done:
            rank.admitted.discard(req.rid)
            self.records[req.rid].prefill_end = self.now
            if req.state is RequestState.FINISHED:  # a one-token answer
                self.records[req.rid].first_token = self.now
                self._drop_decode_side(req)
                self._finished(req)
            elif self.gate.on_prefill_done(req.rid):
                self._start_transfer(req)
        rank.batch = None
        self._kick_prefill(rank)

    def _drain_prefill_aborts(self, rank: PrefillRank) -> None:
        while rank.sched.aborted:
            self._abort_everywhere(rank.sched.aborted.pop())

    def _abort_everywhere(self, req: Request) -> None:
        """A scheduler aborted `req`: free what the other stage holds, then report it."""
        self.gate.forget(req.rid)
        prefill, decode = self.prefill[req.prefill_rank], self.decode[req.decode_rank]
        prefill.admitted.discard(req.rid)
        prefill.sched.abort(req.rid, req.abort_reason)
        self._prefill_moved(prefill)
        decode.sched.abort(req.rid, req.abort_reason)
        self._decode_moved(decode)
        self._aborted(req)
        self.at(self.now, self._kick_prefill, prefill)
        self.at(self.now, self._kick_decode_idle, decode)

    def _drop_decode_side(self, req: Request) -> None:
        """The request will not reach decode: give back its decode reservation."""
        self.gate.forget(req.rid)
        rank = self.decode[req.decode_rank]
        held = rank.sched.abort(req.rid, req.abort_reason or "finished in prefill")
        self._decode_moved(rank)
        if held is not None:
            self._admit_decode(rank)

    # ---- transfer -----------------------------------------------------------------------------
    def _start_transfer(self, req: Request) -> None:
        rank = self.decode[req.decode_rank]
        self.records[req.rid].transfer_start = self.now
        start = max(self.now, rank.link_free)
        nbytes = req.prefill_target * self._bytes_per_token + self._state_bytes
        rank.link_free = start + self.cost.transfer_time(int(nbytes))
        self.at(rank.link_free, self._transfer_done, req)

    def _transfer_done(self, req: Request) -> None:
        prefill = self.prefill[req.prefill_rank]
        prefill.sched.release(req)
        self._prefill_moved(prefill)
        rec = self.records[req.rid]
        if rec.first_token is None:
            rec.first_token = self.now
        decode = self.decode[req.decode_rank]
        decode.sched.start(req)
        self._decode_moved(decode)
        self._kick_decode(decode)
        self._kick_prefill(prefill)  # its pages are free now

    # ---- decode ranks -------------------------------------------------------------------------
    def _admit_decode(self, rank: DecodeRank) -> None:
        admitted = rank.sched.admit_pending()
        self._decode_moved(rank)
        while rank.sched.aborted:  # requests that can never fit on this decode rank
            self._abort_everywhere(rank.sched.aborted.pop())
        for req in admitted:
            rec = self.records[req.rid]
            if rec.decode_admitted is None:
                rec.decode_admitted = self.now
            queue_prefill, transfer = self.gate.on_decode_admitted(req.rid)
            if queue_prefill:
                self._queue_prefill(req)
            if transfer:
                self._start_transfer(req)

    def _kick_decode(self, rank: DecodeRank) -> None:
        if rank.busy:
            self.cut_run(rank, self._decode_done)
            return
        batch = rank.sched.schedule(max_steps=self.config.max_decode_steps)
        self._decode_moved(rank)
        self._drain_decode_side_effects(rank)
        if batch is None:
            return
        ends = self._decode_run_ends(batch)
        total = ends[-1]
        rank.batch, rank.busy, rank.start, rank.ends = batch, True, self.now, ends
        rank.steps = batch.steps
        rank.epoch += 1
        self.at(self.now + total, self._decode_done, (rank, rank.epoch))

    def _kick_decode_idle(self, rank: DecodeRank) -> None:
        self._admit_decode(rank)
        if not rank.busy:
            self._kick_decode(rank)

    def _decode_done(self, arg: tuple[DecodeRank, int]) -> None:
        rank, epoch = arg
        if epoch != rank.epoch:
            return  # superseded by a cut
        rank.busy = False
        self._count_decode(rank.batch.size, rank.ends, rank.steps)
        done = rank.sched.complete(rank.batch, rank.steps)
        self._decode_moved(rank)
        for req in done:
            self._finished(req)
        rank.batch = None
        self._admit_decode(rank)
        self._kick_decode(rank)

    def _drain_decode_side_effects(self, rank: DecodeRank) -> None:
        sched = rank.sched
        while sched.aborted:
            self._abort_everywhere(sched.aborted.pop())
        while sched.preempted:
            req = sched.preempted.pop()
            self.gate.forget(req.rid)
            self._admit_request(req)  # back through the router, like a new arrival
        self._admit_decode(rank)
