"""Replay a dataset that aiperf itself generated (a workload nobody here wrote).

aiperf is heavy (about 1.2 GB with its dependencies) and stays out of the default install: the test
is marked slow and skips unless an `aiperf` executable is on PATH or named by $TOKENSPEED_AIPERF,
e.g. `python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0` then
`TOKENSPEED_AIPERF=/tmp/aiperf-venv/bin/aiperf pytest -m slow tests/workload/`.
"""

import os
import shutil
import subprocess

import pytest

from tests.sim.cluster.helpers import assert_nothing_lost
from tokenspeed.sim.cluster import ClusterConfig, simulate
from tokenspeed.workload import load_aiperf_dataset


def _aiperf() -> str | None:
    exe = os.environ.get("TOKENSPEED_AIPERF") or shutil.which("aiperf")
    return exe if exe and os.access(exe, os.X_OK) else None


@pytest.mark.slow
@pytest.mark.skipif(_aiperf() is None, reason="aiperf not installed (set TOKENSPEED_AIPERF)")
def test_replay_dataset_generated_by_aiperf(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(
        [
            _aiperf(),
            "synthesize",
            "agentic-code",
            "--num-sessions",
            "6",
            "--seed",
            "3",
            "--output",
            str(tmp_path),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    (dataset,) = tmp_path.glob("**/dataset.jsonl")
    workload = load_aiperf_dataset(dataset, on_error="raise")
    assert len(workload) == 6 and not workload.issues
    # aiperf's layout: the first row carries the whole initial context (tens of thousands of
    # tokens, shared prefix blocks first), later rows only the new tokens of their turn.
    first = [s.turns[0] for s in workload]
    assert all(t.new_tokens > 20_000 for t in first)
    assert len({t.blocks[:32] for t in first}) == 1  # the prefix every session shares
    later = [t for s in workload for t in s.turns[1:]]
    assert later and all(t.delay_s > 0 for t in later)

    cfg = ClusterConfig(prefill_ranks=2, decode_ranks=2, concurrency=6, duration_s=None)
    res = simulate(cfg, workload)
    assert_nothing_lost(res)
    assert res.summary.requests_aborted == 0
    assert res.summary.requests_finished == sum(len(s.turns) for s in workload)
    # Sessions share the system prefix and each turn extends its own history.
    assert res.summary.hit_rate > 0.8
