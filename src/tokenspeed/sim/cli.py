"""`python -m tokenspeed.sim`: run a scenario over one or more concurrencies and write a report.

Writes, under --out: report.md (scenario, results table, plots), summary.json (every score of
every run), throughput_vs_interactivity.png and hit_rate_over_time.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Sized
from pathlib import Path

from tokenspeed.cache import CheckpointPolicy
from tokenspeed.sched import SchedulerConfig
from tokenspeed.sim.cluster import ClusterConfig, SimResult, check_load, k3_geometry, simulate
from tokenspeed.sim.cluster.config import (
    PAGE_BOOKKEEPING_BYTES,
    RANK_BOOKKEEPING_BYTES,
    SESSION_BOOKKEEPING_BYTES,
)
from tokenspeed.sim.cost import LinearCostModel, SpeculativeCostModel, TableCostModel
from tokenspeed.sim.plots import plot_hit_rate_over_time, plot_throughput_vs_interactivity
from tokenspeed.sim.report import results_table, scenario_line
from tokenspeed.workload import (
    AgentXConfig,
    AgentXWorkload,
    Workload,
    load_aiperf_dataset,
    load_mooncake_trace,
)

# What write_report writes under --out (checked writable before any simulation runs).
REPORT_MD = "report.md"
SUMMARY_JSON = "summary.json"
THROUGHPUT_PNG = "throughput_vs_interactivity.png"
HIT_RATE_PNG = "hit_rate_over_time.png"
REPORT_FILES = (REPORT_MD, SUMMARY_JSON, THROUGHPUT_PNG, HIT_RATE_PNG)

GiB = 1 << 30
# A request's record (about 0.7 KB measured, plus its index entry): every one is kept until the
# report is written, the records of every concurrency's run included.
RECORD_BYTES = 1 << 10


def build_parser(prog: str = "python -m tokenspeed.sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Simulate a prefill/decode cluster serving an agentic workload.",
    )
    p.add_argument("--mode", choices=("pd", "aggregated"), default="pd")
    p.add_argument(
        "--prefill-ranks", type=int, default=16, help="prefill ranks (P/D) or ranks (aggregated)"
    )
    p.add_argument("--decode-ranks", type=int, default=16, help="decode ranks (P/D only)")
    p.add_argument(
        "--concurrency",
        default="64,128,256,512",
        help="comma-separated concurrencies, one run each",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=3600.0,
        help="seconds of load; in-flight requests then drain (0: the whole workload, traces only)",
    )
    p.add_argument("--workload", choices=("agentx", "aiperf", "mooncake"), default="agentx")
    p.add_argument("--trace", type=Path, help="dataset.jsonl / trace file for aiperf|mooncake")
    p.add_argument(
        "--on-error",
        choices=("skip", "raise"),
        default="skip",
        help="malformed trace lines: report and skip, or stop",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l2", choices=("shared", "local", "none"), default="shared")
    p.add_argument("--l2-gib-per-rank", type=float, default=512.0)
    p.add_argument("--device-cache-gib", type=float, default=80.0)
    p.add_argument("--routing", choices=("least_work", "affinity"), default="least_work")
    p.add_argument("--admission", choices=("independent", "coupled"), default="independent")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--checkpoint-interval-pages", type=int, default=64)
    p.add_argument("--prefill-budget", type=int, default=16384, help="tokens per prefill forward")
    p.add_argument("--cost-table", type=Path, help="measured cost table (JSON, see docs/sim.md)")
    p.add_argument(
        "--acceptance-length",
        type=float,
        default=1.0,
        help="speculative decoding: tokens each decode (verify) step emits per request on "
        "average, 1..4 (default 1: no speculation)",
    )
    p.add_argument(
        "--num-speculative-steps",
        type=int,
        help="speculative decoding: drafts per verify step, k (the step costs a decode step of "
        "k + 1 tokens per request); default: the fewest that can emit --acceptance-length",
    )
    p.add_argument("--out", type=Path, default=Path("sim-report"))
    p.add_argument("--no-progress", action="store_true")
    return p


def _gib_to_bytes(option: str, gib: float) -> int:
    # On the byte count: a finite GiB figure such as 1e300 overflows it (int() would raise).
    if not 0 <= gib * (1 << 30) < math.inf:
        raise ValueError(f"{option} must be a finite number of GiB >= 0, got {gib}")
    return int(gib * (1 << 30))


def parse_concurrencies(text: str) -> list[int]:
    """'64,128' -> [64, 128]; raises ValueError naming --concurrency."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"--concurrency needs at least one value, got {text!r}")
    return values


def config_from_args(args: argparse.Namespace, concurrency: int) -> ClusterConfig:
    aggregated = args.mode == "aggregated"
    return ClusterConfig(
        mode=args.mode,
        prefill_ranks=args.prefill_ranks,
        decode_ranks=0 if aggregated else args.decode_ranks,
        routing=args.routing,
        admission=args.admission,
        l2=args.l2,
        geometry=k3_geometry(args.page_size),
        checkpoints=CheckpointPolicy(interval_pages=args.checkpoint_interval_pages),
        scheduler=SchedulerConfig(
            page_size=args.page_size,
            prefill_token_budget=args.prefill_budget,
            checkpoint_interval_pages=args.checkpoint_interval_pages,
        ),
        device_cache_bytes=_gib_to_bytes("--device-cache-gib", args.device_cache_gib),
        l2_bytes_per_rank=_gib_to_bytes("--l2-gib-per-rank", args.l2_gib_per_rank),
        concurrency=concurrency,
        duration_s=args.duration or None,
    )


def speculative_cost(args: argparse.Namespace, cost):
    """`cost` itself without speculation (the default: identical runs), else wrapped in a
    `SpeculativeCostModel` (ValueError naming the options when they cannot work)."""
    a, k = args.acceptance_length, args.num_speculative_steps
    if a == 1 and not k:
        return cost
    if k is None:
        k = math.ceil(a) - 1 if math.isfinite(a) else 0
    try:
        return SpeculativeCostModel(base=cost, acceptance_length=a, num_steps=k)
    except ValueError as exc:
        raise ValueError(f"--acceptance-length / --num-speculative-steps: {exc}") from None


def load_workload(args: argparse.Namespace):
    if args.workload == "agentx":
        if args.trace is not None:  # ignoring it would report AgentX results as the trace's
            raise ValueError(
                "--trace is read by --workload aiperf|mooncake only; say which layout it has"
            )
        return AgentXWorkload(AgentXConfig(), seed=args.seed)
    if args.trace is None:
        raise ValueError(f"--workload {args.workload} needs --trace PATH")
    loader = load_aiperf_dataset if args.workload == "aiperf" else load_mooncake_trace
    workload = loader(args.trace, on_error=args.on_error)
    for issue in workload.issues:
        print(f"{args.trace}: skipped {issue}", file=sys.stderr)
    _check_trace_issues_requests(args, workload)
    return workload


def _check_trace_issues_requests(args: argparse.Namespace, workload: Workload) -> None:
    """A trace that would issue no request is a mistake (an empty or wrong file, epoch
    timestamps): refuse it rather than write a report of zeros."""
    if not workload.sessions:
        skipped = len(workload.issues)
        why = f" ({skipped} malformed line{'s' * (skipped != 1)} skipped)" if skipped else ""
        raise ValueError(f"{args.trace} has no valid rows{why}")
    if workload.timed and args.duration:
        first = min(s.start_s for s in workload.sessions)
        if first >= args.duration:
            raise ValueError(
                f"{args.trace}: no request of the trace starts before --duration {args.duration:g}"
                f" (the first starts at {first:g} s; timestamps are ms from the replay's start)"
            )


def _machine_memory_bytes() -> int | None:
    """Physical memory of this machine (or the cgroup v2 limit of this process's container,
    when lower), or None where the OS does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and 0 < int(limit) < total:
        total = int(limit)
    return total if total > 0 else None


def _sessions_in_flight(cfg: ClusterConfig, workload) -> int:
    """A trace replays at most its own sessions (a timed one starts them all); an endless
    generator keeps `concurrency` in flight."""
    if isinstance(workload, Sized):
        return (
            len(workload)
            if getattr(workload, "timed", False)
            else min(cfg.concurrency, len(workload))
        )
    return cfg.concurrency


def _expected_requests(cfg: ClusterConfig, workload) -> tuple[int, float]:
    """(requests an endless AgentX run issues, seconds between a session's turns): each session
    issues about one turn per mean think time (an over-estimate: serving the turn adds to it).
    A trace's requests are its rows, already in memory: (0, 0.0)."""
    if not isinstance(workload, AgentXWorkload) or cfg.duration_s is None:
        return 0, 0.0
    ax = workload.config
    cycle = (
        ax.agentic_fraction * ax.agentic_delay_s.mean
        + (1 - ax.agentic_fraction) * ax.human_delay_s.mean
    )
    return math.ceil(cfg.concurrency * cfg.duration_s / cycle), cycle


def estimated_bookkeeping_bytes(configs: list[ClusterConfig], workload) -> int:
    """Host memory the runs need: the largest run's ranks and sessions (runs go one at a time)
    plus every run's request records (all kept for the report)."""
    live = max(cfg.bookkeeping_bytes(_sessions_in_flight(cfg, workload)) for cfg in configs)
    return live + sum(_expected_requests(cfg, workload)[0] for cfg in configs) * RECORD_BYTES


def _check_fits_in_memory(args: argparse.Namespace, configs: list[ClusterConfig], workload) -> None:
    """Refuse runs whose bookkeeping alone would not fit in this machine's memory: they would
    swap, be killed, or run for hours first (building billions of page entries, generating
    millions of sessions, simulating a near-endless load)."""
    memory = _machine_memory_bytes()
    if memory is None:
        return
    need = estimated_bookkeeping_bytes(configs, workload)
    if need <= memory:
        return
    cfg = max(configs, key=lambda c: c.bookkeeping_bytes(_sessions_in_flight(c, workload)))
    ranks = (
        f"--prefill-ranks {cfg.prefill_ranks} + --decode-ranks {cfg.decode_ranks}"
        if cfg.decode_ranks
        else f"--prefill-ranks {cfg.prefill_ranks}"
    )
    pages = cfg.device_pages * PAGE_BOOKKEEPING_BYTES + cfg.num_ranks * RANK_BOOKKEEPING_BYTES
    sessions = _sessions_in_flight(cfg, workload)
    requests = sum(_expected_requests(c, workload)[0] for c in configs)
    parts = [
        (
            pages,
            f"--device-cache-gib {args.device_cache_gib:g} on {ranks} ranks makes "
            f"{cfg.device_pages:,} device pages, {PAGE_BOOKKEEPING_BYTES} B of bookkeeping each",
        ),
        (
            sessions * SESSION_BOOKKEEPING_BYTES,
            f"--concurrency {cfg.concurrency} keeps {sessions:,} sessions in flight, "
            f"~{SESSION_BOOKKEEPING_BYTES >> 10} KiB each",
        ),
        (
            requests * RECORD_BYTES,
            f"--duration {args.duration:g} at --concurrency {args.concurrency} issues "
            f"~{requests:,} requests (one per session every "
            f"{_expected_requests(configs[0], workload)[1]:.3g} s), each a {RECORD_BYTES} B "
            "record kept for the report",
        ),
    ]
    _, why = max(parts, key=lambda part: part[0])
    raise ValueError(
        f"{why}: ~{need / GiB:.3g} GiB in all, more than this machine's {memory / GiB:.3g} GiB "
        "of memory"
    )


def check_ranks_hold_longest_prompt(cfg: ClusterConfig, workload) -> None:
    """An AgentX run needs every kind of rank to hold the workload's longest prompt: a request
    that can never fit a rank is aborted the moment it arrives, its session ends and the
    endless generator replaces it at the same simulated instant, so a cache too small for
    most prompts spins at time 0 forever (traces end: they run out of sessions)."""
    if not isinstance(workload, AgentXWorkload):
        return
    # Prompts stay under max_prompt_tokens (a session ends before one would reach it), so the
    # longest prompt and its first output token take max_prompt_tokens tokens.
    longest = workload.config.max_prompt_tokens
    page = cfg.geometry.page_size
    need = -(-longest // page) + cfg.scheduler.decode_reserve_pages
    for kind, _, sizes in cfg.rank_pools():
        usable = sizes.num_pages - 1  # page 0 is the sink
        if usable < need:
            raise ValueError(
                f"--device-cache-gib {cfg.device_cache_bytes / GiB:g} is too small for the "
                f"agentx workload: a {kind} rank has {usable:,} pages ({usable * page:,} tokens) "
                f"left after its live KDA states, fewer than the {need:,} pages that its longest "
                f"prompt and first output token take ({longest:,} tokens); requests that "
                "cannot fit are aborted as they arrive and replaced at the same simulated "
                "instant, so the run would never end"
            )


def _check_out_writable(out: Path) -> None:
    """Fail before the simulations, not after them, if the report cannot be written: a file of
    the report that cannot be opened for writing (a directory in the way, read-only), or an
    --out where no file can be created. Opening for append changes no existing file."""
    for name in REPORT_FILES:
        path = out / name
        if path.exists() or path.is_symlink():
            try:
                with open(path, "ab"):
                    pass
            except OSError as exc:
                raise ValueError(f"--out {out}: cannot write {path} ({exc.strerror})") from None
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror})") from None


def _json_safe(value: object) -> object:
    """NaN and infinities (a score with no requests behind it) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_report(out: Path, results: list[SimResult], command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    label = "sim"
    plot_throughput_vs_interactivity(
        {
            label: [
                (r.summary.p90_interactivity, r.summary.throughput_per_gpu, r.config.concurrency)
                for r in results
            ]
        },
        out / THROUGHPUT_PNG,
    )
    plot_hit_rate_over_time(
        {f"concurrency {r.config.concurrency}": r.hit_rate_over_time for r in results},
        out / HIT_RATE_PNG,
    )
    (out / SUMMARY_JSON).write_text(
        json.dumps(
            [
                _json_safe(
                    {
                        "concurrency": r.config.concurrency,
                        **r.summary.as_dict(),
                        "abort_reasons": r.abort_reasons,
                    }
                )
                for r in results
            ],
            indent=2,
            allow_nan=False,
        )
    )
    lines = [
        "# Simulation report",
        "",
        f"Command: `{command}`",
        "",
        f"Scenario: {scenario_line(results[0])}.",
        "",
        results_table([(f"c={r.config.concurrency}", r) for r in results]),
        "",
        f"![throughput vs interactivity]({THROUGHPUT_PNG})",
        "",
        f"![hit rate over time]({HIT_RATE_PNG})",
        "",
    ]
    path = out / REPORT_MD
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None, prog: str = "python -m tokenspeed.sim") -> int:
    """prog: how the command was invoked (help text and the report's command line)."""
    args = build_parser(prog).parse_args(argv)
    # Every bad input fails here, before the first simulation: configs (cache errors included,
    # they are ValueErrors), the cost table, the workload, a load that would never end, --out.
    try:
        configs = [config_from_args(args, c) for c in parse_concurrencies(args.concurrency)]
        if args.duration == 0 and args.workload == "agentx":
            raise ValueError(
                "--duration 0 runs the whole workload, but the agentx workload is endless"
            )
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out} exists and is not a directory")
        cost = TableCostModel.from_file(args.cost_table) if args.cost_table else LinearCostModel()
        cost = speculative_cost(args, cost)
        workload = load_workload(args)
        for cfg in configs:
            check_load(cfg, workload)
            check_ranks_hold_longest_prompt(cfg, workload)
        _check_fits_in_memory(args, configs, workload)
        args.out.mkdir(parents=True, exist_ok=True)
        _check_out_writable(args.out)
    except (OSError, ValueError) as exc:  # TraceError is a ValueError; OSError: unreadable file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = []
    for cfg in configs:
        res = simulate(cfg, workload, cost, progress=not args.no_progress)
        s = res.summary
        print(
            f"concurrency {cfg.concurrency}: {s.throughput_per_gpu:.1f} tok/s/GPU, "
            f"P90 interactivity {s.p90_interactivity:.1f} tok/s, hit rate {s.hit_rate:.3f}, "
            f"{s.requests_finished} finished, {s.requests_aborted} aborted, "
            f"{s.events_per_s:.0f} events/s",
            file=sys.stderr,
        )
        results.append(res)
    command = shlex.join([*prog.split(), *(argv if argv is not None else sys.argv[1:])])
    path = write_report(args.out, results, command)
    print(path)
    return 0


__all__ = ["build_parser", "main"]
