"""Numeric options that used to hang the simulator (or run for hours, or exhaust memory) are
refused up front with a usage error naming the option, the limit and why.

Each case runs the CLI in a subprocess under a timeout: before the limits existed every one of
them ran on (a concurrency of 10^8 spent its first minutes generating sessions; a huge device
cache built billions of page entries; a cache that cannot hold the longest prompt aborted every
request at simulated time 0 and replaced it forever).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed.cache import CheckpointPolicy
from tokenspeed.sched import SchedulerConfig
from tokenspeed.sim import cli
from tokenspeed.sim.cluster import ClusterConfig, k3_geometry
from tokenspeed.sim.cluster.config import MAX_PAGES_PER_RANK
from tokenspeed.workload import AgentXWorkload

SRC = Path(__file__).resolve().parents[2] / "src"
GiB = 1 << 30


def _run_cli(tmp_path: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = tmp_path / "r"
    return subprocess.run(
        [sys.executable, "-m", "tokenspeed.sim", *args, "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,  # the defect: these never returned
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        # 10^8 sessions started at time 0, ~40-60 KiB each: terabytes, hours of generation.
        (["--concurrency", "100000000"], ["--concurrency 100000000", "sessions in flight"]),
        # Pools of 6e8 pages per rank: terabytes of page bookkeeping.
        (["--device-cache-gib", "1e6"], ["--device-cache-gib 1e+06", "device pages"]),
        # More pages than an int32 page table can name.
        (["--device-cache-gib", "1e9"], ["device_cache_bytes", "2147483647 pages"]),
        # A million ranks of 80 GiB each.
        (
            ["--prefill-ranks", "1000000", "--decode-ranks", "1000000"],
            ["--prefill-ranks 1000000 + --decode-ranks 1000000", "device pages"],
        ),
        # 10^12 simulated seconds: a record per request, ~10^13 requests, forever.
        (["--duration", "1e12"], ["--duration 1e+12", "requests"]),
        # A decode rank of 28 GiB holds 483 pages (30k tokens); every AgentX prompt is longer,
        # so every request was aborted at time 0 and its session replaced, forever.
        (
            ["--device-cache-gib", "28", "--prefill-ranks", "1", "--decode-ranks", "1"],
            ["--device-cache-gib 28", "decode rank", "longest prompt"],
        ),
    ],
)
def test_cli_refuses_runs_that_would_never_finish(tmp_path, args, messages):
    proc = _run_cli(tmp_path, "--duration", "10", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for message in messages:
        assert message in proc.stderr
    assert not (tmp_path / "r").exists()


def _args(*extra: str) -> list[str]:
    return ["--concurrency", "2", "--duration", "5", "--no-progress", *extra]


def test_memory_limit_is_this_machines_memory(tmp_path, capsys, monkeypatch):
    """The bookkeeping estimate is checked against this machine's memory: the same scenario
    runs on a machine with room for it and is refused (naming the figures) on one without."""
    monkeypatch.setattr(cli, "_machine_memory_bytes", lambda: 64 << 20)  # 64 MiB
    out = tmp_path / "r"
    args = _args("--prefill-ranks", "4", "--decode-ranks", "4", "--out", str(out))
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "more than this machine's 0.0625 GiB" in err and "--device-cache-gib 80" in err
    assert not out.exists()
    # Unknown machine memory: no limit is applied.
    monkeypatch.setattr(cli, "_machine_memory_bytes", lambda: None)
    assert cli.main(_args("--prefill-ranks", "1", "--decode-ranks", "1", "--out", str(out))) == 0


def test_concurrency_beyond_a_traces_sessions_is_not_counted(tmp_path):
    """A trace replays at most its own sessions: a huge --concurrency costs nothing there."""
    trace = tmp_path / "dataset.jsonl"
    trace.write_text('{"session_id": "a", "input_length": 300, "output_length": 3}\n')
    args = ["--workload", "aiperf", "--trace", str(trace), "--duration", "0"]
    args += ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "100000000"]
    assert cli.main([*args, "--out", str(tmp_path / "r"), "--no-progress"]) == 0


@pytest.mark.parametrize(
    ("ranks", "concurrency", "duration", "gib"),
    [
        (16, 512, 3600.0, 80.0),  # benchmarks/sim_speed.py
        (4, 512, 900.0, 80.0),  # benchmarks/sim_ablations.py and its sweep
        (2, 4, 30.0, 40.0),  # tests/sim/test_cli.py, page 128
    ],
)
def test_the_documented_and_benchmarked_scenarios_are_within_the_limits(
    ranks, concurrency, duration, gib
):
    page = 128 if gib == 40.0 else 64
    cfg = ClusterConfig(
        prefill_ranks=ranks,
        decode_ranks=ranks,
        concurrency=concurrency,
        duration_s=duration,
        device_cache_bytes=int(gib * GiB),
        geometry=k3_geometry(page),
        scheduler=SchedulerConfig(page_size=page),
        checkpoints=CheckpointPolicy(),
    )
    assert cfg.bookkeeping_bytes() < 1 * GiB
    workload = AgentXWorkload()
    cli.check_ranks_hold_longest_prompt(cfg, workload)
    assert cli.estimated_bookkeeping_bytes([cfg], workload) < 2 * GiB


def test_cluster_config_refuses_more_pages_than_a_page_table_can_name():
    page_bytes = k3_geometry().mla_page_bytes
    with pytest.raises(ValueError, match="device_cache_bytes .* 2147483647 pages"):
        ClusterConfig(device_cache_bytes=(MAX_PAGES_PER_RANK + 2) * page_bytes * 2)
    with pytest.raises(ValueError, match="decode_device_cache_bytes .* int32 page table"):
        ClusterConfig(decode_device_cache_bytes=(MAX_PAGES_PER_RANK + 2) * page_bytes * 2)


def test_a_rank_that_just_holds_the_longest_prompt_and_its_first_token_is_accepted():
    """AgentX prompts stay under max_prompt_tokens, so prompt + first output token take at most
    max_prompt_tokens tokens: a decode rank with exactly that many pages (3,125 at page 64) can
    run every request, and one page less cannot."""
    workload = AgentXWorkload()
    need = -(-workload.config.max_prompt_tokens // 64)

    def cfg(gib: float) -> ClusterConfig:
        return ClusterConfig(
            prefill_ranks=1,
            decode_ranks=1,
            concurrency=4,
            duration_s=10.0,
            device_cache_bytes=int(gib * GiB),
            geometry=k3_geometry(64),
            scheduler=SchedulerConfig(page_size=64),
            checkpoints=CheckpointPolicy(),
        )

    def decode_usable(c: ClusterConfig) -> int:
        return next(s.num_pages - 1 for kind, _, s in c.rank_pools() if kind == "decode")

    # The smallest budget (in page-sized steps) that leaves the decode rank `need` pages.
    page_gib = k3_geometry(64).mla_page_bytes / GiB
    gib = 30.0
    while decode_usable(cfg(gib)) < need:
        gib += page_gib
    assert decode_usable(cfg(gib)) == need
    cli.check_ranks_hold_longest_prompt(cfg(gib), workload)
    with pytest.raises(ValueError, match="too small for the agentx workload"):
        cli.check_ranks_hold_longest_prompt(cfg(gib - page_gib), workload)
