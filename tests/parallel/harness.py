"""Run a function on N CPU ranks (gloo over loopback) and collect what each returns.

Each rank is a spawned process that joins a fresh process group on a port chosen at run time,
calls `fn(rank, world_size, *args)` with one torch thread, and writes its result (or its
traceback) to a file. Every process is waited for with a deadline and killed by its PID when it
passes it, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, out_dir, collective_timeout):
    torch.set_num_threads(1)
    status = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=collective_timeout),
        )
        status = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # reported to the parent, which fails the test
        status = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(status, f)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_ranks_status(fn, world_size: int, *args, timeout: float = 120.0, collective_timeout=60):
    """[(status, value)] per rank, status "ok" / "error" / "died" (no result written); raises
    TimeoutError (after killing every rank) when they are not all done within `timeout` s."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tokenspeed-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, fn, args, out_dir, collective_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [p.pid for p in procs if p.is_alive()]
            if hung:
                raise TimeoutError(f"ranks with PIDs {hung} still running after {timeout} s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"{rank}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(("died", procs[rank].exitcode))
        return results


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """What `fn` returned on each rank; AssertionError naming every rank that failed."""
    results = run_ranks_status(fn, world_size, *args, timeout=timeout)
    failed = {r: v for r, (s, v) in enumerate(results) if s != "ok"}
    assert not failed, "\n".join(f"rank {r}: {v}" for r, v in failed.items())
    return [v for _, v in results]
