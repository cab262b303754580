"""Aggregated cluster: every rank prefills and decodes, chunked prefill riding on decode steps.

The router places each turn on the rank with the least outstanding prefill work (or by
conversation affinity). A rank's forward holds its decode rows plus prefill chunks within the
token budget; the first token of a request comes out of its last prefill chunk. With no prefill
pending a rank runs several decode steps per event, cut short when a new request arrives.
"""

from __future__ import annotations

from tokenspeed.sched import Request, RequestState, Router, RouterConfig
from tokenspeed.sim.cluster.config import ClusterConfig
from tokenspeed.sim.cluster.event_loop import EventLoop
from tokenspeed.sim.cluster.ranks import AggregatedRank, build_cache
from tokenspeed.sim.cost import CostModel
from tokenspeed.workload import SessionSource


class AggregatedSimulator(EventLoop):
    def __init__(
        self, config: ClusterConfig, workload: SessionSource, cost: CostModel, **kw
    ) -> None:
        super().__init__(config, workload, cost, **kw)
        tiers = self.host_tiers
        self.agg = [
            AggregatedRank(i, build_cache(config, config.decode_live_requests, tiers[i]), config)
            for i in range(config.prefill_ranks)
        ]
        self.router = Router(
            RouterConfig(num_prefill_ranks=config.prefill_ranks, policy=config.routing)
        )

    @property
    def ranks(self):
        return self.agg

    def _admit_request(self, req: Request) -> None:
        r = self.router.pick_prefill([a.sched.outstanding_tokens() for a in self.agg], req.session)
        req.prefill_rank = req.decode_rank = r
        rank = self.agg[r]
        rank.sched.add(req)
        self._kick(rank)

    def _kick(self, rank: AggregatedRank) -> None:
        if rank.busy:
            self.cut_run(rank, self._done)
            return
        plan = rank.sched.schedule(max_decode_steps=self.config.max_decode_steps)
        self._drain(rank)
        if plan.empty:
            return
        load_bytes = 0
        spans = []
        if plan.prefill is not None:
            rank.admitted.intersection_update(rank.sched.prefill.running)  # drop requeued ones
            for chunk in plan.prefill.chunks:
                req = chunk.request
                spans.append((chunk.start, chunk.end))
                if req.rid not in rank.admitted:  # first chunk of this admission
                    load_bytes += self._record_admission(rank, req)
        ends, total = [], 0.0
        if plan.decode is not None:
            ends = self._decode_run_ends(plan.decode)
            total = ends[-1]
        if spans:
            # A mixed forward: the prefill chunks ride on the (single) decode step.
            total += max(self.cost.prefill_time(spans), self.cost.load_time(load_bytes))
            ends = [total]
        rank.plan, rank.busy, rank.start, rank.ends = plan, True, self.now, ends
        rank.steps = len(ends)
        rank.epoch += 1
        self.at(self.now + total, self._done, (rank, rank.epoch))

    def _done(self, arg: tuple[AggregatedRank, int]) -> None:
        rank, epoch = arg
        if epoch != rank.epoch:
            return
        rank.busy = False
        plan = rank.plan
        if plan.decode is not None:
            self._count_decode(plan.decode.size, rank.ends, rank.steps)
        finished = rank.sched.complete(plan, decode_steps=rank.steps)
        if plan.prefill is not None:
            for chunk in plan.prefill.chunks:
                req = chunk.request
                if chunk.is_last and req.state in (RequestState.DECODING, RequestState.FINISHED):
                    rank.admitted.discard(req.rid)
                    rec = self.records[req.rid]
                    rec.prefill_end = self.now
                    if rec.first_token is None:
                        rec.first_token = self.now
        for req in finished:
            self._finished(req)
        rank.plan = None
        self._kick(rank)

    def _drain(self, rank: AggregatedRank) -> None:
        for req in rank.sched.take_aborted():
            rank.admitted.discard(req.rid)
            self._aborted(req)
        for req in rank.sched.take_preempted():
            rank.admitted.discard(req.rid)
            self.at(self.now, self._admit_request, req)
