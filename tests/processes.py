"""Helpers for tests that start worker processes: a deadline, PID checks, prompt ids."""

from __future__ import annotations

import contextlib
import os
import signal

import torch


@contextlib.contextmanager
def alarm(seconds: int):
    """Raise TimeoutError in the test past `seconds` (SIGALRM) instead of hanging; the engines
    it built are then closed by their own `with` / finally, their workers stopped."""

    def expire(signum, frame):
        raise TimeoutError(f"test still running after its {seconds} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pid_gone(pid: int) -> bool:
    """Whether no process has this PID any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def prompt_ids(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    """n prompts of random lengths in [low, high) of token ids in [3, 500)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in lens]
