"""Scheduling: request lifecycle, prefill/decode batch formation, routing, P/D admission.

Pure logic over integers. The schedulers reach the cache only through `CachePort`; see
docs/sched.md for how an engine drives them. (The MLA decode split planner, a kernel launch plan,
lives with the MLA op: `tokenspeed.model.ops.mla.split_plan`.)
"""

from tokenspeed.sched.aggregated import AggregatedScheduler
from tokenspeed.sched.batch import (
    DecodeBatch,
    PrefillBatch,
    PrefillChunk,
    StepPlan,
    pad_batch_size,
)
from tokenspeed.sched.cache_port import AdmissionError, CachePort
from tokenspeed.sched.chunking import checkpoint_positions, chunk_end
from tokenspeed.sched.config import AdmissionPolicy, RouterConfig, RoutingPolicy, SchedulerConfig
from tokenspeed.sched.decode import DecodeScheduler
from tokenspeed.sched.pd import TransferGate
from tokenspeed.sched.prefill import PrefillScheduler
from tokenspeed.sched.request import LifecycleError, Request, RequestState
from tokenspeed.sched.router import DecodeLoad, Router

__all__ = [
    "AdmissionError",
    "AdmissionPolicy",
    "AggregatedScheduler",
    "CachePort",
    "DecodeBatch",
    "DecodeLoad",
    "DecodeScheduler",
    "LifecycleError",
    "PrefillBatch",
    "PrefillChunk",
    "PrefillScheduler",
    "Request",
    "RequestState",
    "Router",
    "RouterConfig",
    "RoutingPolicy",
    "SchedulerConfig",
    "StepPlan",
    "TransferGate",
    "checkpoint_positions",
    "chunk_end",
    "pad_batch_size",
]
