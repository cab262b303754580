"""The host tier (L2) interface: a content-addressed store of pages and checkpoints.

Objects are named by (kind, chained key). Because a key names a whole prefix, an object never
changes once written, so writers need no coordination: writing a key that exists is a no-op.

Contract every backend keeps:

- No method raises because the backend failed (master gone, RPC error, timeout, full store):
  lookups answer "absent", writes are dropped, reads return None, and `L2Stats.errors` /
  `dropped_writes` count what happened.
- `get` never returns wrong bytes: each object carries its kind, key, position (page index, or the
  checkpoint's token length) and payload size, optionally a CRC32 of the payload; an object that
  does not match what the caller expects is rejected (counted in `corrupt`) and reported absent.
- In metadata-only mode objects have sizes but no payloads; `get` returns an empty tensor for a
  present object.
- Keys come as `PageKeys` arrays (a backend may also be handed a list of int keys: read them with
  `as_page_keys`); one key on its own (`HostObject.key`) is an int.
- Instances hold no process-wide state; several `CacheManager`s (ranks) may share one instance.
  An instance is driven from one thread at a time.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from ...types import PageKey
from ..config import CacheGeometry
from ..errors import CacheConfigError
from ..keys import PageKeys, as_key_int, as_page_keys, keys_to_ints


class ObjectKind(enum.Enum):
    PAGE = "p"
    CHECKPOINT = "c"


@attrs.frozen
class HostObject:
    """One object to write. payload: flat uint8 CPU tensor of `nbytes` (None when metadata-only).
    position: page index in its chain (pages) or the prefix length L (checkpoints)."""

    kind: ObjectKind
    key: PageKey = attrs.field(converter=as_key_int)
    position: int
    nbytes: int
    payload: torch.Tensor | None = None


@attrs.frozen
class L2Stats:
    backend: str
    available: bool  # False while the backend is considered down
    objects: int  # -1 where the backend cannot tell (shared remote store)
    bytes: int
    capacity_bytes: int
    lookups: int  # keys asked about
    hits: int  # objects read back successfully
    misses: int  # objects asked for and not returned
    puts: int  # objects newly stored (a later eviction does not take one back)
    put_bytes: int
    dropped_writes: int  # objects that could not be stored (full, failed, too large)
    get_bytes: int
    corrupt: int  # objects rejected by the integrity check
    errors: int  # backend failures (exceptions, RPC errors, timeouts): the warning counter
    evictions: int

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.define
class L2Counters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    dropped_writes: int = 0
    get_bytes: int = 0
    corrupt: int = 0
    errors: int = 0
    evictions: int = 0


class HostCache(ABC):
    """Base of the L2 backends. Subclasses implement the abstract methods."""

    backend_name = "abstract"

    def __init__(self, *, metadata_only: bool) -> None:
        self.metadata_only = metadata_only
        self.geometry: CacheGeometry | None = None
        # (geometry, page bytes, checkpoint bytes): `object_bytes` is asked on every batch, and
        # the geometry's sizes are products computed on each access.
        self._sizes: tuple[CacheGeometry | None, int, int] = (None, 0, 0)
        self.counters = L2Counters()

    def bind(self, geometry: CacheGeometry, *, metadata_only: bool) -> None:
        """Called by each CacheManager that uses this tier: all must share one byte layout and
        the same mode."""
        if metadata_only != self.metadata_only:
            raise CacheConfigError(
                f"metadata_only={metadata_only} manager cannot use an L2 tier with "
                f"metadata_only={self.metadata_only}"
            )
        if self.geometry is None:
            self.geometry = geometry
        elif self.geometry.fingerprint != geometry.fingerprint:
            raise CacheConfigError(
                "geometry differs from the one this L2 tier is bound to: managers that share an "
                "L2 must share a CacheGeometry"
            )

    def object_bytes(self, kind: ObjectKind) -> int:
        g, page, checkpoint = self._sizes
        if g is not self.geometry:  # bound since the last call (or never)
            g = self.geometry
            assert g is not None, "bind() first"
            g, page, checkpoint = self._sizes = (g, g.mla_page_bytes, g.kda_checkpoint_bytes)
        return page if kind is ObjectKind.PAGE else checkpoint

    @abstractmethod
    def contains(self, kind: ObjectKind, keys: PageKeys) -> np.ndarray:
        """[n] bool: presence of each key (a hint: the object may vanish before it is read)."""

    def prefix_present(self, kind: ObjectKind, keys: PageKeys) -> int:
        """Number of leading keys present (keys: consecutive pages of one chain, in order)."""
        absent = np.flatnonzero(~np.asarray(self.contains(kind, keys), dtype=bool))
        return int(absent[0]) if len(absent) else len(keys)

    def last_present(self, kind: ObjectKind, keys: PageKeys) -> int:
        """Index of the last present key, -1 if none."""
        present = np.flatnonzero(np.asarray(self.contains(kind, keys), dtype=bool))
        return int(present[-1]) if len(present) else -1

    def presence_version(self) -> int | None:
        """A number that changes whenever an object may have been stored or may have left, so
        that an unchanged number means every presence answer is unchanged; None where the
        backend cannot tell (a store other processes write to)."""
        return None

    @abstractmethod
    def put(self, objects: Sequence[HostObject]) -> int:
        """Store objects (existing keys are kept as they are); returns how many of them are
        stored when the call returns, counted per object given: one already present counts,
        one dropped (too large, failed) does not, nor one that a later object of the same call
        evicted again. A shared store counts what it acknowledged (others may remove objects
        at any time). Always in [0, len(objects)]."""

    def put_many(
        self,
        kind: ObjectKind,
        keys: PageKeys,
        positions: Sequence[int],
        payloads: Sequence[torch.Tensor] | None = None,
        *,
        chain: bool = False,
    ) -> int:
        """`put` of objects of one kind and the bound geometry's size (`object_bytes`), given as
        parallel sequences (payloads None when metadata-only). Backends may do it in one batch;
        the count returned is `put`'s: this call's objects stored when it returns.

        chain: the keys are consecutive pages of one chain (a turn's pages), positions rising by
            one: a hint a backend may keep to answer later prefix checks over them faster; it
            never changes a result."""
        nbytes = self.object_bytes(kind)
        ints = keys_to_ints(as_page_keys(keys))
        if payloads is None:
            payloads = [None] * len(ints)
        return self.put(
            [
                HostObject(kind, key, position, nbytes, payload)
                for key, position, payload in zip(ints, positions, payloads, strict=True)
            ]
        )

    @abstractmethod
    def get(
        self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """Verified payloads ([nbytes] uint8 CPU tensors), None where absent or rejected."""

    def get_present(self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]) -> np.ndarray:
        """[n] bool: which of the objects `get` would return, with the same touches, counts and
        drops, for a caller that keeps no payloads (a metadata-only cache)."""
        return np.array([p is not None for p in self.get(kind, keys, positions)], dtype=bool)

    @abstractmethod
    def remove(self, kind: ObjectKind, keys: PageKeys) -> int:
        """Delete objects (invalidation, tests); returns how many were removed."""

    @abstractmethod
    def stats(self) -> L2Stats: ...

    def check_integrity(self) -> None:
        """Raise IntegrityError if the tier's own bookkeeping is inconsistent."""
        return None

    def close(self) -> None:
        """Release connections and threads. Idempotent."""
        return None
