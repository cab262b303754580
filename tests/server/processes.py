"""Processes the server tests start: `tokenspeed serve` workers and an smg gateway (the Mooncake
services come from `tokenspeed.cache.l2.mooncake_services`). Each listens on loopback on a port
chosen at run time, has its output drained by a thread (the last lines are kept for failure
messages; nothing is written to disk) and is stopped by PID (SIGKILL, then reaped).

    with stopping() as procs:
        a, b = procs.extend(start_workers(2, "--page-size", "16"))
        gateway = procs.add(start_smg([a.url, b.url], policy="power_of_two"))
        status, body = http_json("POST", gateway.url + "/v1/completions", {...})

Every wait has a deadline (`timeout_s`) and fails naming what it waited for, with the output.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence

from ..processes import pid_gone

# The engine options of every worker the tests start (the offline reference uses the same).
WORKER_OPTIONS = (
    "--device",
    "cpu",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--page-size",
    "16",
)
START_TIMEOUT_S = 120  # a worker imports torch and builds its engine; two start at once


def smg_missing() -> str | None:
    """None if the smg gateway can run here, else why not (a skip reason)."""
    if importlib.util.find_spec("smg") is None:
        return "smg is not installed (pip install smg; it is in the test extra)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    """A started process: its output drained into `lines` (the last 500) by a daemon thread."""

    def __init__(self, name: str, argv: Sequence[str], env: dict | None = None) -> None:
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=500)
        self._seen = threading.Condition()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
        )
        self._drain = threading.Thread(target=self._read, name=f"drain-{name}", daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def output(self, last: int = 60) -> str:
        return "\n".join(list(self.lines)[-last:])

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line matching `pattern` (a regex), waiting for it up to timeout_s."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while True:
                for line in self.lines:
                    found = regex.search(line)
                    if found:
                        return found
                left = deadline - time.monotonic()
                if left <= 0 or (not self.alive() and not self._drain.is_alive()):
                    break
                self._seen.wait(min(left, 0.5))
        state = "still running" if self.alive() else f"exited with {self.proc.returncode}"
        raise AssertionError(
            f"{self.name} ({state}) printed no line matching {pattern!r} within {timeout_s} s:\n"
            f"{self.output()}"
        )

    def kill(self) -> None:
        """SIGKILL by PID (no grace), then reap."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._drain.join(timeout=10)  # EOF once every holder of the pipe is gone
        if not self._drain.is_alive():
            self.proc.stdout.close()

    stop = kill


class Worker(Proc):
    """`tokenspeed serve` on 127.0.0.1, port 0 (the port it prints once listening)."""

    port: int | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, f"{self.name} is not listening yet"
        return f"http://127.0.0.1:{self.port}"

    def wait_listening(self, timeout_s: float = START_TIMEOUT_S) -> Worker:
        found = self.wait_for_line(r"serving \S+ on http://127\.0\.0\.1:(\d+) ", timeout_s)
        self.port = int(found.group(1))
        return self


def spawn_worker(*options: str, model: str = "tiny", name: str = "worker") -> Worker:
    """Start `tokenspeed serve MODEL --port 0 OPTIONS` (one torch thread); not waited for."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TOKENSPEED_API_KEY", None)
    argv = [sys.executable, "-m", "tokenspeed.cli", "serve", model, "--port", "0", *options]
    return Worker(name, argv, env)


def start_workers(n: int, *options: str, procs: Processes) -> list[Worker]:
    """n workers started at once (added to `procs` as they start), each waited for until it
    listens."""
    workers = [procs.add(spawn_worker(*options, name=f"worker{i}")) for i in range(n)]
    for w in workers:
        w.wait_listening()
    return workers


class Gateway(Proc):
    """`smg launch` in front of some workers: `url` (its HTTP port) and `metrics_url`
    (its Prometheus exposition)."""

    def __init__(self, argv: Sequence[str], port: int, metrics_port: int) -> None:
        super().__init__("smg", argv)
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def workers(self) -> dict[str, dict]:
        """smg's GET /workers, by worker URL."""
        _, body = http_json("GET", self.url + "/workers")
        return {w["url"]: w for w in body["workers"]}

    def wait_ready(self, urls: Sequence[str], timeout_s: float = 60) -> None:
        """Until smg lists every worker in `urls` healthy and ready, with a load it polled."""

        def ready() -> bool:
            try:
                workers = self.workers()
            except (OSError, ValueError, KeyError):
                return False
            return all(
                u in workers
                and workers[u]["is_healthy"]
                and workers[u]["status"] == "ready"
                and workers[u].get("engine_load")
                for u in urls
            )

        wait_until(ready, f"smg to list {list(urls)} as ready", timeout_s, self)


def start_smg(
    worker_urls: Sequence[str], *options: str, policy: str = "power_of_two", procs: Processes
) -> Gateway:
    """`smg launch` on free loopback ports, polling loads and health every second, in front of
    `worker_urls`; returned once it lists them all ready. A dead worker is out of routing after
    one failed health check."""
    health = (
        "--health-check-interval-secs",
        "1",
        "--health-check-timeout-secs",
        "1",
        "--health-failure-threshold",
        "1",
    )
    routing = ("--worker-urls", *worker_urls, "--policy", policy)
    return launch_smg(routing, worker_urls, *options, health=health, procs=procs)


def launch_smg(
    routing: Sequence[str],
    worker_urls: Sequence[str],
    *options: str,
    health: Sequence[str] = (),
    procs: Processes,
) -> Gateway:
    """`smg launch` on free loopback ports with `routing` (its worker and mode arguments),
    polling loads every second; returned once it lists `worker_urls` all ready. `health`: its
    health-check options; `options` go last."""
    port, metrics_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *routing,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--disable-tokenizer-autoload",
        "--load-monitor-interval",
        "1",
        *health,
        "--log-level",
        "info",
        *options,
    ]
    gateway = procs.add(Gateway(argv, port, metrics_port))
    gateway.wait_ready(worker_urls)
    return gateway


class Processes:
    """The processes a test started, stopped by PID (last started first) on `stop_all`."""

    def __init__(self) -> None:
        self.procs: list = []

    def add(self, proc):
        """proc: a `Proc`, or anything with `pid` and `stop()` (a Mooncake `ServiceProcess`)."""
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        errors = []
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as exc:  # stop the others all the same
                errors.append(exc)
        for proc in self.procs:
            assert pid_gone(proc.pid), f"{proc} (PID {proc.pid}) is still running"
        if errors:
            raise errors[0]


@contextlib.contextmanager
def stopping() -> Iterator[Processes]:
    """A `Processes` whose members are all stopped on leaving, by success or failure."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


def http_json(
    method: str, url: str, body: dict | None = None, timeout_s: float = 60
) -> tuple[int, dict]:
    """(status, parsed JSON body) of one request; an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")}


def http_text(url: str, timeout_s: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def prometheus(text: str) -> dict[str, float]:
    """A Prometheus exposition as {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_until(
    condition: Callable[[], object], what: str, timeout_s: float, proc: Proc | None = None
) -> None:
    """Poll `condition()` (every 50 ms) until it holds; past timeout_s, fail naming `what`
    (with `proc`'s last output)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tail = f":\n{proc.output()}" if proc is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{tail}")
        time.sleep(0.05)
