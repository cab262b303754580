"""The Mooncake L2 across processes on loopback, and its failure handling.

The master and a segment owner are started by the tests on free ports; every store client lives
in a worker process (`mooncake_worker.py`), so a dead master can never stall pytest itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from tokenspeed.cache import (
    KeyChain,
    LocalHostCache,
    MooncakeConfig,
    MooncakeHostCache,
    ObjectKind,
)
from tokenspeed.cache.l2.base import HostObject
from tokenspeed.cache.l2.codec import HEADER_BYTES
from tokenspeed.cache.l2.mooncake_services import start_master, start_segment_owner

from ..helpers import make_manager, tiny_geometry
from .mooncake_env import needs_mooncake, require_mooncake

ROOT = Path(__file__).resolve().parents[3]
N_PAGES = 1000


def _run_worker(mode: str, master: str, out: Path, n_pages: int, timeout: float = 180) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.cache.l2.mooncake_worker",
            mode,
            master,
            str(out),
            str(n_pages),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=timeout,
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, result.get("error") or proc.stderr.decode()[-4000:]
    return result


@pytest.fixture
def cluster(tmp_path):
    """A master and one long-lived segment owner (64 MiB) on loopback, killed afterwards."""
    require_mooncake()
    master = start_master(log_dir=tmp_path / "logs")
    try:
        owner = start_segment_owner(
            master_address=master.address, segment_bytes=64 << 20, log_dir=tmp_path / "logs"
        )
    except BaseException:
        master.stop()
        raise
    yield master, owner
    owner.stop()
    master.stop()


@needs_mooncake
def test_history_published_by_one_process_is_loaded_exactly_by_another(cluster, tmp_path):
    master, owner = cluster
    a = _run_worker("publish", master.address, tmp_path / "a.json", N_PAGES)
    # 1000 pages plus checkpoints every 100 pages (the last is the turn end), all new to L2.
    assert a["checkpoints"] == [1600 * i for i in range(1, 11)]
    assert a["published"] == N_PAGES + 10 and a["l2"]["dropped_writes"] == 0
    # Process A has exited: the data lives in the segment owner, not in the writer.
    b = _run_worker("load", master.address, tmp_path / "b.json", N_PAGES)
    assert b["match_tokens"] == b["hit"] == b["l2_cached"] == N_PAGES * 16
    assert b["match_tier"] == "l2"
    assert b["pages_exact"] and b["state_exact"]
    assert b["digest"] == a["digest"]
    assert b["l2"]["corrupt"] == 0 and b["l2"]["errors"] == 0
    assert owner.alive() and master.alive()


@needs_mooncake
def test_master_killed_mid_run_degrades_to_misses(cluster, tmp_path):
    master, _ = cluster
    out = tmp_path / "fault.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.cache.l2.mooncake_worker",
            "fault",
            master.address,
            str(out),
            "20",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline()  # blocks until the worker hit L2 at least once
        assert line.strip() == b"LOOPING", proc.stderr.read().decode()[-4000:]
        time.sleep(0.3)
        master.stop()  # SIGKILL, mid-run
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads(out.read_text())
    assert proc.returncode == 0, result.get("error")
    turns = result["turns"]
    assert all(t["exact"] for t in turns), "a hit returned wrong bytes"
    assert any(t["hit"] for t in turns[:3])  # L2 served hits while the master lived
    assert turns[-1]["hit"] == 0 and turns[-2]["hit"] == 0  # and none after
    assert result["l2"]["errors"] >= 1 and result["l2"]["dropped_writes"] >= 1
    assert not result["l2"]["available"]
    # Nothing hung: no turn took much longer than one store-call timeout (2 s).
    assert max(t["seconds"] for t in turns) < 6.0


class _FakeStore:
    """The MooncakeDistributedStore calls the backend uses, failing on demand. Like the real
    store, a put of a name already stored keeps the stored object."""

    def __init__(self, behaviour: dict) -> None:
        self.b = behaviour
        self.objects: dict[str, bytes] = {}

    def setup(self, *args):
        return self.b.get("setup", 0)

    def _act(self, name):
        action = self.b.get(name)
        if action == "raise":
            raise RuntimeError(f"{name} failed")
        if action == "hang":
            time.sleep(5)
        return action

    def batch_is_exist(self, names):
        action = self._act("batch_is_exist")
        return [-1] * len(names) if action == "error" else [int(n in self.objects) for n in names]

    def put_batch(self, names, values):
        action = self._act("put_batch")
        if isinstance(action, int):
            return action
        pairs = list(zip(names, (bytes(v) for v in values), strict=True))
        if action == "partial":  # room for the first half only: the batch fails part-way
            pairs = pairs[: len(pairs) // 2]
        for name, value in pairs:
            self.objects.setdefault(name, value)
        return -600 if action == "partial" else 0

    def get_batch(self, names):
        action = self._act("get_batch")
        blobs = [self.objects.get(n, b"") for n in names]
        if action == "flip":  # a payload bit flips on the way: the CRC catches it
            blobs = [b[:-1] + bytes([b[-1] ^ 1]) if b else b for b in blobs]
        if action == "truncate":  # a short transfer: the size check catches it
            blobs = [b[:-1] for b in blobs]
        return blobs

    def batch_remove(self, names, force):
        self._act("batch_remove")
        return [0 if self.objects.pop(n, None) is not None else -704 for n in names]

    def close(self):
        return 0


def _backend(behaviour: dict, **config) -> MooncakeHostCache:
    fields = dict(master_address="127.0.0.1:1", op_timeout_s=0.5, retry_interval_s=60.0)
    fields.update(config)
    l2 = MooncakeHostCache(MooncakeConfig(**fields), store_factory=lambda: _FakeStore(behaviour))
    l2.bind(tiny_geometry(), metadata_only=False)
    return l2


def _page(l2: MooncakeHostCache, key: int) -> HostObject:
    n = l2.object_bytes(ObjectKind.PAGE)
    return HostObject(ObjectKind.PAGE, key, 0, n, torch.full((n,), key % 256, dtype=torch.uint8))


def test_backend_roundtrip_and_corruption_with_a_fake_store():
    behaviour: dict = {}
    l2 = _backend(behaviour)
    assert l2.put([_page(l2, 1), _page(l2, 2)]) == 2
    assert l2.contains(ObjectKind.PAGE, [1, 3]).tolist() == [True, False]
    got = l2.get(ObjectKind.PAGE, [1, 3], [0, 0])
    assert got[1] is None and torch.equal(got[0], _page(l2, 1).payload)
    behaviour["get_batch"] = "flip"
    assert l2.get(ObjectKind.PAGE, [2], [0]) == [None]
    assert l2.stats().corrupt == 1
    assert l2.remove(ObjectKind.PAGE, [1]) == 1
    l2.close()


@pytest.mark.parametrize("failing", ["raise", "hang"])
def test_backend_failure_trips_it_down_without_raising(failing):
    behaviour = {"batch_is_exist": failing}
    l2 = _backend(behaviour)
    start = time.monotonic()
    assert l2.contains(ObjectKind.PAGE, [1, 2]).tolist() == [False, False]
    assert time.monotonic() - start < 2.0  # a hung call is abandoned after op_timeout_s
    assert not l2.stats().available and l2.stats().errors == 1
    # While down, nothing touches the store: writes are dropped, reads are misses.
    assert l2.put([_page(l2, 1)]) == 0
    assert l2.get(ObjectKind.PAGE, [1], [0]) == [None]
    assert l2.stats().dropped_writes == 1
    l2.close()


def test_unreachable_codes_trip_and_full_store_only_drops():
    behaviour = {"put_batch": -200}  # no space: a dropped write, not an outage
    l2 = _backend(behaviour)
    assert l2.put([_page(l2, 1)]) == 0
    assert l2.stats().available and l2.stats().dropped_writes == 1
    behaviour["put_batch"] = -900  # RPC failure: the store is unreachable
    assert l2.put([_page(l2, 2)]) == 0
    assert not l2.stats().available
    l2.close()


def test_setup_failure_leaves_a_usable_empty_tier():
    l2 = _backend({"setup": -1})
    cache = make_manager(tiny_geometry(), l2=l2)
    keys = KeyChain(4).append_tokens(list(range(33)))
    h = cache.allocate("a", keys, 33)
    cache.checkpoint(h, 32)
    assert cache.publish(h) == 0
    cache.release(h)
    assert cache.match(keys, 33).num_tokens == 32  # L1 still works
    assert l2.stats().errors >= 1
    cache.check_integrity()


@pytest.mark.parametrize("damage", ["flip", "truncate", "position"])
def test_an_object_rejected_on_read_leaves_the_store_and_can_be_written_again(damage):
    behaviour: dict = {}
    l2 = _backend(behaviour)
    assert l2.put([_page(l2, 1), _page(l2, 2)]) == 2
    if damage == "position":  # the header names another position than the caller expects
        assert l2.get(ObjectKind.PAGE, [1, 2], [5, 5]) == [None, None]
    else:
        behaviour["get_batch"] = damage
        assert l2.get(ObjectKind.PAGE, [1, 2], [0, 0]) == [None, None]
        del behaviour["get_batch"]
    assert l2.stats().corrupt == 2 and l2.stats().errors == 0
    # Gone, as the local tier drops a rejected object: no longer claimed, and writable again.
    assert l2.contains(ObjectKind.PAGE, [1, 2]).tolist() == [False, False]
    assert l2.put([_page(l2, 1), _page(l2, 2)]) == 2
    got = l2.get(ObjectKind.PAGE, [1, 2], [0, 0])
    assert torch.equal(got[0], _page(l2, 1).payload) and torch.equal(got[1], _page(l2, 2).payload)
    l2.close()


def test_a_failed_removal_of_a_rejected_object_is_not_raised():
    behaviour = {"get_batch": "flip", "batch_remove": "raise"}
    l2 = _backend(behaviour)
    assert l2.put([_page(l2, 1)]) == 1
    assert l2.get(ObjectKind.PAGE, [1], [0]) == [None]  # a miss, like any failed store call
    assert l2.stats().corrupt == 1 and l2.stats().errors == 1 and not l2.stats().available
    l2.close()


def test_a_batch_put_that_fails_part_way_counts_the_objects_it_stored():
    behaviour = {"put_batch": "partial"}
    l2 = _backend(behaviour)
    assert l2.put([_page(l2, k) for k in range(1, 5)]) == 2
    stats = l2.stats()
    assert stats.available and stats.puts == 2 and stats.dropped_writes == 2
    assert stats.put_bytes == 2 * l2.object_bytes(ObjectKind.PAGE)
    assert l2.contains(ObjectKind.PAGE, [1, 2, 3, 4]).tolist() == [True, True, False, False]
    # A failed batch whose objects were already stored still counts them (base.put).
    behaviour["put_batch"] = -600
    assert l2.put([_page(l2, 1), _page(l2, 9)]) == 1
    l2.close()


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def _local() -> LocalHostCache:
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    l2.bind(tiny_geometry(), metadata_only=False)
    return l2


@pytest.mark.parametrize(
    "bad",
    ["no payload", "float payload", "int8 payload", "short payload", "position beyond int64"],
)
def test_put_rejects_a_malformed_object_as_the_local_tier_does_before_the_store(bad):
    l2 = _backend({})
    good = _page(l2, 1)
    n = good.nbytes
    obj = {
        "no payload": HostObject(ObjectKind.PAGE, 2, 0, n),
        "float payload": HostObject(ObjectKind.PAGE, 2, 0, n, torch.zeros(n)),
        "int8 payload": HostObject(ObjectKind.PAGE, 2, 0, n, torch.zeros(n, dtype=torch.int8)),
        "short payload": HostObject(ObjectKind.PAGE, 2, 0, n, good.payload[:-1]),
        "position beyond int64": HostObject(ObjectKind.PAGE, 2, 1 << 63, n, good.payload),
    }[bad]
    expected = _raised(lambda: _local().put([obj]))
    assert expected is not None
    with pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$"):
        l2.put([good, obj])
    assert l2._store.objects == {}  # nothing of the call reached the store
    assert l2.stats().puts == l2.stats().dropped_writes == 0
    l2.close()


def test_a_negative_position_is_stored_and_read_back_as_the_local_tier_does():
    l2, local = _backend({}), _local()
    for tier in (l2, local):
        obj = attrs.evolve(_page(tier, 1), position=-3)
        assert tier.put([obj]) == 1
        got = tier.get(ObjectKind.PAGE, [1], [-3])[0]
        assert got is not None and torch.equal(got, obj.payload)
        assert tier.get(ObjectKind.PAGE, [1], [3]) == [None]  # another position: rejected
    l2.close()


def test_local_buffer_must_hold_a_checkpoint():
    g = tiny_geometry()
    with pytest.raises(ValueError, match="local_buffer_bytes"):
        _backend({}, local_buffer_bytes=g.kda_state_bytes + HEADER_BYTES - 1)
