"""The simulated cluster: its shape, memory, policies and load (frozen, validated)."""

from __future__ import annotations

import enum

import attrs

from tokenspeed.cache import CacheGeometry, CheckpointPolicy
from tokenspeed.sched import AdmissionPolicy, RoutingPolicy, SchedulerConfig

GiB = 1 << 30


def k3_geometry(page_size: int = 64) -> CacheGeometry:
    """Cache geometry of Kimi K3 (DESIGN.md section 2): 24 MLA layers with a 576-wide latent row,
    69 KDA layers of 96 heads x 128 with a kernel-4 conv (about 449 MB of state per request)."""
    return CacheGeometry.from_model_dims(
        num_mla_layers=24,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_kda_layers=69,
        kda_num_heads=96,
        kda_head_dim=128,
        kda_conv_kernel=4,
        page_size=page_size,
    )


class Mode(enum.Enum):
    PD = "pd"  # separate prefill and decode ranks, KV/state transferred between them
    AGGREGATED = "aggregated"  # every rank prefills and decodes


class L2Mode(enum.Enum):
    SHARED = "shared"  # one host tier that every rank reads and writes
    LOCAL = "local"  # one host tier per rank, same total capacity
    NONE = "none"  # device tier only


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


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
        None: run the workload to its end (finite workloads only).
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
    device_cache_bytes: int = attrs.field(default=80 * GiB, validator=_positive)
    decode_device_cache_bytes: int | None = attrs.field(default=None)
    prefill_live_requests: int = attrs.field(default=24, validator=_positive)
    decode_live_requests: int = attrs.field(default=64, validator=_positive)
    device_checkpoint_fraction: float = 0.1
    l2_bytes_per_rank: int = attrs.field(default=512 * GiB, validator=_non_negative_int)
    concurrency: int = attrs.field(default=64, validator=_positive)
    duration_s: float | None = attrs.field(default=600.0)
    max_decode_steps: int = attrs.field(default=512, validator=_positive)
    hit_rate_bucket_s: float = attrs.field(default=60.0, validator=_positive)

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
        if self.decode_device_cache_bytes is not None and not self.decode_device_cache_bytes > 0:
            raise ValueError(
                f"decode_device_cache_bytes must be positive or None, got "
                f"{self.decode_device_cache_bytes}"
            )
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be positive or None, got {self.duration_s}")
        if not 0 <= self.device_checkpoint_fraction < 1:
            raise ValueError(
                "device_checkpoint_fraction must be in [0, 1), got "
                f"{self.device_checkpoint_fraction}"
            )

    @property
    def num_ranks(self) -> int:
        return self.prefill_ranks + self.decode_ranks

    @property
    def num_gpus(self) -> int:
        """One rank is one GPU."""
        return self.num_ranks
