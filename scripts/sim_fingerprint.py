"""Fingerprint of a simulator run, for speed work that must not change what is simulated.

Runs the `benchmarks/sim_speed.py` scenario (16P + 16D, concurrency 512, AgentX seed 0) for
`--duration` seconds of load and prints one SHA-256 per part of the result: the summary without
its timings, every request record, the hit-rate series, every rank's cache counters and the host
tier's counters. Two commits that simulate the same thing print the same lines.

    PYTHONPATH=src python scripts/sim_fingerprint.py --duration 300
"""

from __future__ import annotations

import argparse
import hashlib
import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import attrs  # noqa: E402

from tokenspeed.cache import CheckpointPolicy  # noqa: E402
from tokenspeed.sched import SchedulerConfig  # noqa: E402
from tokenspeed.sim.cluster import ClusterConfig, k3_geometry, simulate  # noqa: E402
from tokenspeed.workload import AgentXWorkload  # noqa: E402

_TIMINGS = ("wall_s", "cpu_s")


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _plain(obj: object) -> object:
    return attrs.asdict(obj) if attrs.has(type(obj)) else vars(obj)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    page = 64
    cfg = ClusterConfig(
        prefill_ranks=16,
        decode_ranks=16,
        concurrency=512,
        duration_s=args.duration,
        geometry=k3_geometry(page),
        scheduler=SchedulerConfig(page_size=page),
        checkpoints=CheckpointPolicy(),
    )
    res = simulate(cfg, AgentXWorkload(seed=args.seed), progress=False, check_caches=True)
    summary = {k: v for k, v in attrs.asdict(res.summary).items() if k not in _TIMINGS}
    parts = {
        "summary": summary,
        "records": [attrs.asdict(r) for r in res.records],
        "hit_rate_over_time": res.hit_rate_over_time,
        "cache_stats": [_plain(s) for s in res.cache_stats],
        "l2_stats": [_plain(s) for s in res.l2_stats],
    }
    for name, value in parts.items():
        print(f"{name}: {_digest(value)}")
    print(f"all: {_digest(parts)}")
    print(f"(event loop {res.summary.cpu_s:.1f} s CPU, {res.summary.events} events)")


if __name__ == "__main__":
    main()
