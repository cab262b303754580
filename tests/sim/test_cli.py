import json

import pytest

from tokenspeed.sim import cli


def test_cli_writes_report_table_and_plots(tmp_path, capsys):
    out = tmp_path / "report"
    rc = cli.main(
        [
            "--prefill-ranks",
            "2",
            "--decode-ranks",
            "2",
            "--concurrency",
            "2,4",
            "--duration",
            "30",
            "--page-size",
            "128",
            "--checkpoint-interval-pages",
            "32",
            "--device-cache-gib",
            "40",
            "--l2-gib-per-rank",
            "64",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "| scenario | conc. | tok/s/GPU |" in report
    assert "| c=2 | 2 |" in report and "| c=4 | 4 |" in report
    assert "2 prefill + 2 decode ranks, page 128, L2 shared" in report
    assert "python -m tokenspeed.sim --prefill-ranks 2 --decode-ranks 2" in report
    for png in ("throughput_vs_interactivity.png", "hit_rate_over_time.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    summary = json.loads((out / "summary.json").read_text())
    assert [s["concurrency"] for s in summary] == [2, 4]
    assert all(
        s["requests_finished"] + s["requests_aborted"] == s["requests_issued"] for s in summary
    )
    assert "concurrency 4:" in capsys.readouterr().err


def test_report_names_the_command_it_was_run_with(tmp_path):
    from tokenspeed.cli import main as tokenspeed_main

    out = tmp_path / "report"
    args = [
        "--prefill-ranks",
        "1",
        "--decode-ranks",
        "1",
        "--concurrency",
        "2",
        "--duration",
        "10",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert tokenspeed_main(["sim", *args]) == 0
    report = (out / "report.md").read_text()
    assert "tokenspeed sim --prefill-ranks 1 --decode-ranks 1" in report
    assert "python -m" not in report


def test_cli_rejects_impossible_configuration(capsys):
    assert cli.main(["--prefill-ranks", "0", "--concurrency", "4", "--no-progress"]) == 2
    assert "at least one prefill and one decode rank" in capsys.readouterr().err
    assert cli.main(["--page-size", "64", "--prefill-budget", "32", "--no-progress"]) == 2
    assert "smaller than one page" in capsys.readouterr().err


def test_cli_trace_with_bad_lines(tmp_path, capsys):
    trace = tmp_path / "dataset.jsonl"
    trace.write_text(
        '{"session_id": "a", "input_length": 3000, "output_length": 20, "hash_ids": [1,2,3,4,5,6],'
        ' "timestamp": 0.0, "group_id": 0}\n'
        "oops\n"
        '{"session_id": "a", "input_length": 500, "output_length": 10, "hash_ids": [9],'
        ' "delay": 100.0}\n'
    )
    out = tmp_path / "r"
    rc = cli.main(
        [
            "--workload",
            "aiperf",
            "--trace",
            str(trace),
            "--prefill-ranks",
            "1",
            "--decode-ranks",
            "1",
            "--concurrency",
            "1",
            "--duration",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "skipped line 2: not valid JSON" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["requests_finished"] == 2
    rc = cli.main(
        [
            "--workload",
            "aiperf",
            "--trace",
            str(trace),
            "--on-error",
            "raise",
            "--concurrency",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "dataset.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_cli_shows_a_progress_bar_per_run(tmp_path, capsys):
    args = ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "1,2"]
    args += ["--duration", "5", "--out", str(tmp_path / "r")]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    # One tqdm bar per concurrency, counting simulated seconds up to the end of the load.
    assert "c=1 100%" in err and "c=2 100%" in err
    assert "5/5 sim-s" in err and "in flight" in err
    assert "sim-s" not in _run_quiet(tmp_path, capsys)


def _run_quiet(tmp_path, capsys) -> str:
    args = ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "1"]
    assert cli.main([*args, "--duration", "5", "--out", str(tmp_path / "q"), "--no-progress"]) == 0
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-cache-gib", "0.5"], "device_cache_bytes is too small for prefill ranks"),
        (["--device-cache-gib", "inf"], "--device-cache-gib must be a finite number of GiB"),
        (["--l2-gib-per-rank", "inf"], "--l2-gib-per-rank must be a finite number of GiB"),
        (["--l2-gib-per-rank", "nan"], "--l2-gib-per-rank must be a finite number of GiB"),
        (["--concurrency", ","], "--concurrency needs at least one value"),
        (["--concurrency", "4,x"], "--concurrency must be comma-separated integers"),
        (["--seed", "-1"], "seed must be a non-negative integer"),
        (["--duration", "0"], "--duration 0 runs the whole workload, but the agentx workload"),
        (["--duration", "inf"], "duration_s must be a finite positive number"),
        (["--workload", "aiperf"], "--workload aiperf needs --trace PATH"),
        # 1e300 GiB is finite but its byte count is not: it used to end in an OverflowError.
        (["--device-cache-gib", "1e300"], "--device-cache-gib must be a finite number of GiB"),
        (["--l2-gib-per-rank", "1e300"], "--l2-gib-per-rank must be a finite number of GiB"),
        # A trace given without its --workload used to be ignored: the run was AgentX's.
        (["--trace", "dataset.jsonl"], "--trace is read by --workload aiperf|mooncake only"),
    ],
)
def test_cli_rejects_bad_input_with_status_2_and_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "r"
    assert cli.main(["--concurrency", "2", *args, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()  # rejected before anything ran


def test_cli_rejects_a_bad_cost_table_or_out_path_before_running(tmp_path, capsys):
    table = tmp_path / "cost.json"
    table.write_text("[1, 2]")
    args = ["--concurrency", "2", "--duration", "5", "--no-progress"]
    assert cli.main([*args, "--cost-table", str(table), "--out", str(tmp_path / "r")]) == 2
    assert "cost.json: a cost table is a JSON object, got list" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.write_text("")
    assert cli.main([*args, "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken} exists and is not a directory" in err
    assert "concurrency 2:" not in err  # no simulation ran first


def test_cli_duration_0_runs_a_trace_to_its_end_with_a_progress_bar(tmp_path, capsys):
    """'--duration 0: whole workload', progress bar on; scores no request has (one-token
    outputs have no inter-token latency) are null in summary.json, which must stay valid JSON."""
    trace = tmp_path / "dataset.jsonl"
    trace.write_text(
        '{"session_id": "a", "input_length": 3000, "output_length": 1, "hash_ids": [1],'
        ' "timestamp": 0.0}\n'
    )
    out = tmp_path / "r"
    args = ["--workload", "aiperf", "--trace", str(trace), "--duration", "0", "--out", str(out)]
    args += ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "1"]
    assert cli.main(args) == 0
    assert "c=1 " in capsys.readouterr().err
    (summary,) = json.loads(
        (out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}")
    )
    assert summary["requests_finished"] == 1 and summary["p90_interactivity"] is None


@pytest.mark.parametrize("taken", ["summary.json", "report.md", "hit_rate_over_time.png"])
def test_cli_rejects_an_out_dir_it_cannot_write_before_running(tmp_path, capsys, taken):
    """An --out whose report files cannot be written used to fail with a traceback after every
    simulation had run (a directory in the way here; a read-only --out fails the same check)."""
    out = tmp_path / "r"
    (out / taken).mkdir(parents=True)
    args = ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "2"]
    assert cli.main([*args, "--duration", "5", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"--out {out}: cannot write {out / taken}" in err
    assert "concurrency 2:" not in err  # no simulation ran first


def test_cli_rejects_an_out_dir_where_no_file_can_be_created(tmp_path, capsys, monkeypatch):
    # Tests may run as root, which chmod cannot lock out: the probe file fails to open instead.
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    out = tmp_path / "r"
    args = ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "2"]
    assert cli.main([*args, "--duration", "5", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there (" in err and "Permission denied" in err
    assert "concurrency 2:" not in err


@pytest.mark.parametrize(
    ("rows", "extra", "message"),
    [
        ("", [], "has no valid rows"),
        ("oops\n\n", [], "has no valid rows (1 malformed line skipped)"),
        # Absolute (epoch) timestamps: no request would start within the load window.
        (
            '{"timestamp": 1700000000000, "input_length": 100, "output_length": 5}\n',
            ["--workload", "mooncake"],
            "no request of the trace starts before --duration 60",
        ),
    ],
)
def test_cli_rejects_a_trace_that_would_issue_no_request(tmp_path, capsys, rows, extra, message):
    """An empty trace (or one whose every line was skipped, or whose timed requests all start
    after the load window) used to produce a report of zeros and NaNs, exit status 0."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(rows)
    out = tmp_path / "r"
    args = ["--workload", "aiperf", "--trace", str(trace), *extra, "--duration", "60"]
    assert cli.main([*args, "--concurrency", "2", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {trace}" in err and message in err
    assert not out.exists()


def test_report_of_a_whole_trace_run_says_so_not_duration_none(tmp_path):
    """--duration 0 (duration_s=None) used to be written as "duration None s" in report.md."""
    trace = tmp_path / "dataset.jsonl"
    trace.write_text('{"session_id": "a", "input_length": 300, "output_length": 3}\n')
    out = tmp_path / "r"
    args = ["--workload", "aiperf", "--trace", str(trace), "--duration", "0", "--out", str(out)]
    args += ["--prefill-ranks", "1", "--decode-ranks", "1", "--concurrency", "1", "--no-progress"]
    assert cli.main(args) == 0
    report = (out / "report.md").read_text()
    assert "None" not in report and "duration unlimited (the whole workload)," in report
