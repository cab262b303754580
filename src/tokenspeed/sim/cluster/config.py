"""The simulated cluster: its shape, memory, policies and load (frozen, validated)."""

from __future__ import annotations

import enum
import math

import attrs

from tokenspeed.cache import (
    BudgetTooSmallError,
    CacheConfig,
    CacheGeometry,
    CheckpointPolicy,
    PoolSizes,
)
from tokenspeed.model.presets import get_preset
from tokenspeed.sched import AdmissionPolicy, RoutingPolicy, SchedulerConfig

GiB = 1 << 30

# Page ids reach the attention kernels through an int32 page table (`CacheManager.page_table`):
# a rank's pool cannot have more pages than that can name.
MAX_PAGES_PER_RANK = 2**31 - 1

# Host memory of the simulator's own bookkeeping (tracemalloc, K3 geometry), rounded up: the
# basis of `ClusterConfig.bookkeeping_bytes`, which the command line checks against the machine.
PAGE_BOOKKEEPING_BYTES = 256  # one device page of a metadata-only CacheManager (200-265 B)
RANK_BOOKKEEPING_BYTES = 64 << 10  # a rank's scheduler, port and fixed-size tables
SESSION_BOOKKEEPING_BYTES = 64 << 10  # a session in flight: key chain, request (40-60 KiB)


def k3_geometry(page_size: int = 64) -> CacheGeometry:
    """Cache geometry of Kimi K3 (the `kimi-k3` model preset), bf16 rows: 24 MLA layers with a
    576-wide latent row, 69 KDA layers of 96 heads x 128 with a kernel-4 conv (about 449 MB of
    state per request)."""
    return CacheGeometry.from_model_config(get_preset("kimi-k3"), page_size=page_size)


class Mode(enum.Enum):
    PD = "pd"  # separate prefill and decode ranks, KV/state transferred between them
    AGGREGATED = "aggregated"  # every rank prefills and decodes


class L2Mode(enum.Enum):
    SHARED = "shared"  # one host tier that every rank reads and writes
    LOCAL = "local"  # one host tier per rank, same total capacity
    NONE = "none"  # device tier only


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _optional_positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not _is_int(value) or value <= 0):
        raise ValueError(f"{attribute.name} must be a positive integer or None, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _positive_seconds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} must be a finite positive number, got {value!r}")


def _optional_positive_seconds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not _is_real(value) or not 0 < value < math.inf):
        raise ValueError(
            f"{attribute.name} must be a finite positive number or None, got {value!r}"
        )


def _fraction(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_real(value) or not 0 <= value < 1:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}")


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """A scenario: cluster shape and policies, memory per rank, and the offered load.

    prefill_ranks / decode_ranks: P/D mode (each >= 1); aggregated mode uses prefill_ranks as the
        number of ranks and needs decode_ranks == 0.
    device_cache_bytes: per rank, for pages + live KDA slots + device checkpoints.
    decode_device_cache_bytes: the same for decode ranks, when it differs (None: the same).
    prefill_live_requests / decode_live_requests: live KDA slots per prefill / decode rank (each
        costs one request state of device memory); aggregated ranks use the decode figure.
    l2_bytes_per_rank: host tier per rank; SHARED pools all ranks' share into one tier.
    concurrency: sessions in flight at once (closed loop); a finished session is replaced.
    duration_s: no turn is issued after this time; what is in flight drains (and counts).
        None: run the workload to its end (finite workloads only; `simulate` refuses an
        endless one).
    max_decode_steps: decode steps the simulator may take in one event when nothing changes.
    """

    mode: Mode = attrs.field(default=Mode.PD, converter=Mode)
    prefill_ranks: int = attrs.field(default=16, validator=_non_negative_int)
    decode_ranks: int = attrs.field(default=16, validator=_non_negative_int)
    routing: RoutingPolicy = attrs.field(default=RoutingPolicy.LEAST_WORK, converter=RoutingPolicy)
    admission: AdmissionPolicy = attrs.field(
        default=AdmissionPolicy.INDEPENDENT, converter=AdmissionPolicy
    )
    l2: L2Mode = attrs.field(default=L2Mode.SHARED, converter=L2Mode)
    geometry: CacheGeometry = attrs.field(factory=k3_geometry)
    checkpoints: CheckpointPolicy = attrs.field(factory=CheckpointPolicy)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    device_cache_bytes: int = attrs.field(default=80 * GiB, validator=_positive_int)
    decode_device_cache_bytes: int | None = attrs.field(
        default=None, validator=_optional_positive_int
    )
    prefill_live_requests: int = attrs.field(default=24, validator=_positive_int)
    decode_live_requests: int = attrs.field(default=64, validator=_positive_int)
    device_checkpoint_fraction: float = attrs.field(default=0.1, validator=_fraction)
    l2_bytes_per_rank: int = attrs.field(default=512 * GiB, validator=_non_negative_int)
    concurrency: int = attrs.field(default=64, validator=_positive_int)
    duration_s: float | None = attrs.field(default=600.0, validator=_optional_positive_seconds)
    max_decode_steps: int = attrs.field(default=512, validator=_positive_int)
    hit_rate_bucket_s: float = attrs.field(default=60.0, validator=_positive_seconds)

    def __attrs_post_init__(self) -> None:
        if self.mode is Mode.PD:
            if self.prefill_ranks < 1 or self.decode_ranks < 1:
                raise ValueError(
                    f"P/D mode needs at least one prefill and one decode rank, got "
                    f"prefill_ranks={self.prefill_ranks}, decode_ranks={self.decode_ranks}"
                )
        else:
            if self.prefill_ranks < 1:
                raise ValueError(
                    f"aggregated mode needs prefill_ranks >= 1 (the number of ranks), got "
                    f"{self.prefill_ranks}"
                )
            if self.decode_ranks != 0:
                raise ValueError(
                    f"aggregated mode has no decode ranks; set decode_ranks=0 (got "
                    f"{self.decode_ranks})"
                )
        if self.scheduler.page_size != self.geometry.page_size:
            raise ValueError(
                f"scheduler.page_size ({self.scheduler.page_size}) must equal geometry.page_size "
                f"({self.geometry.page_size})"
            )
        if self.scheduler.checkpoint_interval_pages != self.checkpoints.interval_pages:
            raise ValueError(
                f"scheduler.checkpoint_interval_pages ({self.scheduler.checkpoint_interval_pages})"
                f" must equal checkpoints.interval_pages ({self.checkpoints.interval_pages})"
            )
        self._check_device_budgets()

    def _rank_kinds(self) -> list[tuple[str, int, int, bool]]:
        """(kind, number of such ranks, live KDA slots, decode) for each kind of rank."""
        if self.mode is Mode.PD:
            return [
                ("prefill", self.prefill_ranks, self.prefill_live_requests, False),
                ("decode", self.decode_ranks, self.decode_live_requests, True),
            ]
        return [("aggregated", self.prefill_ranks, self.decode_live_requests, False)]

    def _budget_field(self, decode: bool) -> str:
        if decode and self.decode_device_cache_bytes is not None:
            return "decode_device_cache_bytes"
        return "device_cache_bytes"

    def _check_device_budgets(self) -> None:
        """Every kind of rank must hold its live KDA states and a page, and have no more pages
        than a page table can name: fail here rather than when `simulate` builds the ranks."""
        for kind, _, live, decode in self._rank_kinds():
            field = self._budget_field(decode)
            try:
                sizes = self.cache_config(live, decode=decode).pool_sizes(self.geometry)
            except BudgetTooSmallError as exc:
                raise BudgetTooSmallError(f"{field} is too small for {kind} ranks: {exc}") from None
            if sizes.num_pages > MAX_PAGES_PER_RANK:
                raise ValueError(
                    f"{field} is too large for {kind} ranks: it makes {sizes.num_pages} pages of "
                    f"{self.geometry.mla_page_bytes} bytes per rank, more than the "
                    f"{MAX_PAGES_PER_RANK} pages an int32 page table can name"
                )

    def rank_pools(self) -> list[tuple[str, int, PoolSizes]]:
        """(kind, number of such ranks, device pool sizes of one) for each kind of rank."""
        return [
            (kind, count, self.cache_config(live, decode=decode).pool_sizes(self.geometry))
            for kind, count, live, decode in self._rank_kinds()
        ]

    @property
    def device_pages(self) -> int:
        """Device pages over all ranks (sink pages included): entries the page pools hold."""
        return sum(count * sizes.num_pages for _, count, sizes in self.rank_pools())

    def bookkeeping_bytes(self, sessions: int | None = None) -> int:
        """Estimated host memory the simulation needs up front: every rank's page pools and
        fixed state, and `sessions` sessions in flight (default `concurrency`). Requests'
        records, which accumulate over the run, are not included."""
        sessions = self.concurrency if sessions is None else sessions
        return (
            self.device_pages * PAGE_BOOKKEEPING_BYTES
            + self.num_ranks * RANK_BOOKKEEPING_BYTES
            + sessions * SESSION_BOOKKEEPING_BYTES
        )

    def cache_config(self, live_requests: int, *, decode: bool = False) -> CacheConfig:
        """The metadata-only cache of one rank with `live_requests` live KDA slots (a P/D decode
        rank's when `decode`)."""
        budget = self.device_cache_bytes
        if decode and self.decode_device_cache_bytes is not None:
            budget = self.decode_device_cache_bytes
        return CacheConfig(
            device_budget_bytes=budget,
            max_live_requests=live_requests,
            checkpoint_fraction=self.device_checkpoint_fraction,
            checkpoint_policy=self.checkpoints,
            metadata_only=True,
            # A decode rank never looks a prefix up (its requests arrive with their whole cache,
            # `DecodeScheduler` admits them with no prefix): indexing its pages would only cost
            # bookkeeping. Its turns are still checkpointed and published to the host tier.
            prefix_caching=not decode,
        )

    @property
    def num_ranks(self) -> int:
        return self.prefill_ranks + self.decode_ranks

    @property
    def num_gpus(self) -> int:
        """One rank is one GPU."""
        return self.num_ranks
