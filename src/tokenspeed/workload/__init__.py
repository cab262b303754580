"""Workloads for the simulator: an AgentX-style generator, aiperf / Mooncake trace loaders."""

from tokenspeed.workload.agentx import AgentXConfig, AgentXWorkload
from tokenspeed.workload.distributions import LogNormal
from tokenspeed.workload.model import Session, SessionSource, TraceIssue, Turn, Workload
from tokenspeed.workload.traces import (
    MAX_TOKENS,
    TraceError,
    load_aiperf_dataset,
    load_mooncake_trace,
    write_aiperf_dataset,
)

__all__ = [
    "MAX_TOKENS",
    "AgentXConfig",
    "AgentXWorkload",
    "LogNormal",
    "Session",
    "SessionSource",
    "TraceError",
    "TraceIssue",
    "Turn",
    "Workload",
    "load_aiperf_dataset",
    "load_mooncake_trace",
    "write_aiperf_dataset",
]
