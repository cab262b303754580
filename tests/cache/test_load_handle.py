"""LoadHandle: per-layer waits over own and borrowed events."""

from __future__ import annotations

import threading

import pytest

from tokenspeed.cache import LoadHandle, TransferError
from tokenspeed.cache.copy_engine import ThreadCopyEngine
from tokenspeed.cache.events import CompletedEvent, HostEvent


def test_layers_complete_independently():
    engine = ThreadCopyEngine("load-test")
    gate = threading.Event()
    mla = engine.submit([lambda: None, lambda: gate.wait(10)])
    handle = LoadHandle([[mla[0]], [mla[1]]], [[CompletedEvent()]], l2_pages=3)
    handle.wait_mla(0)
    handle.wait_kda(0)
    assert not handle.done()
    gate.set()
    handle.synchronize()
    assert handle.done() and handle.l2_pages == 3
    engine.close()


def test_synchronize_raises_when_a_copy_failed():
    failed = HostEvent()
    failed.set(RuntimeError("bad copy"))
    handle = LoadHandle([[CompletedEvent(), failed]], [])
    with pytest.raises(TransferError):
        handle.synchronize()
    with pytest.raises(TransferError):
        handle.wait_mla(0)
