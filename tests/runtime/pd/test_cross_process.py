"""P/D handoff to a decode engine in another process, over Mooncake on loopback TCP."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

from tokenspeed.runtime.pd import Destination, HandoffError, PrefillEngine, make_transport

from ...processes import alarm, pid_gone
from ..conftest import reference, tokens
from .common import CONFIG, GREEDY, no_request_holds_cache

ROOT = Path(__file__).resolve().parents[3]


class DecodeProcess:
    """The decode worker (decode_worker.py) in a child process; every wait has a timeout."""

    def __init__(self, kind: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.pd.decode_worker", kind],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._stderr: collections.deque = collections.deque(maxlen=40)
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()

    def _pump(self, stream, answers: bool) -> None:
        for line in stream:
            (self._lines.put if answers else self._stderr.append)(line)
        if answers:
            self._lines.put(None)  # the process closed its stdout

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"decode process silent for {timeout} s: {self.log()}") from None
        if line is None:
            raise RuntimeError(f"decode process ended: {self.log()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"decode process: {answer['error']}")
        return answer

    def call(self, command: dict, timeout: float = 60.0) -> dict:
        self.send(command)
        return self.receive(timeout)

    def log(self) -> str:
        return "".join(self._stderr)[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def decode_process(kind: str = "mooncake"):
    worker = DecodeProcess(kind)
    try:
        worker.receive(timeout=120)  # built its engine
        yield worker
    finally:
        worker.stop()
        assert pid_gone(worker.pid) or worker.proc.poll() is not None


def _held(p, rids, seconds=120):
    deadline = time.monotonic() + seconds
    while not set(rids) <= set(p.held()):
        assert time.monotonic() < deadline, "prefills did not complete in time"
        p.step()


@pytest.mark.parametrize("kind", ["mooncake", "socket"])
def test_decode_in_another_process_gives_the_same_tokens(tiny, kind):
    lengths = (37, 120, 16, 3)
    requests = [(f"x{n}", tokens(n, seed=100 + n)) for n in lengths]
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport(kind))
    try:
        with alarm(300), decode_process(kind) as worker:
            for rid, prompt in requests:
                p.add_request(rid, prompt, GREEDY)
            dests = {}
            for rid, prompt in requests:  # admitted while the prefills run
                answer = worker.call(
                    {"op": "admit", "rid": rid, "prompt": prompt, "params": attrs.asdict(GREEDY)}
                )
                assert answer["destination"] is not None
                dests[rid] = Destination.from_dict(answer["destination"])
            worker.send({"op": "run", "timeout_s": 120})
            _held(p, dests)
            futures = [p.send(rid, dests[rid]) for rid in dests]
            for future in futures:
                future.result(timeout=60)
            out = worker.receive(timeout=150)
            assert out["unfinished"] == 0
            for rid, prompt in requests:
                assert out["outputs"][rid] == reference(tiny, prompt, 12), rid
            p.step()
            no_request_holds_cache(p)
            stats = worker.call({"op": "stats"})
            assert stats == {"requests": 0, "used_pages": 0, "destinations": 0}
            worker.call({"op": "exit"})
    finally:
        p.close()


def test_a_killed_decode_process_fails_the_send_in_bounded_time(tiny):
    p = PrefillEngine(tiny, None, CONFIG, transport=make_transport("mooncake", timeout_s=10))
    try:
        with alarm(300), decode_process("mooncake") as worker:
            prompt = tokens(40, seed=7)
            p.add_request("k", prompt, GREEDY)
            answer = worker.call(
                {"op": "admit", "rid": "k", "prompt": prompt, "params": attrs.asdict(GREEDY)}
            )
            dest = Destination.from_dict(answer["destination"])
            _held(p, ["k"])
            worker.stop()  # the decode side dies before the transfer
            assert worker.proc.poll() is not None
            t0 = time.monotonic()
            with pytest.raises(HandoffError):
                p.send("k", dest).result(timeout=90)
            assert time.monotonic() - t0 < 90
        p.step()
        assert p.held() == ["k"]  # kept: the caller may send it elsewhere, or abort it
        p.abort("k")
        p.step()
        no_request_holds_cache(p)
    finally:
        p.close()
