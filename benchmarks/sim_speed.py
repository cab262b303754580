"""Simulator speed: one simulated hour of AgentX at concurrency 512 on 16 prefill + 16 decode ranks.

Claim (issue 4): it finishes in under 2 minutes on one core. Prints the wall time of the event loop,
events per second, requests per second, the time of the final cache integrity checks (reported
apart: every rank's `check_integrity()`, the shared host tier walked once), and the process CPU
time (the simulator is single-threaded, so that is time on one core even on a shared machine).

    taskset -c 0 python benchmarks/sim_speed.py            # the full claim
    python benchmarks/sim_speed.py --duration 300          # a quick look
"""

from __future__ import annotations

import argparse
import os
import time

# One core: keep numpy / torch from starting thread pools (must precede their import).
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from tokenspeed.cache import CheckpointPolicy  # noqa: E402
from tokenspeed.sched import SchedulerConfig  # noqa: E402
from tokenspeed.sim.cluster import ClusterConfig, k3_geometry, simulate  # noqa: E402
from tokenspeed.workload import AgentXWorkload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--concurrency", type=int, default=512)
    p.add_argument("--prefill-ranks", type=int, default=16)
    p.add_argument("--decode-ranks", type=int, default=16)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the final integrity checks")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()

    cfg = ClusterConfig(
        prefill_ranks=args.prefill_ranks,
        decode_ranks=args.decode_ranks,
        concurrency=args.concurrency,
        duration_s=args.duration,
        geometry=k3_geometry(args.page_size),
        scheduler=SchedulerConfig(page_size=args.page_size),
        checkpoints=CheckpointPolicy(),
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    res = simulate(
        cfg,
        AgentXWorkload(seed=args.seed),
        progress=not args.no_progress,
        check_caches=not args.no_check,
    )
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    s = res.summary
    print(
        f"simulated: {s.makespan_s:.0f} s (load {args.duration:.0f} s + drain), "
        f"concurrency {args.concurrency}, {args.prefill_ranks}P + {args.decode_ranks}D ranks, "
        f"page {args.page_size}"
    )
    print(
        f"requests: {s.requests_issued} issued, {s.requests_finished} finished, "
        f"{s.requests_aborted} aborted, {s.preemptions} preemptions"
    )
    print(
        f"event loop: {s.wall_s:.1f} s wall, {s.cpu_s:.1f} s CPU, {s.events} events, "
        f"{s.events_per_s:.0f} events/s wall ({s.events / s.cpu_s:.0f} per CPU second), "
        f"{s.requests_issued / s.cpu_s:.0f} requests per CPU second"
    )
    print(
        f"integrity checks: {res.check_s:.1f} s; total {total:.1f} s wall, {cpu:.1f} s CPU "
        "(single-threaded: CPU time is time on one core, whatever else shares the machine)"
    )
    print(
        f"scores: {s.throughput_per_gpu:.1f} tok/s/GPU, P90 interactivity "
        f"{s.p90_interactivity:.1f} tok/s, TTFT mean {s.ttft_mean_s:.2f} s / P90 "
        f"{s.ttft_p90_s:.2f} s, hit rate {s.hit_rate:.3f}"
    )


if __name__ == "__main__":
    main()
