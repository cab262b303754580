"""Completion events: the host-side implementations (CUDA events are covered with the engine)."""

from __future__ import annotations

import threading

import pytest

from tokenspeed.cache import TransferError
from tokenspeed.cache.events import CompletedEvent, HostEvent


def test_host_events():
    done = CompletedEvent()
    assert done.query()
    done.wait()
    event = HostEvent()
    assert not event.query()
    event.set()
    event.wait()
    assert event.query()


def test_host_event_wakes_a_waiting_thread_and_carries_errors():
    event = HostEvent()
    woke = []
    waiter = threading.Thread(target=lambda: (event.wait(), woke.append(True)))
    waiter.start()
    event.set()
    waiter.join(5)
    assert woke == [True]
    failed = HostEvent()
    failed.set(OSError("link down"))
    assert failed.query()
    with pytest.raises(TransferError, match="link down"):
        failed.synchronize()
