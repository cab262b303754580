"""benchmarks/multigpu_dwdp.py --smoke: two CPU ranks (gloo) that the script spawns itself run
the peak copies, the project's DWDP fetch and the two-buffer schedules at tiny widths and print
the tables (the code paths the GPU run takes; the numbers say nothing about a GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rows(out: str, first: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith(f"| {first}")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


@pytest.mark.slow  # 9-16 s on 2 cores: three processes import torch, two run gloo
def test_multigpu_dwdp_smoke(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    out_file = tmp_path / "dwdp.md"
    args = ["--layers", "3", "--timeout", "90", "--out", str(out_file)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu_dwdp.py"), "--smoke", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # the script kills its ranks by PID after --timeout s
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out_file.read_text() == out
    assert "# DWDP: dwdp=2" in out and "2 CPU ranks (gloo)" in out
    assert re.search(r"date \d{4}-\d\d-\d\d \d\d:\d\d UTC, .*torch ", out), out
    # (a): the host copy stand-in and gloo send/recv, positive bandwidths.
    (copy,) = _rows(out, "Tensor.copy_ host copy")
    (sendrecv,) = _rows(out, "gloo send/recv")
    assert float(copy[2]) > 0 and float(sendrecv[2]) > 0
    # (b): the tiny preset's 16 experts split over 2 ranks: 8 remote x 3 x 32 x 32 bf16.
    fetch_mb = 8 * 3 * 32 * 32 * 2 / 1e6
    (fetch,) = _rows(out, "project: fetch_remote_experts, 2 x 3 gloo broadcasts")
    (gather,) = _rows(out, "reference: all_gather")
    for row in (fetch, gather):
        assert abs(float(row[1]) - fetch_mb) < 1e-4 and float(row[3]) > 0
        assert row[4].endswith("%")
    # (c): two tables, one row per token count, the fetch column equal to (b)'s time.
    assert "Project DWDP layer as apply_dwdp leaves it" in out
    assert "Two-buffer schedule written out around a torch MoE (not fused)" in out
    heads = _rows(out, "tokens/rank")
    assert [h[3] for h in heads] == ["serial (prefetch off)", "layer 0"], heads
    rows = _rows(out, "16 ") + _rows(out, "48 ")
    assert len(rows) == 4, out
    for row in rows:
        assert len(row) in (8, 9) and row[-1].endswith("%")
        assert float(row[1]) > 0 and row[2] == fetch[2]
        assert all(float(cell) >= 0 for cell in row[3:-3])  # times; exposed may go negative
