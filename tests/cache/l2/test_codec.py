"""The L2 object header: anything that is not exactly the expected object decodes to None."""

from __future__ import annotations

import zlib

from tokenspeed.cache import ObjectKind
from tokenspeed.cache.l2.codec import HEADER_BYTES, decode, encode_header, object_name

FP = "0123456789ab"
PAYLOAD = memoryview(bytes(range(200)))


def _blob(**overrides) -> bytes:
    args = dict(kind=ObjectKind.PAGE, key=1 << 100, position=3, payload=PAYLOAD, fingerprint=FP)
    args.update(overrides)
    return encode_header(checksum=True, **args) + bytes(args["payload"])


def _decode(blob, **overrides):
    args = dict(kind=ObjectKind.PAGE, key=1 << 100, position=3, nbytes=200, fingerprint=FP)
    args.update(overrides)
    return decode(blob, checksum=True, **args)


def test_roundtrip():
    payload = _decode(_blob())
    assert payload is not None and bytes(payload) == bytes(PAYLOAD)
    assert HEADER_BYTES == 64


def test_every_mismatch_is_rejected():
    blob = _blob()
    assert _decode(blob, key=(1 << 100) + 1) is None
    assert _decode(blob, position=4) is None
    assert _decode(blob, kind=ObjectKind.CHECKPOINT) is None
    assert _decode(blob, fingerprint="ba9876543210") is None
    assert _decode(blob, nbytes=199) is None
    assert _decode(blob[:-1]) is None  # truncated
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    assert _decode(bytes(flipped)) is None  # CRC
    assert _decode(b"") is None


def test_checksum_can_be_skipped_by_writer():
    blob = encode_header(ObjectKind.PAGE, 5, 0, PAYLOAD, FP, checksum=False) + bytes(PAYLOAD)
    assert decode(blob, ObjectKind.PAGE, 5, 0, 200, FP, checksum=True) is not None
    assert zlib.crc32(PAYLOAD) != 0


def test_object_names_are_namespaced():
    a = object_name("ns", FP, ObjectKind.PAGE, 5)
    assert a.startswith("ns/" + FP + "/p/") and a != object_name("ns", FP, ObjectKind.CHECKPOINT, 5)
