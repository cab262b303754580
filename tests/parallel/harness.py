"""Run a function on N CPU ranks (gloo over loopback) and collect what each returns.

Each rank is a spawned process that joins a fresh process group on a port chosen at run time,
calls `fn(rank, world_size, *args)` with one torch thread, and sends its result (or its
traceback) back. Every call is waited for with a deadline; past it every rank is killed by its
PID, so a hang fails the test instead of blocking CI.

The rank processes are kept warm between calls (spawning one, importing torch and the model
code, costs seconds on a 2-core CI machine, more than most calls): a call uses the first N of
a pool of rank processes, each of which joins a new process group for the call, starts it
with a fresh process's torch state (default RNG seed, dtype, one thread) and leaves the group
afterwards. A call in which any rank fails, dies or hangs kills the whole pool (the next call
spawns new ones), and the pool is killed by PID when the test session ends. A test that needs
processes of its own (one that watches a rank's process exit, or kills it) passes fresh=True.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(rank, world, port, fn, args, collective_timeout):
    """One call on this rank: join the group, run `fn`, leave; ("ok", value) or ("error", ...)."""
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
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return status


def _serve(conn):
    """A rank process: run the calls sent on `conn` (pickled) until it is closed."""
    seed = torch.initial_seed()  # what a fresh process starts with
    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone, or closed the pool
            return
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            rank, world, port, fn, args, collective_timeout = pickle.loads(job)
        except BaseException as exc:
            status = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        else:
            status = _call(rank, world, port, fn, args, collective_timeout)
            del fn, args
        try:
            payload = pickle.dumps(status)
        except BaseException as exc:
            payload = pickle.dumps(("error", f"result not picklable: {exc!r}"))
        conn.send_bytes(payload)
        del status, payload


class _Rank:
    """A rank process and the parent's end of its pipe."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL by PID, then reap."""
        with contextlib.suppress(Exception):
            self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


_POOL: list[_Rank] = []  # the warm rank processes; a call of world N uses the first N


def stop_pool() -> None:
    """Kill every warm rank process (by PID)."""
    while _POOL:
        _POOL.pop().kill()


atexit.register(stop_pool)


def _warm_ranks(n: int) -> list[_Rank]:
    if not all(r.proc.is_alive() for r in _POOL):
        stop_pool()
    while len(_POOL) < n:
        _POOL.append(_Rank())
    return _POOL[:n]


def run_ranks_status(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    collective_timeout=60,
    fresh: bool = False,
):
    """[(status, value)] per rank, status "ok" / "error" / "died" (no result sent: the value is
    the exit code); raises TimeoutError (after killing every rank) when they are not all done
    within `timeout` s. fresh: new processes for this call alone, killed after it."""
    ranks = [_Rank() for _ in range(world_size)] if fresh else _warm_ranks(world_size)
    port = free_port()
    results: list = [None] * world_size
    keep = False
    try:
        for rank, r in enumerate(ranks):
            r.conn.send_bytes(pickle.dumps((rank, world_size, port, fn, args, collective_timeout)))
        deadline = time.monotonic() + timeout
        waiting = set(range(world_size))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = [ranks[i].pid for i in sorted(waiting)]
                raise TimeoutError(f"ranks with PIDs {hung} still running after {timeout} s")
            handles = {}
            for i in waiting:
                handles[ranks[i].conn] = i
                handles[ranks[i].proc.sentinel] = i
            for ready in wait(list(handles), left):
                i = handles[ready]
                if i not in waiting:
                    continue
                r = ranks[i]
                try:
                    if ready is r.conn or r.conn.poll():
                        results[i] = pickle.loads(r.conn.recv_bytes())
                    else:
                        raise EOFError
                except (EOFError, OSError):  # it ended without sending a result
                    r.proc.join(10)
                    results[i] = ("died", r.proc.exitcode)
                waiting.discard(i)
        keep = not fresh and all(status == "ok" for status, _ in results)
        return results
    finally:
        if not keep:  # failed, died, hung or fresh: these processes are not used again
            for r in ranks:
                r.kill()
            if not fresh:
                stop_pool()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, fresh: bool = False):
    """What `fn` returned on each rank; AssertionError naming every rank that failed."""
    results = run_ranks_status(fn, world_size, *args, timeout=timeout, fresh=fresh)
    failed = {r: v for r, (s, v) in enumerate(results) if s != "ok"}
    assert not failed, "\n".join(f"rank {r}: {v}" for r, v in failed.items())
    return [v for _, v in results]
