"""Start and stop the long-lived Mooncake processes on one host: the master and segment owners.

For tests and single-host deployments. Each process gets free ports chosen at start (no fixed
ports), listens on the given host (loopback by default), dies with the process that started it
(Linux parent-death signal), and is stopped by `stop()` or on leaving a `with` block. A multi-host
deployment runs the same commands under its process supervisor instead (see docs/cache.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..errors import CacheError


class ServiceError(CacheError):
    """A Mooncake process did not start (binary missing, port never opened, early exit)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """`mooncake_master` / `mooncake_client`: on PATH (console scripts) or inside the wheel."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError as exc:
        raise ServiceError(f"{name} not found: the mooncake package is not installed") from exc
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise ServiceError(f"{name} not found on PATH nor in {path.parent}")
    return str(path)


# Exec'd in the child instead of a preexec_fn (unsafe with threads): on Linux, ask for SIGKILL when
# the parent dies (PR_SET_PDEATHSIG survives exec), then become the service binary.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, 9)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@attrs.define(eq=False)
class ServiceProcess:
    """A started Mooncake process. `address` is "host:port" of its service port."""

    name: str
    argv: list[str]
    host: str
    port: int
    log_path: Path | None
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the process (it holds nothing worth a graceful shutdown here) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start(
    name: str, argv: list[str], host: str, port: int, log_dir: Path | None, timeout: float
) -> ServiceProcess:
    log_path = None
    out = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}-{port}.log"
        out = open(log_path, "wb")  # noqa: SIM115 (handed to the child, closed below)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        if out is not subprocess.DEVNULL:
            out.close()
    service = ServiceProcess(name, argv, host, port, log_path, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{name} exited with {proc.returncode} (log: {log_path})")
        if _port_open(host, port):
            return service
        time.sleep(0.05)
    service.stop()
    raise ServiceError(f"{name} did not open {host}:{port} within {timeout} s (log: {log_path})")


def start_master(
    *,
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    attempts: int = 3,
) -> ServiceProcess:
    """Start `mooncake_master` with its RPC, metrics and (unused) HTTP metadata ports all on free
    ports of `host`; metric reporting off. Retries with new ports if a port was taken meanwhile."""
    binary = find_binary("mooncake_master")
    error: ServiceError | None = None
    for _ in range(attempts):
        rpc, metrics, http = free_port(host), free_port(host), free_port(host)
        argv = [
            binary,
            f"--rpc_address={host}",
            f"--rpc_port={rpc}",
            f"--metrics_host={host}",
            f"--metrics_port={metrics}",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={http}",
            "--enable_metric_reporting=false",
            *extra_args,
        ]
        try:
            return _start("mooncake_master", argv, host, rpc, log_dir, timeout)
        except ServiceError as exc:
            error = exc
    assert error is not None
    raise error


def start_segment_owner(
    *,
    master_address: str,
    segment_bytes: int,
    host: str = "127.0.0.1",
    protocol: str = "tcp",
    log_dir: Path | None = None,
    timeout: float = 30.0,
    attempts: int = 3,
) -> ServiceProcess:
    """Start a `mooncake_client` that contributes `segment_bytes` of its memory to the pool and
    lives until stopped: the long-lived owner of L2 data (engines then use
    `global_segment_bytes=0`). Uses P2PHANDSHAKE metadata."""
    binary = find_binary("mooncake_client")
    error: ServiceError | None = None
    for _ in range(attempts):
        port = free_port(host)
        argv = [
            binary,
            f"--host={host}",
            f"--port={port}",
            f"--global_segment_size={segment_bytes}",
            f"--master_server_address={master_address}",
            "--metadata_server=P2PHANDSHAKE",
            f"--protocol={protocol}",
        ]
        try:
            return _start("mooncake_client", argv, host, port, log_dir, timeout)
        except ServiceError as exc:
            error = exc
    assert error is not None
    raise error


def environment_ready() -> str | None:
    """None if Mooncake can run here, else the reason it cannot (for skipping tests)."""
    try:
        import mooncake.store  # noqa: F401

        find_binary("mooncake_master")
        find_binary("mooncake_client")
    except (ImportError, OSError, ServiceError) as exc:
        return f"mooncake unavailable: {exc}"
    if not os.access(find_binary("mooncake_master"), os.X_OK):
        return "mooncake_master is not executable"
    return None
