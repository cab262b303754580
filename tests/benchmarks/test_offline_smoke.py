"""benchmarks/offline.py --smoke --profile (CPU, TRITON_INTERPRET=1, tiny preset): the engine run,
its schedule counted for the roofline, the report's tables and the profiled run's per-step windows
(the code paths the GPU run takes; the numbers say nothing about a GPU)."""

import re

import pytest

from .test_spec_smoke import smoke


@pytest.mark.slow  # about 45 s under the interpreter
def test_offline_smoke():
    out = smoke("offline.py", "--profile")
    assert "transformers baseline: not run (--smoke)" in out
    # 4 prompts of 32 tokens, 8 new tokens each: the first from the prefill, 7 decoded each.
    assert re.search(r"\| tokenspeed Engine, decode_steps=8 \| [\d.]+ \| 32 \|", out), out
    schedule = re.search(r"prefill steps \((\d+) tokens\), \d+ decode forwards \((\d+) rows", out)
    assert schedule and schedule.groups() == ("128", "28"), out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\| (prefill \(|decode \(|run \()", line)
        if m:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].split(" ")[0]] = cells
    assert set(rows) == {"prefill", "decode", "run"}, out
    for cells in rows.values():
        assert float(cells[3]) > 0 and float(cells[4]) > 0  # ours s, roofline s
        assert cells[5].strip("*").endswith("%")
        assert cells[7].endswith("%")  # the profiled run's windows matched the steps
    assert "ESTIMATED:" in out and "routed experts" in out
    assert "profiled run (the same workload on other prompts" in out
