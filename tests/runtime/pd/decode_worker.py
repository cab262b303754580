"""A decode engine in a process of its own, driven by JSON lines (the cross-process P/D tests).

    python -m tests.runtime.pd.decode_worker        (cwd: the repository; PYTHONPATH: src)

Reads one command per line on stdin and answers each with one line on stdout:
    {"op": "admit", "rid": ..., "prompt": [...], "params": {...}}  -> {"destination": {...} | null}
    {"op": "run", "timeout_s": 60}    steps until nothing is unfinished -> {"outputs": {rid: [...]}}
    {"op": "stats"}                   -> {"requests": n, "used_pages": n, "destinations": n}
    {"op": "exit"}                    -> {} and the process ends
Errors answer {"error": "..."}. The process dies with its parent (Linux parent-death signal).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def main() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    from tokenspeed.runtime import SamplingParams
    from tokenspeed.runtime.pd import DecodeEngine, make_transport

    from ..conftest import tiny_model
    from .common import CONFIG

    engine = DecodeEngine(tiny_model(), None, CONFIG, transport=make_transport(sys.argv[1]))
    outputs: dict = {}

    def answer(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "admit":
                params = SamplingParams(**command["params"])
                dest = engine.admit(command["rid"], command["prompt"], params)
                answer({"destination": None if dest is None else dest.as_dict()})
            elif op == "run":
                deadline = time.monotonic() + command["timeout_s"]
                while engine.has_unfinished() and time.monotonic() < deadline:
                    for out in engine.step():
                        if out.finished:
                            outputs[out.request_id] = out.token_ids
                    engine.check_integrity()
                    if not engine.scheduler.has_work:
                        time.sleep(0.002)
                answer({"outputs": outputs, "unfinished": engine.num_unfinished})
            elif op == "stats":
                stats = engine.cache.stats()
                answer(
                    {
                        "requests": stats.requests,
                        "used_pages": stats.pages.used,
                        "destinations": engine.destinations_held,
                    }
                )
            elif op == "exit":
                answer({})
                break
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as exc:
            answer({"error": repr(exc)})
    engine.close()


if __name__ == "__main__":
    main()
