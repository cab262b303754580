"""`simulate(config, workload)`: run one scenario and collect its results."""

from __future__ import annotations

import time

import attrs

from tokenspeed.cache import CacheStats, L2Stats
from tokenspeed.sim.cluster.agg_sim import AggregatedSimulator
from tokenspeed.sim.cluster.config import ClusterConfig, Mode
from tokenspeed.sim.cluster.event_loop import EventLoop, LostRequestError
from tokenspeed.sim.cluster.pd_sim import PDSimulator
from tokenspeed.sim.cluster.records import (
    RequestRecord,
    Summary,
    hit_rate_series,
    summarize,
)
from tokenspeed.sim.cost import CostModel, LinearCostModel
from tokenspeed.workload import SessionSource


@attrs.frozen(kw_only=True)
class SimResult:
    config: ClusterConfig
    workload: str
    summary: Summary
    records: tuple[RequestRecord, ...]
    hit_rate_over_time: tuple[tuple[float, float], ...]
    cache_stats: tuple[CacheStats, ...]  # per rank: prefill ranks first, then decode ranks
    l2_stats: tuple[L2Stats, ...]  # one per distinct host tier
    check_s: float = 0.0  # wall time of the final cache integrity checks
    decode_row_steps: int = 0  # decode (verify) steps run, summed over their rows

    @property
    def abort_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if r.abort_reason is not None:
                out[r.abort_reason] = out.get(r.abort_reason, 0) + 1
        return out


def build_simulator(
    config: ClusterConfig, workload: SessionSource, cost: CostModel | None = None, **kw
) -> EventLoop:
    cost = cost if cost is not None else LinearCostModel()
    cls = PDSimulator if config.mode is Mode.PD else AggregatedSimulator
    return cls(config, workload, cost, **kw)


def simulate(
    config: ClusterConfig,
    workload: SessionSource,
    cost: CostModel | None = None,
    *,
    progress: bool = False,
    check_caches: bool = True,
) -> SimResult:
    """Run the scenario to the end of its drain.

    Raises LostRequestError if any request was neither finished nor aborted with a reason (or a
    cache still holds one), and IntegrityError if a cache is inconsistent (`check_caches`: each
    rank's `check_integrity()`, which also checks its host tier; a shared `LocalHostCache` is
    walked by the first rank's check and found unchanged by the others).
    """
    sim = build_simulator(config, workload, cost, progress=progress)
    sim.run()
    started = time.perf_counter()
    for rank in sim.ranks:
        if rank.cache.stats().requests:
            raise LostRequestError(f"rank {rank.idx} still holds cache after the drain")
        if check_caches:
            rank.cache.check_integrity()
    check_s = time.perf_counter() - started
    records = tuple(sim.records.values())
    tiers = {id(t): t for t in sim.host_tiers if t is not None}
    return SimResult(
        config=config,
        workload=getattr(workload, "name", type(workload).__name__),
        summary=summarize(
            records,
            start=0.0,
            num_gpus=config.num_gpus,
            events=sim.events,
            wall_s=sim.wall_s,
            cpu_s=sim.cpu_s,
        ),
        records=records,
        hit_rate_over_time=tuple(
            hit_rate_series(records, start=0.0, bucket_s=config.hit_rate_bucket_s)
        ),
        cache_stats=tuple(r.cache.stats() for r in sim.ranks),
        l2_stats=tuple(t.stats() for t in tiers.values()),
        check_s=check_s,
        decode_row_steps=sim.decode_row_steps,
    )
