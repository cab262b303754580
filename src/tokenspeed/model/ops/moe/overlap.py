"""Run two independent pieces of work (routed and shared experts) on two CUDA streams.

fork: the side stream waits for everything already queued on the current stream (the
inputs); side work is queued first so the GPU can start it while the host is still queueing
the main work; join: the current stream waits for the side stream before anything after
`run` reads the side result. Both waits are event-based, so the pattern is captured into CUDA
graphs as a fork/join of graph branches.

Memory: side-stream intermediates are freed on the side stream; the side result is used on
the current stream only after the join, and the side stream is private to this object and
re-forked from the current stream on every call, so a block freed by the current stream is
never reused by side work that could still race with it. Keep the stream private.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Main = TypeVar("Main")
Side = TypeVar("Side")


class SideStream:
    """A private second stream on one device; `run` serialises when disabled or without CUDA."""

    def __init__(self, device: torch.device | str | int | None = None, enabled: bool = True):
        self.enabled = enabled and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=device) if self.enabled else None

    def run(self, main: Callable[[], Main], side: Callable[[], Side]) -> tuple[Main, Side]:
        """Return (main(), side()), the two overlapping on the GPU when enabled."""
        if self.stream is None or not self.enabled:
            side_out = side()
            return main(), side_out
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)  # fork
        with torch.cuda.stream(self.stream):
            side_out = side()
        main_out = main()
        current.wait_stream(self.stream)  # join
        return main_out, side_out
