"""Where copies into the device tier run: inline, on a host worker thread, or on a CUDA copy stream.

A load is a list of steps (one per layer, in the order the forward consumes layers). The engine
runs them in order and returns one completion event per step, so the forward may start layer 0
while later layers are still arriving. Each `CacheManager` owns its engine (no shared threads or
streams between managers).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from .events import CompletedEvent, CompletionEvent, CudaEvent, HostEvent

CopyStep = Callable[[], None]


class CopyEngine(ABC):
    @abstractmethod
    def submit(self, steps: Sequence[CopyStep]) -> list[CompletionEvent]:
        """Run `steps` in order; the i-th event completes once steps 0..i have run. A step that
        raises fails its event and every later one (they do not run)."""

    def drain(self) -> None:
        """Return once every step submitted so far has run (or failed)."""
        return None

    def close(self) -> None:
        """Finish queued work and release threads / streams."""
        return None


class InlineCopyEngine(CopyEngine):
    """Runs every step before returning (metadata-only mode, or async_loads=False)."""

    def submit(self, steps: Sequence[CopyStep]) -> list[CompletionEvent]:
        events: list[CompletionEvent] = []
        error: BaseException | None = None
        for step in steps:
            if error is None:
                try:
                    step()
                except Exception as exc:  # surfaced through the event, like the async engines
                    error = exc
            if error is None:
                events.append(CompletedEvent())
            else:
                failed = HostEvent()
                failed.set(error)
                events.append(failed)
        return events


class ThreadCopyEngine(CopyEngine):
    """Runs steps on one worker thread of its own (started on first use), in submission order."""

    def __init__(self, name: str = "tokenspeed-cache-copy") -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, steps: Sequence[CopyStep]) -> list[CompletionEvent]:
        if not steps:
            return []
        events = [HostEvent() for _ in steps]
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((list(steps), events))
        return list(events)

    def drain(self) -> None:
        with self._lock:
            if self._thread is None:
                return  # nothing was ever submitted
        (marker,) = self.submit([lambda: None])  # runs after everything queued before it
        marker.synchronize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            steps, events = job
            error: BaseException | None = None
            for step, event in zip(steps, events, strict=True):
                if error is None:
                    try:
                        step()
                    except BaseException as exc:  # reported to whoever waits on the event
                        error = exc
                event.set(error)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=30)


class CudaCopyEngine(CopyEngine):
    """Enqueues steps on a dedicated copy stream that first waits for the current stream (so the
    copies see every earlier write), recording one CUDA event after each step."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def submit(self, steps: Sequence[CopyStep]) -> list[CompletionEvent]:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        events: list[CompletionEvent] = []
        with torch.cuda.stream(self._stream):
            for step in steps:
                step()
                events.append(CudaEvent(self._stream))
        return events

    def drain(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        self._stream.synchronize()


def make_copy_engine(device: torch.device, *, async_loads: bool, name: str) -> CopyEngine:
    if not async_loads:
        return InlineCopyEngine()
    if device.type == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine(name)
