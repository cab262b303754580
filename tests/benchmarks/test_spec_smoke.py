"""The speculative-decoding benchmarks' --smoke modes (CPU, TRITON_INTERPRET=1, tiny sizes) run
to the end and print their tables: the code paths the GPU runs take (docs/perf/spec.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def smoke(script: str, *args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # about 25 s under the interpreter
def test_spec_verify_smoke():
    out = smoke("spec_verify.py")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "eager" in line]
    # batches 1 and 2 x widths 2, 3, 4
    assert len(rows) == 6, out
    assert "verify / ((k + 1) x decode)" in out


@pytest.mark.slow  # about a minute under the interpreter
def test_spec_decode_smoke():
    out = smoke("spec_decode.py")
    assert "BENCHMARK ONLY" in out
    lengths = {}
    for line in out.splitlines():
        if line.startswith("| plain") or line.startswith("| ngram"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            lengths[cells[0]] = float(cells[1])
    assert lengths["plain"] == 1.0
    # Forced acceptance of f drafts: f + 1 tokens per verify step (2 requests of 8 tokens,
    # nowhere near a page end: exactly).
    for f in (0, 1, 2):
        assert lengths[f"ngram k=2, forced {f} (length {f + 1})"] == pytest.approx(f + 1), out
