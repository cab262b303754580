"""benchmarks/fp8_cache_agreement.py at the tests' tiny size (CPU, fp32, ~15 s): an FP8 MLA cache
with bf16 KDA checkpoints stays near the default cache on a transformers-written checkpoint."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Measured (CPU, fp32, 16 prompts of 5..329 tokens, half of them prefix hits; logits' std ~1.04):
# |logit diff| max 0.091, mean 0.0044; 14/16 prompts agree on all 16 greedy tokens, mean
# agreeing prefix 15.0. The logit bounds leave ~1.5x headroom (the engine test's FP8 bound,
# tests/runtime/test_cache_dtypes.py, is 0.15 / 0.01); greedy agreement is a floor: a near-tie
# flips a token and all after it, so one or two prompts may diverge early.
MAX_LOGIT_TOLERANCE = 0.15
MEAN_LOGIT_TOLERANCE = 0.01
AGREEMENT_FLOOR = 0.75
PREFIX_FLOOR = 12.0


def test_fp8_cache_agreement_tiny():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fp8_cache_agreement.py"), "--tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 16, out
    assert any(int(row.split("|")[3]) > 0 for row in rows), out  # prefix hits happened
    diff = re.search(r"\|logit diff\|: max ([\d.e-]+), mean ([\d.e-]+)", out)
    agree = re.search(r"greedy agreement: ([\d.]+) .* mean agreeing prefix ([\d.]+)", out)
    assert diff and agree, out
    assert float(diff.group(1)) <= MAX_LOGIT_TOLERANCE, out
    assert float(diff.group(2)) <= MEAN_LOGIT_TOLERANCE, out
    assert float(agree.group(1)) >= AGREEMENT_FLOOR, out
    assert float(agree.group(2)) >= PREFIX_FLOOR, out
