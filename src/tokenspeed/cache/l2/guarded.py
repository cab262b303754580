"""A wrapper that holds any L2 backend to the "never raise, never return wrong bytes" contract.

Backends already degrade on their own; this is the second line, so that a buggy or third-party
backend that raises, or returns a payload of the wrong size, costs a miss instead of a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from ..keys import PageKeys
from .base import HostCache, HostObject, L2Stats, ObjectKind

logger = logging.getLogger("tokenspeed.cache.l2")
T = TypeVar("T")
_RAISED = object()  # what `_guard` hands back when the backend call raised


class GuardedL2:
    """Same calls as `HostCache` (those the cache uses); failures become safe answers.

    on_error: called once per swallowed failure (the cache counts them in its stats).
    """

    def __init__(self, inner: HostCache, on_error: Callable[[], None]) -> None:
        self.inner = inner
        self._on_error = on_error

    def _guard(self, what: str, fallback: T, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # the contract says backends do not raise; survive if they do
            self._failed(what, exc)
            return fallback

    def _failed(self, what: str, exc: Exception) -> None:
        self._on_error()
        logger.warning("L2 %s raised %r; treated as a miss / dropped write", what, exc)

    def _refused(self, what: str, answer: object) -> None:
        """A backend answered something that is not an answer: counted like a raise."""
        self._on_error()
        logger.warning("L2 %s answered %.80r; treated as a miss", what, answer)

    def _count(self, what: str, n: object, lo: int | None, hi: int | None, fallback: T) -> int | T:
        """`n` as an int in [lo, hi] (None: unbounded), else `fallback`, the answer refused."""
        if type(n) is int and (lo is None or n >= lo) and (hi is None or n <= hi):
            return n  # what the backends answer (checked on every call: the cheap test first)
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool):
            n = int(n)
            if (lo is None or n >= lo) and (hi is None or n <= hi):
                return n
        self._refused(what, n)
        return fallback

    def _flags(self, what: str, out: object, n: int) -> np.ndarray:
        """`out` as [n] bool, or all False when it is not n flags (None: the call raised, which
        is already counted)."""
        if type(out) is np.ndarray and out.dtype == np.bool_ and out.shape == (n,):
            return out  # what the backends return: no conversion
        if out is None:
            return np.zeros(n, dtype=bool)
        try:
            present = np.asarray(out, dtype=bool)
        except Exception:  # whatever converting a nonsense answer raises
            present = None
        if present is None or present.shape != (n,):
            self._refused(what, out)
            return np.zeros(n, dtype=bool)
        return present

    # The calls below are made per request on long histories: each guards its backend call
    # inline (a try block costs nothing when nothing is raised).
    def contains(self, kind: ObjectKind, keys: PageKeys) -> np.ndarray:
        """[n] bool (all False when the backend failed or answered something else)."""
        try:
            out = self.inner.contains(kind, keys)
        except Exception as exc:  # the contract says backends do not raise; survive if they do
            self._failed("contains", exc)
            out = None
        return self._flags("contains", out, len(keys))

    def prefix_present(self, kind: ObjectKind, keys: PageKeys) -> int:
        try:
            n = self.inner.prefix_present(kind, keys)
        except Exception as exc:
            self._failed("prefix_present", exc)
            return 0
        return self._count("prefix_present", n, 0, len(keys), 0)

    def last_present(self, kind: ObjectKind, keys: PageKeys) -> int:
        try:
            i = self.inner.last_present(kind, keys)
        except Exception as exc:
            self._failed("last_present", exc)
            return -1
        return self._count("last_present", i, -1, len(keys) - 1, -1)

    def presence_version(self) -> int | None:
        v = self._guard("presence_version", None, self.inner.presence_version)
        return None if v is None else self._count("presence_version", v, None, None, None)

    def put(self, objects: Sequence[HostObject]) -> int:
        n = self._guard("put", None, lambda: self.inner.put(objects))
        return 0 if n is None else self._count("put", n, 0, len(objects), 0)

    def put_many(
        self,
        kind: ObjectKind,
        keys: PageKeys,
        positions: Sequence[int],
        payloads: Sequence[torch.Tensor] | None = None,
        *,
        chain: bool = False,
    ) -> int:
        try:
            n = self.inner.put_many(kind, keys, positions, payloads, chain=chain)
        except Exception as exc:
            self._failed("put_many", exc)
            return 0
        return self._count("put_many", n, 0, len(keys), 0)

    def get(
        self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]
    ) -> list[torch.Tensor | None]:
        out = self._guard("get", _RAISED, lambda: self.inner.get(kind, keys, positions))
        if out is _RAISED:
            return [None] * len(keys)
        if not isinstance(out, (list, tuple)) or len(out) != len(keys):
            self._refused("get", out)
            return [None] * len(keys)
        expected = 0 if self.inner.metadata_only else self.inner.object_bytes(kind)
        # A backend usually returns a few distinct objects many times (metadata-only: one
        # shared empty tensor): check each distinct one once and keep the answer when all pass.
        distinct = dict(zip(map(id, out), out, strict=True))
        if all(self._payload_ok(p, expected) for p in distinct.values()):
            return list(out)
        checked: list[torch.Tensor | None] = []
        for payload in out:
            ok = self._payload_ok(payload, expected)
            if payload is not None and not ok:
                self._on_error()
            checked.append(payload if ok else None)
        return checked

    def get_present(self, kind: ObjectKind, keys: PageKeys, positions: Sequence[int]) -> np.ndarray:
        """[n] bool (all False when the backend failed or answered something else)."""
        try:
            out = self.inner.get_present(kind, keys, positions)
        except Exception as exc:
            self._failed("get_present", exc)
            out = None
        return self._flags("get_present", out, len(keys))

    def stats(self) -> L2Stats | None:
        """The backend's stats; None when asking raised (a stats call must not fail a caller)."""
        return self._guard("stats", None, self.inner.stats)

    @staticmethod
    def _payload_ok(payload: object, expected: int) -> bool:
        return (
            isinstance(payload, torch.Tensor)
            and payload.dtype == torch.uint8
            and payload.numel() == expected
            and payload.device.type == "cpu"
        )
