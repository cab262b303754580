"""benchmarks/multigpu_comm.py --smoke: two CPU ranks (gloo) it spawns itself, tiny widths, run
the DEP / TEP MoE comparison and the TP subgroup projections to the end and print one table per
part (the code paths the multi-GPU run takes; docs/perf/multigpu.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def section(out: str, title: str) -> list[str]:
    start = out.index(title)
    end = out.find("\n## ", start + 1)
    return out[start : None if end < 0 else end].splitlines()


@pytest.mark.slow  # ~11 s: two spawned ranks; DEP and TEP themselves: tests/parallel
def test_multigpu_comm_smoke(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    report = tmp_path / "multigpu.md"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "multigpu_comm.py"),
            "--smoke",
            "--out",
            str(report),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert report.read_text() == out  # rank 0 alone prints and writes the report
    assert "2 CPU ranks (gloo)" in out and "versions: torch" in out and "date: " in out
    assert "one-sided dispatch (nvshmem4py): not measured" in out

    comm = section(out, "## (2) MoE layer communication")
    head = next(line for line in comm if line.startswith("| tokens/GPU"))
    assert "DEP / TEP comm" in head and "DEP / TEP layer" in head
    rows = [cells(line) for line in comm if line.startswith("| ") and line != head]
    assert [int(r[0]) for r in rows] == [4, 8], out
    for r in rows:
        dep_comm, tep_comm, ratio = float(r[1]), float(r[2]), float(r[3])
        assert dep_comm > 0 and tep_comm > 0
        assert abs(ratio - dep_comm / tep_comm) <= 0.01 * ratio + 1e-3
        # bytes sent per rank: TEP all-reduces the group's tokens, DEP dispatches its own
        assert 0 < float(r[7]) < float(r[8])
    assert sum(line.startswith("crossover (comm): ") for line in comm) == 1
    assert sum(line.startswith("crossover (layer): ") for line in comm) == 1

    tp = section(out, "## (3) TP subgroup projections")
    rows = [cells(line) for line in tp if line.startswith("| KDA") or line.startswith("| MLA")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (layer, "2", tokens) for layer in ("KDA", "MLA") for tokens in ("4", "8")
    ], out
    for r in rows:
        replicated, subgroup = float(r[6]), float(r[7])
        assert 0 < subgroup < replicated  # a T = 2 shard keeps half of the sharded rows
    assert sum(line.startswith("crossover (") for line in tp) == 2
    assert "T=[4] not measured" in out
