"""Markdown tables of simulation results."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenspeed.sim.cluster import SimResult

COLUMNS = (
    ("scenario", None),
    ("conc.", None),
    ("tok/s/GPU", "throughput_per_gpu"),
    ("P90 interact. tok/s", "p90_interactivity"),
    ("TTFT mean s", "ttft_mean_s"),
    ("TTFT P90 s", "ttft_p90_s"),
    ("hit rate", "hit_rate"),
    ("prefill queue s", "prefill_queue_mean_s"),
    ("decode adm. s", "decode_admission_mean_s"),
    ("pinned s", "pinned_mean_s"),
    ("finished", "requests_finished"),
    ("aborted", "requests_aborted"),
    ("preempted", "preemptions"),
)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def results_table(rows: Sequence[tuple[str, SimResult]]) -> str:
    """One row per (scenario label, result)."""
    lines = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for label, res in rows:
        s = res.summary
        cells = [label, str(res.config.concurrency)]
        cells += [_fmt(getattr(s, field)) for _, field in COLUMNS[2:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scenario_line(res: SimResult) -> str:
    c = res.config
    shape = (
        f"{c.prefill_ranks} prefill + {c.decode_ranks} decode ranks"
        if c.mode.value == "pd"
        else f"{c.prefill_ranks} aggregated ranks"
    )
    # duration_s=None: no cut-off, the workload ran to its end.
    duration = "unlimited (the whole workload)" if c.duration_s is None else f"{c.duration_s} s"
    return (
        f"{shape}, page {c.geometry.page_size}, L2 {c.l2.value}, routing {c.routing.value}, "
        f"admission {c.admission.value}, duration {duration}, workload {res.workload}"
    )
