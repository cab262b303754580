"""One simulated rank = a real scheduler over a real metadata-only `CacheManager`.

The host tier is either one `LocalHostCache` shared by every rank (a shared L2) or one per rank
with the same total capacity (rank-local L2), so the two differ only in who can read what.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenspeed.cache import CacheManager, LocalHostCache
from tokenspeed.sched import AggregatedScheduler, DecodeScheduler, PrefillScheduler
from tokenspeed.sched.batch import DecodeBatch, PrefillBatch, StepPlan
from tokenspeed.sched.cache_adapter import CacheManagerPort
from tokenspeed.sim.cluster.config import ClusterConfig, L2Mode


def build_host_tiers(config: ClusterConfig) -> list[LocalHostCache | None]:
    """One entry per rank: the L2 it uses (the same object for every rank when shared)."""
    n = config.num_ranks
    if config.l2 is L2Mode.NONE or config.l2_bytes_per_rank == 0:
        return [None] * n
    if config.l2 is L2Mode.SHARED:
        shared = LocalHostCache(capacity_bytes=config.l2_bytes_per_rank * n, metadata_only=True)
        return [shared] * n
    return [
        LocalHostCache(capacity_bytes=config.l2_bytes_per_rank, metadata_only=True)
        for _ in range(n)
    ]


def build_cache(
    config: ClusterConfig, live_requests: int, l2: LocalHostCache | None, *, decode: bool = False
) -> CacheManager:
    return CacheManager(config.geometry, config.cache_config(live_requests, decode=decode), l2=l2)


class Rank:
    """State every simulated rank has: its cache, port and the forward it is running."""

    __slots__ = ("busy", "cache", "ends", "epoch", "idx", "port", "start", "steps")

    def __init__(self, idx: int, cache: CacheManager) -> None:
        self.idx = idx
        self.cache = cache
        self.port = CacheManagerPort(cache)
        self.busy = False
        self.start = 0.0  # when the running forward (or run of decode steps) began
        self.ends: Sequence[float] = ()  # cumulative end offsets of its decode steps
        self.steps = 0  # decode steps the running event will complete
        self.epoch = 0  # bumps when a pending completion event is superseded


class PrefillRank(Rank):
    __slots__ = ("admitted", "batch", "sched")

    def __init__(self, idx: int, cache: CacheManager, config: ClusterConfig) -> None:
        super().__init__(idx, cache)
        self.sched = PrefillScheduler(config.scheduler, self.port, disaggregated=True)
        self.batch: PrefillBatch | None = None
        self.admitted: set = set()  # rids whose current admission was already recorded


class DecodeRank(Rank):
    __slots__ = ("batch", "link_free", "sched")

    def __init__(self, idx: int, cache: CacheManager, config: ClusterConfig) -> None:
        super().__init__(idx, cache)
        self.sched = DecodeScheduler(config.scheduler, self.port, disaggregated=True)
        self.batch: DecodeBatch | None = None
        self.link_free = 0.0  # inbound transfers are serialized on the rank's link


class AggregatedRank(Rank):
    __slots__ = ("admitted", "plan", "sched")

    def __init__(self, idx: int, cache: CacheManager, config: ClusterConfig) -> None:
        super().__init__(idx, cache)
        self.sched = AggregatedScheduler(config.scheduler, self.port)
        self.plan: StepPlan | None = None
        self.admitted: set = set()
