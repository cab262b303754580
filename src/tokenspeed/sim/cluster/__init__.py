"""Discrete-event simulator of a prefill/decode (or aggregated) cluster that drives the real
`tokenspeed.sched` schedulers over real metadata-only `tokenspeed.cache` caches."""

from tokenspeed.sim.cluster.config import ClusterConfig, L2Mode, Mode, k3_geometry
from tokenspeed.sim.cluster.event_loop import LostRequestError, check_load
from tokenspeed.sim.cluster.records import RequestRecord, Summary
from tokenspeed.sim.cluster.simulate import SimResult, build_simulator, simulate

__all__ = [
    "ClusterConfig",
    "L2Mode",
    "LostRequestError",
    "Mode",
    "RequestRecord",
    "SimResult",
    "Summary",
    "build_simulator",
    "check_load",
    "k3_geometry",
    "simulate",
]
