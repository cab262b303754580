"""Scheduling: request lifecycle, prefill/decode batch formation, routing, P/D admission.

Pure logic over integers (the split planner alone emits torch tensors, for CUDA graphs). The
schedulers reach the cache only through `CachePort`; see docs/sched.md for how an engine drives
them.

The split planner's names (`plan_decode_splits`, `SplitPlan`, `SplitPlanBuffers`) load lazily from
`tokenspeed.sched.split_planner`, so that importing the schedulers does not import torch.
"""

from typing import Any

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
    "SplitPlan",
    "SplitPlanBuffers",
    "StepPlan",
    "TransferGate",
    "checkpoint_positions",
    "chunk_end",
    "pad_batch_size",
    "plan_decode_splits",
]

_LAZY = {"SplitPlan", "SplitPlanBuffers", "plan_decode_splits"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from tokenspeed.sched import split_planner

        return getattr(split_planner, name)
    raise AttributeError(f"module 'tokenspeed.sched' has no attribute {name!r}")
