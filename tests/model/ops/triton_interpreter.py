"""Run Triton kernel checks under the CPU interpreter in a fresh process.

Triton decides between compiling and interpreting when a kernel module is imported, so the
checks run in a subprocess started with TRITON_INTERPRET=1: other test modules may already
have imported the kernels in this process. A test module in MODULES lists its checks in a
dict `CASES = {name: fn}`; the first `results_for` call runs the checks of every module in
one child (one interpreter start-up instead of four) and keeps {module: {name: None (passed)
or the failure text}} for the rest of the session.

Interpreter caveats (Triton 3.9): fp32 -> bf16 casts truncate and tl.dot on bf16 is wrong,
so checks use fp32 / fp16; libdevice is unavailable (kernels take their non-EXACT path).

Modules that print their own reports when run as a script (the KDA and MLA kernel tests) run
through `run_script` instead.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import tokenspeed

ROOT = Path(__file__).resolve().parents[3]
MODULES = tuple(
    f"tests.model.ops.{name}"
    for name in ("test_moe_gate", "test_moe_experts", "test_mxfp4", "test_attn_res_fused")
)
_MARK = "@@interpreter-results@@"


def results_for(module: str) -> dict[str, str | None]:
    """{case name: None or failure text} of `module` (one of MODULES)."""
    return _run_all()[module]


@functools.cache
def _run_all() -> dict[str, dict[str, str | None]]:
    return run_cases(MODULES)


def run_cases(modules: tuple[str, ...], timeout: float = 900) -> dict[str, dict]:
    """Run every CASES entry of `modules` (dotted, importable from the repo root) in a child."""
    code = (
        "import json, sys\n"
        "from tests.model.ops.triton_interpreter import run_here\n"
        f"print({_MARK!r} + json.dumps({{m: run_here(m) for m in {modules!r}}}))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"interpreter run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(_MARK) :])


def run_script(path: str, *args: str, timeout: float = 600) -> dict:
    """Run the test module at `path` as a script, with `args`, in a child under
    TRITON_INTERPRET=1 (and this checkout's package on its path); return the JSON object on the
    last line it prints."""
    src = str(Path(tokenspeed.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, path, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_here(module: str) -> dict[str, str | None]:
    """In the child: run each case of `module`, catching failures as text."""
    import importlib

    cases: dict[str, Callable[[], None]] = importlib.import_module(module).CASES
    results: dict[str, str | None] = {}
    for name in cases:
        try:
            cases[name]()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results
