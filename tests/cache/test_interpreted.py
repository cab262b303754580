"""Without numba the cache's compiled loops run in the interpreter: the same cache, slower."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed.cache.compiled import AVAILABLE, FORCE_INTERPRETED

HERE = Path(__file__).parent


def _compiled_under(value: str) -> str:
    env = dict(os.environ, TOKENSPEED_CACHE_INTERPRETED=value)
    probe = subprocess.run(
        [sys.executable, "-c", "from tokenspeed.cache.compiled import AVAILABLE; print(AVAILABLE)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return probe.stdout.strip()


@pytest.mark.skipif(FORCE_INTERPRETED, reason="this run forces the interpreted loops")
@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed: nothing is compiled")
def test_only_a_set_flag_forces_the_interpreted_loops():
    # "0" and "" read as unset, as TRITON_INTERPRET's convention has it; "1" forces them.
    assert _compiled_under("0") == "True"
    assert _compiled_under("") == "True"
    assert _compiled_under("1") == "False"


@pytest.mark.skipif(FORCE_INTERPRETED, reason="already the interpreted run (this test starts it)")
def test_the_cache_passes_its_tests_with_the_loops_interpreted():
    assert _compiled_under("1") == "False"  # the loops really are interpreted there
    env = dict(os.environ, TOKENSPEED_CACHE_INTERPRETED="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE),
            "--ignore",
            str(HERE / "test_interpreted.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=HERE.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
