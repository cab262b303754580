"""Scheduler and router configuration (frozen, keyword-only, validated at construction).

Every check names the field it rejects, so an impossible deployment (zero ranks, a token budget that
cannot hold one page, an unsorted graph-size list) fails where it is written, not deep in a run.
"""

from __future__ import annotations

import enum
import itertools

import attrs


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


# Largest decode batch size: the engine captures one CUDA graph per size, over static buffers as
# many rows long as the largest size (a rows x max_pages page table among them), and the simulator
# models a rank that could. 4096 rows is well past any one-GPU decode batch (serving engines
# capture a few hundred rows by default); a bigger entry is a typo or an allocation no device has.
MAX_DECODE_BATCH_SIZE = 4096


def _sizes_tuple(value: object) -> tuple:
    # tuple() of a bare int fails with "'int' object is not iterable", which names no field.
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(f"decode_batch_sizes must be a sequence of integers, got {value!r}")
    return tuple(value)


def _sorted_sizes(instance: object, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must list at least one batch size")
    if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value):
        raise ValueError(f"{attribute.name} must hold positive integers, got {value!r}")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise ValueError(f"{attribute.name} must be strictly increasing, got {value!r}")
    if value[-1] > MAX_DECODE_BATCH_SIZE:
        raise ValueError(
            f"{attribute.name} ends at {value[-1]}, above the largest decode batch "
            f"{MAX_DECODE_BATCH_SIZE} (one CUDA graph and its buffers are built per size)"
        )


DEFAULT_DECODE_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Per-rank batch formation.

    page_size: tokens per cache page; every chunk boundary except a prompt's end is a multiple.
    prefill_token_budget: new tokens one prefill forward may compute (all requests together).
    max_prefill_requests: requests one prefill forward may hold.
    checkpoint_interval_pages: a long prefill is cut, and its KDA state snapshotted, every this
        many pages; chunk ends prefer these boundaries so that a cut prefill leaves a reusable
        prefix.
    decode_batch_sizes: the captured graph sizes; a decode batch runs at the smallest size that
        holds it, so the largest entry is also the decode batch cap (at most
        MAX_DECODE_BATCH_SIZE).
    decode_reserve_pages: free pages a decode rank must keep beyond a request's history before
        admitting it, so that running requests can grow without immediate preemption.
    max_preemptions: a request already preempted this many times is aborted with a reason
        ("preempted N times without finishing") instead of being preempted again, so that an
        overloaded rank cannot cycle one request forever. Every preemption counts, wherever it
        happened: decode rows out of pages, the prefill deadlock guard, `preempt(rid)` on either
        scheduler; 0 turns every preemption into an abort.
    """

    page_size: int = attrs.field(default=64, validator=_positive)
    prefill_token_budget: int = attrs.field(default=16384, validator=_positive)
    max_prefill_requests: int = attrs.field(default=64, validator=_positive)
    checkpoint_interval_pages: int = attrs.field(default=64, validator=_positive)
    decode_batch_sizes: tuple[int, ...] = attrs.field(
        default=DEFAULT_DECODE_BATCH_SIZES, converter=_sizes_tuple, validator=_sorted_sizes
    )
    decode_reserve_pages: int = attrs.field(default=0, validator=_non_negative)
    max_preemptions: int = attrs.field(default=8, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.prefill_token_budget < self.page_size:
            raise ValueError(
                f"prefill_token_budget ({self.prefill_token_budget}) is smaller than one page "
                f"(page_size={self.page_size}): no chunk could ever be scheduled"
            )

    @property
    def checkpoint_interval_tokens(self) -> int:
        return self.checkpoint_interval_pages * self.page_size

    @property
    def max_decode_batch(self) -> int:
        return self.decode_batch_sizes[-1]


class RoutingPolicy(enum.Enum):
    """How the router places a turn on a prefill rank."""

    LEAST_WORK = "least_work"  # fewest outstanding prefill tokens (queued + in flight)
    AFFINITY = "affinity"  # a conversation stays on the rank its first turn went to


class AdmissionPolicy(enum.Enum):
    """When a P/D request may enter the prefill queue."""

    INDEPENDENT = "independent"  # prefill and decode admission proceed in parallel
    COUPLED = "coupled"  # prefill waits until a decode rank has admitted the request


@attrs.frozen(kw_only=True)
class RouterConfig:
    """Cluster shape seen by the router; num_decode_ranks is 0 in aggregated mode."""

    num_prefill_ranks: int = attrs.field(validator=_positive)
    num_decode_ranks: int = attrs.field(default=0, validator=_non_negative)
    policy: RoutingPolicy = attrs.field(default=RoutingPolicy.LEAST_WORK, converter=RoutingPolicy)
