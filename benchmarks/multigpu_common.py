"""Rank launch and timing helpers shared by the multi-GPU benchmarks (multigpu_comm.py, ...).

Launch: under torchrun (`init_from_env`: NCCL on CUDA, one GPU per rank, gloo for CPU smoke
runs), or on CPU ranks this script spawns itself (`spawn_cpu_ranks`: gloo over loopback on a
port chosen at run time, a deadline on the whole run, every rank killed by its PID when one
fails or the deadline passes; the pattern of tests/parallel/harness.py).

Timing: `time_us` runs warm-up calls, then regions of `inner` calls, each region after a
barrier of all ranks (CUDA events on a GPU, the host clock on the CPU); the median per call.
`slowest` takes the maximum of a value over the ranks (a step waits for its slowest rank).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(cpu: bool, timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
    in the environment): NCCL on this rank's GPU, or gloo when `cpu`. (rank, world, device)."""
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    timeout = timedelta(seconds=timeout_s)
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return dist.get_rank(), dist.get_world_size(), device


def _child(rank: int, world: int, port: int, timeout_s: float, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:  # an exception ends the process with exit code 1, its traceback on stderr
        fn(rank, world, torch.device("cpu"), *args)
    finally:
        dist.destroy_process_group()


def spawn_cpu_ranks(fn, world: int, *args, timeout_s: float = 300.0) -> None:
    """Run `fn(rank, world, device, *args)` on `world` spawned CPU ranks (gloo); collectives
    time out after `timeout_s`, and so does the whole run. Raises RuntimeError when a rank
    fails (the others are killed by PID), TimeoutError past the deadline (all killed)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, timeout_s, fn, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        running = list(procs)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks with PIDs {[p.pid for p in running]} still running after {timeout_s} s"
                )
            for sentinel in wait([p.sentinel for p in running], left):
                p = next(p for p in running if p.sentinel == sentinel)
                p.join()
                running.remove(p)
                if p.exitcode != 0:
                    raise RuntimeError(f"rank with PID {p.pid} exited with {p.exitcode}")
    finally:
        for p in procs:  # the survivors of a failure or a timeout: by PID
            if p.is_alive():
                p.kill()
            p.join(10)


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


def time_us(fn, device: torch.device, *, warmup: int = 3, samples: int = 20, inner: int = 5):
    """This rank's median us per call of `fn` over `samples` regions of `inner` calls, every
    region started after a barrier of all ranks (so every rank must call it, in order)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        barrier(device)
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / inner)
    return statistics.median(times)


def slowest(value: float, device: torch.device) -> float:
    """The maximum of `value` over all ranks (collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
