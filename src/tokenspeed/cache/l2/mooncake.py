"""The shared L2 backend: a Mooncake store reached by every engine pointing at the same master.

Topology (see docs/cache.md): one `mooncake_master` per cluster holds the metadata; the bytes live
in the *segments* that store clients register with it. Segments vanish with the process that owns
them, so a deployment runs long-lived segment owners (`mooncake_client`, one per host, or engines
configured with `global_segment_bytes > 0` if they are long-lived themselves); engines then join
with `global_segment_bytes=0` and read and write through the owners.

Failure handling: every store call runs on this backend's own worker thread with a timeout. A
failed or timed-out call (master killed, RPC error, transfer error) marks the backend down for
`retry_interval_s`: meanwhile every lookup answers "absent", every read returns nothing and every
write is dropped without touching the network, so the engine goes on at full speed as if the tier
were empty. After the interval the next call tries again (reconnecting if setup never succeeded).
Every object read back is checked against its header (see `codec.py`) before use; one that fails
the check is removed from the store, so that the prefix can be written again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ...types import PageKey
from ..config import CacheGeometry
from ..errors import CacheConfigError, IntegrityError
from ..keys import PageKeys, as_page_keys, keys_to_ints
from .base import HostCache, HostObject, L2Stats, ObjectKind
from .codec import HEADER_BYTES, decode, encode_header, object_name

logger = logging.getLogger("tokenspeed.cache.l2")

# Mooncake error codes that mean the store is unreachable (as opposed to e.g. "no space").
_UNREACHABLE_CODES = frozenset({-800, -900})
_U64 = (1 << 64) - 1


def _check_payload(obj: HostObject) -> None:
    """`LocalHostCache.put`'s checks, with its errors: a malformed object is the caller's bug,
    which must surface the same whichever backend is configured, not be dropped as a failure."""
    if obj.payload is None or obj.payload.dtype != torch.uint8:
        raise IntegrityError(f"{obj.kind} {obj.key!r}: a uint8 payload is required")
    if obj.payload.numel() != obj.nbytes:
        raise IntegrityError(
            f"{obj.kind} {obj.key!r}: payload of {obj.payload.numel()} bytes, declared {obj.nbytes}"
        )


def _header_position(position: int) -> int:
    """The position as the header's unsigned 64-bit field holds it. The local tier keeps any
    int64 position (an int64 column): so does this one, a negative one as its two's complement,
    and beyond int64 both raise numpy's OverflowError."""
    return int(np.int64(position)) & _U64


def _read_position(position: int) -> int:
    """`_header_position` for a read: a position no object can be stored at becomes -1, which
    no (unsigned) header field equals, so the object is rejected as the local tier rejects it."""
    try:
        return _header_position(position)
    except (OverflowError, TypeError, ValueError):
        return -1


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise CacheConfigError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CacheConfigError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _address(instance: object, attribute: attrs.Attribute, value: object) -> None:
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit():
        raise CacheConfigError(f"{attribute.name} must be 'host:port', got {value!r}")


@attrs.frozen(kw_only=True)
class MooncakeConfig:
    """How this process joins a Mooncake store.

    master_address: the master's RPC address, "host:port".
    local_hostname: the address other clients reach this one at (its transfer endpoint).
    metadata_server: "P2PHANDSHAKE" (clients exchange segment metadata directly; no HTTP
        metadata server or etcd needed).
    protocol / device_name: "tcp", or "rdma" with the RDMA devices to use.
    global_segment_bytes: memory this process contributes to the shared pool. Keep 0 for engines
        and let long-lived segment owners hold the data.
    local_buffer_bytes: this client's registered staging buffer; must hold the largest object
        (one checkpoint: every KDA layer's state) plus a 64-byte header.
    namespace: prefix of every object name (several deployments may share one master).
    op_timeout_s: a store call taking longer counts as a failure.
    retry_interval_s: how long the backend stays down after a failure before trying again.
    checksum: write a CRC32 per object and verify it on read.
    max_batch_bytes: payload bytes per batched put / get call (default: half the local buffer).
    """

    master_address: str = attrs.field(validator=_address)
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_bytes: int = attrs.field(default=0, validator=_non_negative_int)
    local_buffer_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    namespace: str = "tokenspeed"
    op_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    retry_interval_s: float = attrs.field(default=5.0, validator=_positive)
    checksum: bool = True
    max_batch_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )

    @property
    def batch_bytes(self) -> int:
        return self.max_batch_bytes or self.local_buffer_bytes // 2


class _Unavailable(Exception):
    """The store cannot be used right now (down, failed, timed out)."""


class _Worker:
    """One daemon thread that runs store calls, so a hung call can be abandoned on timeout."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the waiting caller
                box.append((False, exc))
            done.set()

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            raise _Unavailable(f"store call timed out after {timeout} s")
        ok, value = box[0]
        if not ok:
            raise _Unavailable(f"store call raised {value!r}") from value
        return value

    def stop(self) -> None:
        self._jobs.put(None)


def _default_store_factory() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


class MooncakeHostCache(HostCache):
    """L2 over a Mooncake distributed store (see the module docstring for the failure model).

    store_factory: builds the store client (the `MooncakeDistributedStore` API: setup,
        batch_is_exist, put_batch, get_batch, close); tests pass one that fails on purpose.
    """

    backend_name = "mooncake"

    def __init__(
        self, config: MooncakeConfig, *, store_factory: Callable[[], Any] | None = None
    ) -> None:
        super().__init__(metadata_only=False)
        self.config = config
        self._factory = store_factory or _default_store_factory
        self._worker = _Worker(f"tokenspeed-mooncake-{id(self):x}")
        weakref.finalize(self, self._worker.stop)  # the thread ends with the tier
        self._store: Any = None
        self._down_until = 0.0
        self._closed = False
        self._fingerprint = ""
        try:
            self._connect()
        except _Unavailable as exc:
            self._trip(exc)

    def bind(self, geometry: CacheGeometry, *, metadata_only: bool) -> None:
        super().bind(geometry, metadata_only=metadata_only)
        largest = max(geometry.mla_page_bytes, geometry.kda_checkpoint_bytes) + HEADER_BYTES
        if self.config.local_buffer_bytes < largest:
            raise CacheConfigError(
                f"local_buffer_bytes={self.config.local_buffer_bytes} cannot hold one object of "
                f"{largest} bytes (a checkpoint of every KDA layer, plus its header)"
            )
        self._fingerprint = geometry.fingerprint

    # ------------------------------------------------------------------- store access
    def _connect(self) -> None:
        cfg = self.config

        def setup() -> Any:
            store = self._factory()
            rc = store.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_bytes,
                cfg.local_buffer_bytes,
                cfg.protocol,
                cfg.device_name,
                cfg.master_address,
            )
            if rc != 0:
                raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
            return store

        self._store = self._worker.run(setup, cfg.op_timeout_s)
        logger.info("joined the Mooncake store at %s", cfg.master_address)

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise _Unavailable("closed")
        if time.monotonic() < self._down_until:
            raise _Unavailable("down")
        try:
            if self._store is None:
                self._connect()
            store = self._store
            return self._worker.run(lambda: getattr(store, method)(*args), self.config.op_timeout_s)
        except _Unavailable as exc:
            self._trip(exc)
            raise

    def _trip(self, reason: BaseException | str) -> None:
        self.counters.errors += 1
        self._down_until = time.monotonic() + self.config.retry_interval_s
        logger.warning(
            "Mooncake L2 unavailable (%s); treating it as empty for %.1f s",
            reason,
            self.config.retry_interval_s,
        )

    def _name(self, kind: ObjectKind, key: PageKey) -> str:
        return object_name(self.config.namespace, self._fingerprint, kind, key)

    # --------------------------------------------------------------------- interface
    def contains(self, kind: ObjectKind, keys: PageKeys) -> np.ndarray:
        ints = keys_to_ints(as_page_keys(keys))
        if not ints:
            return np.zeros(0, dtype=bool)
        self.counters.lookups += len(ints)
        try:
            codes = self._call("batch_is_exist", [self._name(kind, k) for k in ints])
        except _Unavailable:
            return np.zeros(len(ints), dtype=bool)
        if len(codes) != len(ints):
            self.counters.errors += 1
            return np.zeros(len(ints), dtype=bool)
        failed = sum(1 for code in codes if code < 0)
        if failed == len(codes):
            self._trip("batch_is_exist failed for every key")
        elif failed:
            self.counters.errors += 1
        return np.array([code == 1 for code in codes], dtype=bool)

    def put(self, objects: Sequence[HostObject]) -> int:
        """Counts the objects the store acknowledged (a batch `put_batch` returned 0 for) or, for
        a batch that failed, those the store holds right after (a batch may fail part-way, and
        an object already present counts): the most a shared store can tell, since the master
        evicts by its own watermark policy, outside this call. Malformed objects raise as in
        `LocalHostCache.put`, checked before any of the call reaches the store."""
        positions = [self._checked_position(obj) for obj in objects]
        stored = 0
        batch: list[tuple[HostObject, bytes]] = []
        batch_bytes = 0
        for obj, position in zip(objects, positions, strict=True):
            payload = memoryview(obj.payload.contiguous().numpy())
            header = encode_header(
                obj.kind,
                obj.key,
                position,
                payload,
                self._fingerprint,
                checksum=self.config.checksum,
            )
            batch.append((obj, header + payload.tobytes()))
            batch_bytes += obj.nbytes
            if batch_bytes >= self.config.batch_bytes:
                stored += self._put_batch(batch)
                batch, batch_bytes = [], 0
        if batch:
            stored += self._put_batch(batch)
        return stored

    @staticmethod
    def _checked_position(obj: HostObject) -> int:
        """The header position of an object `_check_payload` accepts (raises as the local tier)."""
        _check_payload(obj)
        return _header_position(obj.position)

    def _put_batch(self, batch: list[tuple[HostObject, bytes]]) -> int:
        c = self.counters
        names = [self._name(obj.kind, obj.key) for obj, _ in batch]
        try:
            rc = self._call("put_batch", names, [blob for _, blob in batch])
        except _Unavailable:
            c.dropped_writes += len(batch)
            return 0
        if rc == 0:
            stored = [True] * len(batch)
        elif rc in _UNREACHABLE_CODES:
            self._trip(f"put_batch returned {rc}")
            stored = [False] * len(batch)
        else:
            stored = self._present_after_failed_put(names)
        n = sum(stored)
        c.puts += n
        c.put_bytes += sum(obj.nbytes for (obj, _), ok in zip(batch, stored, strict=True) if ok)
        c.dropped_writes += len(batch) - n
        return n

    def _present_after_failed_put(self, names: list[str]) -> list[bool]:
        """Which objects of a failed batch the store holds: a batch can fail part-way (room for
        some objects only), and objects already present stay; all False if it cannot tell."""
        try:
            codes = self._call("batch_is_exist", names)
        except _Unavailable:
            return [False] * len(names)
        if len(codes) != len(names):
            self.counters.errors += 1
            return [False] * len(names)
        return [code == 1 for code in codes]

    def get(
        self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        keys = keys_to_ints(as_page_keys(keys))
        out: list[torch.Tensor | None] = []
        per_object = self.object_bytes(kind)
        step = max(1, self.config.batch_bytes // max(per_object, 1))
        for start in range(0, len(keys), step):
            end = start + step
            out += self._get_batch(kind, keys[start:end], positions[start:end])
        return out

    def _get_batch(
        self, kind: ObjectKind, keys: Sequence[PageKey], positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        c = self.counters
        nbytes = self.object_bytes(kind)
        try:
            blobs = self._call("get_batch", [self._name(kind, k) for k in keys])
        except _Unavailable:
            c.misses += len(keys)
            return [None] * len(keys)
        if len(blobs) != len(keys):
            self.counters.errors += 1
            c.misses += len(keys)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        rejected: list[str] = []
        for key, position, blob in zip(keys, positions, blobs, strict=True):
            if not blob:
                c.misses += 1
                out.append(None)
                continue
            payload = decode(
                blob,
                kind,
                key,
                _read_position(position),
                nbytes,
                self._fingerprint,
                checksum=self.config.checksum,
            )
            if payload is None:
                c.corrupt += 1
                c.misses += 1
                rejected.append(self._name(kind, key))
                out.append(None)
                continue
            c.hits += 1
            c.get_bytes += nbytes
            out.append(torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()))
        if rejected:
            self._discard(rejected)
        return out

    def _discard(self, names: list[str]) -> None:
        """Remove objects a read rejected, best effort. Left in the store, one would go on
        answering present to `contains` while never reading back, and block the rewrite that
        would heal it (a put of an existing name keeps the old object). A failed removal only
        costs that: it trips the backend like any failed call and is not raised."""
        with contextlib.suppress(_Unavailable):  # counted and logged by `_call` (a trip)
            self._call("batch_remove", names, True)

    def remove(self, kind: ObjectKind, keys: PageKeys) -> int:
        ints = keys_to_ints(as_page_keys(keys))
        if not ints:
            return 0
        try:
            codes = self._call("batch_remove", [self._name(kind, k) for k in ints], True)
        except _Unavailable:
            return 0
        return sum(1 for code in codes if code == 0)

    def stats(self) -> L2Stats:
        return L2Stats(
            backend=self.backend_name,
            available=self._store is not None and time.monotonic() >= self._down_until,
            objects=-1,
            bytes=-1,
            capacity_bytes=-1,
            **attrs.asdict(self.counters),
        )

    def close(self) -> None:
        """Leave the store. If the store is down, the client is abandoned rather than closed
        (closing waits for the unreachable master for many seconds)."""
        if self._closed:
            return
        store, self._store = self._store, None
        if store is not None and time.monotonic() >= self._down_until:
            try:
                self._worker.run(store.close, self.config.op_timeout_s)
            except _Unavailable as exc:
                logger.warning("closing the Mooncake client failed: %s", exc)
        self._closed = True
        self._worker.stop()
