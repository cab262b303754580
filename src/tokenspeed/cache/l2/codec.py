"""Self-describing byte layout of an L2 object in a store shared across processes.

    header (64 bytes, little-endian) | payload

The header repeats what the reader already expects (kind, key, position, payload size, byte-layout
fingerprint) and optionally a CRC32 of the payload. A reader rejects an object unless every field
matches, so a truncated, stale, foreign or corrupted object is a miss, never wrong bytes.
"""

from __future__ import annotations

import struct
import zlib

from ...types import PageKey
from .base import ObjectKind

MAGIC = b"TSL2"
VERSION = 1
_FLAG_CRC = 1
_KIND_CODE = {ObjectKind.PAGE: 0, ObjectKind.CHECKPOINT: 1}
# magic, version, flags, kind, pad, fingerprint(6), key(16), position, payload size, crc, pad
_HEADER = struct.Struct("<4sBBBx6s16sQQI14x")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64


def object_name(namespace: str, fingerprint: str, kind: ObjectKind, key: PageKey) -> str:
    return f"{namespace}/{fingerprint}/{kind.value}/{key:032x}"


def encode_header(
    kind: ObjectKind,
    key: PageKey,
    position: int,
    payload: memoryview,
    fingerprint: str,
    *,
    checksum: bool,
) -> bytes:
    crc = zlib.crc32(payload) if checksum else 0
    return _HEADER.pack(
        MAGIC,
        VERSION,
        _FLAG_CRC if checksum else 0,
        _KIND_CODE[kind],
        bytes.fromhex(fingerprint),
        key.to_bytes(16, "little"),
        position,
        payload.nbytes,
        crc,
    )


def decode(
    blob: bytes | memoryview,
    kind: ObjectKind,
    key: PageKey,
    position: int,
    nbytes: int,
    fingerprint: str,
    *,
    checksum: bool,
) -> memoryview | None:
    """The payload if `blob` is exactly the expected object, else None."""
    view = memoryview(blob)
    if view.nbytes != HEADER_BYTES + nbytes:
        return None
    magic, version, flags, kind_code, fp, key_bytes, pos, size, crc = _HEADER.unpack_from(view)
    if (
        magic != MAGIC
        or version != VERSION
        or kind_code != _KIND_CODE[kind]
        or fp != bytes.fromhex(fingerprint)
        or key_bytes != key.to_bytes(16, "little")
        or pos != position
        or size != nbytes
    ):
        return None
    payload = view[HEADER_BYTES:]
    if checksum and flags & _FLAG_CRC and zlib.crc32(payload) != crc:
        return None
    return payload
