"""Workloads for the simulator: an AgentX-style generator, aiperf / Mooncake trace loaders."""

from tokenspeed.sim.workload.agentx import AgentXConfig, AgentXWorkload
from tokenspeed.sim.workload.distributions import LogNormal
from tokenspeed.sim.workload.model import Session, SessionSource, TraceIssue, Turn, Workload
from tokenspeed.sim.workload.traces import (
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
