"""Cluster ablations on one workload and seed (issue 4; results in docs/perf/sim.md).

Baseline: P/D, shared L2, least-work routing, independent admission. Each ablation changes one
policy and reports a ratio against the baseline:
  (a) rank-local L2            -> baseline hit rate and throughput per GPU should be higher
  (b) conversation affinity    -> baseline P90 TTFT should be lower
  (c) coupled admission        -> baseline mean prefill queue time should be lower
With --sweep, shared and rank-local L2 also run at the listed concurrencies for the
throughput-vs-interactivity plot.

    python benchmarks/sim_ablations.py --out docs/perf/sim
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from tokenspeed.sim.cluster import ClusterConfig, SimResult, simulate  # noqa: E402
from tokenspeed.sim.plots import (  # noqa: E402
    plot_hit_rate_over_time,
    plot_throughput_vs_interactivity,
)
from tokenspeed.sim.report import results_table  # noqa: E402
from tokenspeed.workload import AgentXWorkload  # noqa: E402

VARIANTS = {
    "baseline": {},
    "local_l2": {"l2": "local"},
    "affinity": {"routing": "affinity"},
    "coupled": {"admission": "coupled"},
}


def run(args: argparse.Namespace, concurrency: int, **overrides) -> SimResult:
    cfg = ClusterConfig(
        prefill_ranks=args.prefill_ranks,
        decode_ranks=args.decode_ranks,
        concurrency=concurrency,
        duration_s=args.duration,
        **overrides,
    )
    started = time.perf_counter()
    res = simulate(cfg, AgentXWorkload(seed=args.seed), check_caches=False)
    s = res.summary
    print(
        f"  {overrides or 'baseline'} c={concurrency}: {time.perf_counter() - started:.0f} s "
        f"wall, {s.requests_finished} finished, {s.requests_aborted} aborted",
        flush=True,
    )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-ranks", type=int, default=4)
    p.add_argument("--decode-ranks", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--duration", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sweep", default="", help="extra concurrencies for shared vs local L2")
    p.add_argument("--out", type=Path, default=Path("docs/perf/sim"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    results = {name: run(args, args.concurrency, **kw) for name, kw in VARIANTS.items()}
    base, local = results["baseline"].summary, results["local_l2"].summary
    affinity, coupled = results["affinity"].summary, results["coupled"].summary
    ratios = {
        "a_hit_rate_shared_over_local": base.hit_rate / local.hit_rate,
        "a_throughput_shared_over_local": base.throughput_per_gpu / local.throughput_per_gpu,
        "b_p90_ttft_least_work_over_affinity": base.ttft_p90_s / affinity.ttft_p90_s,
        "c_prefill_queue_independent_over_coupled": (
            base.prefill_queue_mean_s / coupled.prefill_queue_mean_s
        ),
        "c_throughput_independent_over_coupled": (
            base.throughput_per_gpu / coupled.throughput_per_gpu
        ),
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")

    sweep = [int(c) for c in args.sweep.split(",") if c.strip()]
    curves = {"shared L2": [], "rank-local L2": []}
    for label, name, kw in (
        ("shared L2", "baseline", {}),
        ("rank-local L2", "local_l2", {"l2": "local"}),
    ):
        points = [results[name]] + [run(args, c, **kw) for c in sweep if c != args.concurrency]
        curves[label] = [
            (r.summary.p90_interactivity, r.summary.throughput_per_gpu, r.config.concurrency)
            for r in points
        ]
    plot_throughput_vs_interactivity(curves, args.out / "throughput_vs_interactivity.png")
    plot_hit_rate_over_time(
        {
            "shared L2": results["baseline"].hit_rate_over_time,
            "rank-local L2": results["local_l2"].hit_rate_over_time,
            "affinity (shared L2)": results["affinity"].hit_rate_over_time,
        },
        args.out / "hit_rate_over_time.png",
    )
    table = results_table([(name, res) for name, res in results.items()])
    (args.out / "ablations.md").write_text(table + "\n")
    (args.out / "ablations.json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "ratios": ratios,
                "summaries": {n: r.summary.as_dict() for n, r in results.items()},
                "sweep": curves,
            },
            indent=2,
        )
    )
    print(table)


if __name__ == "__main__":
    main()
