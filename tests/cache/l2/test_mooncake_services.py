"""Starting and stopping Mooncake processes: free ports, loopback, nothing left behind."""

from __future__ import annotations

import socket

import pytest

from tokenspeed.cache.l2.mooncake_services import (
    ServiceError,
    free_port,
    start_master,
    start_segment_owner,
)

from .mooncake_env import needs_mooncake, require_mooncake

pytestmark = needs_mooncake


@pytest.fixture(autouse=True)
def _mooncake_runs_here() -> None:
    require_mooncake()


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def test_two_masters_on_free_ports_and_an_owner(tmp_path):
    a = start_master(log_dir=tmp_path)
    b = start_master(log_dir=tmp_path)
    try:
        assert a.address != b.address and a.address.startswith("127.0.0.1:")
        assert _listening(a.address) and _listening(b.address)
        owner = start_segment_owner(master_address=a.address, segment_bytes=16 << 20)
        assert owner.alive() and _listening(owner.address)
        owner.stop()
        assert not owner.alive()
    finally:
        a.stop()
        b.stop()
    assert not a.alive() and not b.alive()
    assert not _listening(a.address)


def test_a_service_that_cannot_start_is_reported():
    with pytest.raises(ServiceError):
        start_master(extra_args=["--rpc_port=not-a-number"], timeout=5, attempts=1)
    assert 0 < free_port() < 65536
