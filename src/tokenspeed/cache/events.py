"""Completion events for asynchronous copies into the device tier.

One interface over a CUDA event recorded on a copy stream and a host-side event set by a worker
thread, so that the forward's code (`event.wait()` before layer l) is the same on GPU and in CPU
tests.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from .errors import TransferError


class CompletionEvent(ABC):
    """Marks the end of one asynchronous copy."""

    @abstractmethod
    def query(self) -> bool:
        """True once the copy has finished (successfully or not)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the copy has finished; raise TransferError if it failed."""

    def wait(self) -> None:
        """Make the consumer wait: on CUDA the current stream waits (the host does not block);
        on the host, the calling thread blocks."""
        self.synchronize()


class CompletedEvent(CompletionEvent):
    """An event that was never pending (nothing to copy, or the copy ran inline)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostEvent(CompletionEvent):
    """Set by a host thread when its copy is done; carries the copy's exception if it failed."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise TransferError(f"copy into the device tier failed: {self._error!r}") from (
                self._error
            )


class CudaEvent(CompletionEvent):
    """A torch.cuda.Event recorded on the copy stream after the copy was enqueued."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)
