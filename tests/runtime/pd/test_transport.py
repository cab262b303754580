"""The transports alone: bytes land where the ranges say, notifications, peers that are gone."""

import socket
import time

import pytest
import torch

from tokenspeed.cache.handoff import ByteRange
from tokenspeed.runtime.pd import HandoffError, make_transport

KINDS = pytest.mark.parametrize("kind", ["mooncake", "socket"])


def _regions(seed: int, sizes=(("mla", 1 << 20), ("conv", 4096), ("recurrent", 8192))):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for k, n in sizes}


@pytest.fixture
def ends(request):
    kind = request.param
    src, dst = make_transport(kind, timeout_s=5), make_transport(kind, timeout_s=5)
    src_regions, dst_regions = _regions(1), _regions(2)
    src.register(src_regions)
    dst.register(dst_regions)
    yield src, dst, src_regions, dst_regions
    src.close()
    dst.close()


def _wait_arrivals(transport, n=1, seconds=10.0):
    got, deadline = [], time.monotonic() + seconds
    while len(got) < n:
        assert time.monotonic() < deadline, "no notification arrived"
        got += transport.arrivals()
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("ends", ["mooncake", "socket"], indirect=True)
def test_ranges_land_exactly_and_the_notification_follows(ends):
    src, dst, sr, dr = ends
    dst.set_acceptor(lambda rid: None if rid == "r" else "not awaited")
    ranges = [
        ByteRange("mla", 100, 5000, 70_000),
        ByteRange("mla", 300_000, 0, 4096),
        ByteRange("conv", 0, 2048, 2048),
        ByteRange("recurrent", 4096, 0, 4096),
    ]
    before = {k: v.clone() for k, v in dr.items()}
    src.write(dst.endpoint(), "r", ranges)
    expected = {k: v.clone() for k, v in before.items()}
    for r in ranges:
        expected[r.region][r.dst_offset : r.dst_offset + r.nbytes] = sr[r.region][
            r.src_offset : r.src_offset + r.nbytes
        ]
    for k in dr:
        assert torch.equal(dr[k], expected[k]), k
    src.notify(dst.endpoint(), {"type": "arrived", "rid": "r", "first": {"token": 5}})
    (msg,) = _wait_arrivals(dst)
    assert msg["rid"] == "r" and msg["first"]["token"] == 5


@pytest.mark.parametrize("ends", ["mooncake", "socket"], indirect=True)
def test_a_request_not_awaited_is_refused(ends):
    src, dst, _, dr = ends
    dst.set_acceptor(lambda rid: f"{rid!r} is not awaited")
    with pytest.raises(HandoffError, match="not awaited"):
        src.notify(dst.endpoint(), {"type": "arrived", "rid": "z", "first": {"token": 1}})
    # Still queued: the write has ended either way, so the destination may be freed.
    assert _wait_arrivals(dst)[0]["rid"] == "z"
    if src.kind == "socket":  # the socket fallback's data is refused before any byte lands
        before = dr["mla"].clone()
        with pytest.raises(HandoffError, match="refused"):
            src.write(dst.endpoint(), "z", [ByteRange("mla", 0, 0, 64)])
        assert torch.equal(dr["mla"], before)


@pytest.mark.parametrize("ends", ["mooncake", "socket"], indirect=True)
def test_ranges_outside_a_region_are_refused(ends):
    src, dst, _, dr = ends
    dst.set_acceptor(lambda rid: None)
    before = dr["conv"].clone()
    with pytest.raises(HandoffError, match="outside"):
        src.write(dst.endpoint(), "r", [ByteRange("conv", 0, 4000, 200)])
    with pytest.raises(HandoffError, match="outside"):
        src.write(dst.endpoint(), "r", [ByteRange("conv", 4000, 0, 200)])
    assert torch.equal(dr["conv"], before)


@KINDS
def test_a_peer_that_is_gone_or_silent_raises_in_bounded_time(kind):
    src = make_transport(kind, timeout_s=1)
    src.register(_regions(1))
    gone = make_transport(kind, timeout_s=1)
    gone.register(_regions(2))
    endpoint = gone.endpoint()
    gone.close()
    try:
        with pytest.raises(HandoffError, match="gone"):
            src.notify(endpoint, {"type": "arrived", "rid": "r", "first": {"token": 1}})
        if kind == "socket":
            with pytest.raises(HandoffError, match="gone"):
                src.write(endpoint, "r", [ByteRange("mla", 0, 0, 64)])
        # A peer that accepts connections but never answers.
        with socket.create_server(("127.0.0.1", 0)) as silent:
            port = silent.getsockname()[1]
            t0 = time.monotonic()
            with pytest.raises(HandoffError, match="did not answer within"):
                src.notify(
                    {"kind": "socket", "address": f"127.0.0.1:{port}"},
                    {"type": "arrived", "rid": "r", "first": {"token": 1}},
                )
            assert time.monotonic() - t0 < 10
    finally:
        src.close()


def test_a_mooncake_write_to_a_session_nobody_serves_fails():
    src = make_transport("mooncake", timeout_s=2)
    src.register(_regions(1))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = {
        "kind": "mooncake",
        "address": f"127.0.0.1:{port}",
        "session": f"127.0.0.1:{port}",
        "regions": {"mla": [1 << 30, 1 << 20]},
    }
    try:
        t0 = time.monotonic()
        with pytest.raises(HandoffError, match="Mooncake write"):
            src.write(endpoint, "r", [ByteRange("mla", 0, 0, 64)])
        assert time.monotonic() - t0 < 30
    finally:
        src.close()


def test_a_socket_sender_reaches_a_mooncake_receiver():
    src, dst = make_transport("socket", timeout_s=5), make_transport("mooncake", timeout_s=5)
    sr, dr = _regions(1), _regions(2)
    src.register(sr)
    dst.register(dr)
    dst.set_acceptor(lambda rid: None)
    try:
        src.write(dst.endpoint(), 7, [ByteRange("recurrent", 0, 64, 1024)])
        assert torch.equal(dr["recurrent"][64 : 64 + 1024], sr["recurrent"][:1024])
    finally:
        src.close()
        dst.close()
