"""Copy engines run steps in order and signal one event per step, also when a step fails."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenspeed.cache import TransferError
from tokenspeed.cache.copy_engine import (
    CudaCopyEngine,
    InlineCopyEngine,
    ThreadCopyEngine,
    make_copy_engine,
)


def test_inline_engine_runs_before_returning():
    ran = []
    events = InlineCopyEngine().submit([lambda: ran.append(0), lambda: ran.append(1)])
    assert ran == [0, 1]
    assert all(e.query() for e in events)


def test_thread_engine_signals_layer_by_layer():
    engine = ThreadCopyEngine("test-copy")
    gate = threading.Event()
    ran = []
    events = engine.submit([lambda: ran.append(0), lambda: (gate.wait(10), ran.append(1))])
    events[0].synchronize()  # the first layer is usable while the second is still copying
    assert ran == [0] and not events[1].query()
    gate.set()
    events[1].synchronize()
    assert ran == [0, 1]
    engine.close()


@pytest.mark.parametrize("make", [InlineCopyEngine, lambda: ThreadCopyEngine("fail")])
def test_failed_step_fails_its_event_and_the_rest(make):
    engine = make()
    ran = []

    def boom():
        raise RuntimeError("dma error")

    events = engine.submit([lambda: ran.append(0), boom, lambda: ran.append(2)])
    events[0].synchronize()
    for event in events[1:]:
        with pytest.raises(TransferError, match="dma error"):
            event.synchronize()
    assert ran == [0]  # nothing after the failure ran
    engine.close()


def test_drain_returns_once_everything_submitted_has_run():
    engine = ThreadCopyEngine("test-drain")
    engine.drain()  # nothing submitted yet: returns at once, starts no thread
    gate, ran = threading.Event(), []
    engine.submit([lambda: (gate.wait(10), ran.append(0))])
    engine.submit([lambda: ran.append(1), lambda: 1 / 0, lambda: ran.append(2)])
    threading.Timer(0.2, gate.set).start()
    engine.drain()  # a failed step does not stop it either
    assert ran == [0, 1]
    engine.close()
    InlineCopyEngine().drain()


def test_each_engine_owns_its_thread():
    a, b = ThreadCopyEngine("a"), ThreadCopyEngine("b")
    names = []
    a.submit([lambda: names.append(threading.current_thread().name)])[0].synchronize()
    b.submit([lambda: names.append(threading.current_thread().name)])[0].synchronize()
    assert names == ["a", "b"]
    a.close()
    b.close()


def test_make_copy_engine_picks_by_device():
    assert isinstance(
        make_copy_engine(torch.device("cpu"), async_loads=False, name="x"), InlineCopyEngine
    )
    engine = make_copy_engine(torch.device("cpu"), async_loads=True, name="x")
    assert isinstance(engine, ThreadCopyEngine)
    engine.close()


@pytest.mark.gpu
def test_cuda_engine_orders_copies_after_the_current_stream_and_signals_per_step():
    device = torch.device("cuda")
    engine = CudaCopyEngine(device)
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = [torch.empty(1 << 20, device=device) for _ in range(3)]
    events = engine.submit([lambda d=d: d.copy_(src, non_blocking=True) for d in dst])
    for d, event in zip(dst, events, strict=True):
        event.wait()  # the current stream waits; the host does not block
        assert torch.equal(d.cpu(), src)
    engine.close()
