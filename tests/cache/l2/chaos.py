"""`ChaosL2`: a local host tier that fails in every way a real one can, at random.

At random it: raises from any call; loses objects just before they are read (another process
evicted them); flips a stored byte (caught by its checksum); hands back truncated payloads or
one answer too few; answers presence questions with nonsense or claims objects it never stored;
drops writes. Used by the engine's fault scenarios and the simulator's random clusters: whatever
it does must cost cache hits only.
"""

import random

import numpy as np

from tokenspeed.cache import LocalHostCache

FAULTS = ("raise", "nonsense", "overclaim", "drop", "vanish", "corrupt", "short")


class ChaosL2(LocalHostCache):
    """A local tier with random faults; `faults` counts them by kind."""

    def __init__(
        self,
        rng: random.Random,
        capacity_bytes: int,
        rates: dict[str, float],
        metadata_only: bool = False,
    ) -> None:
        super().__init__(capacity_bytes=capacity_bytes, metadata_only=metadata_only)
        assert set(rates) <= set(FAULTS), rates
        self.rng = rng
        self.rates = rates  # per fault kind: its chance on each call where it can happen
        # A tier shared by other processes cannot vouch that unchanged presence answers stay
        # true (Mooncake answers None); half the tiers say so, half keep the local counter.
        self.versioned = rng.random() < 0.5
        self.faults = dict.fromkeys(FAULTS, 0)

    def _roll(self, fault: str) -> bool:
        if self.rng.random() < self.rates.get(fault, 0.0):
            self.faults[fault] += 1
            return True
        return False

    def _maybe_raise(self, call: str) -> None:
        if self._roll("raise"):
            raise ConnectionError(f"chaos: {call} lost the connection")

    def _lose_some(self, kind, keys) -> None:
        """Another process evicts some of the objects about to be read."""
        if len(keys) and self._roll("vanish"):
            picked = [i for i in range(len(keys)) if self.rng.random() < 0.5] or [0]
            self.remove(kind, keys[np.array(picked)])

    def _corrupt_one(self, kind, keys) -> None:
        """A stored byte flips in host memory; the checksum must catch it on the read."""
        if self.metadata_only or not len(keys):
            return
        store = self._store(kind)
        present = [i for i in range(len(keys)) if store.get(keys[i]) is not None]
        if present and self._roll("corrupt"):
            self.corrupt_for_test(kind, keys[self.rng.choice(present)])

    def presence_version(self):
        return super().presence_version() if self.versioned else None

    def contains(self, kind, keys):
        self._maybe_raise("contains")
        if self._roll("nonsense"):
            return np.ones(len(keys) + 1, dtype=bool)  # the wrong shape: the guard refuses it
        if not self.versioned and self._roll("overclaim"):
            return np.ones(len(keys), dtype=bool)  # presence is a hint; the read must check
        return super().contains(kind, keys)

    def prefix_present(self, kind, keys):
        self._maybe_raise("prefix_present")
        if not self.versioned and self._roll("overclaim"):
            return len(keys)
        return super().prefix_present(kind, keys)

    def last_present(self, kind, keys):
        self._maybe_raise("last_present")
        if not self.versioned and self._roll("overclaim"):
            return len(keys) - 1
        return super().last_present(kind, keys)

    def get(self, kind, keys, positions):
        self._maybe_raise("get")
        self._lose_some(kind, keys)
        self._corrupt_one(kind, keys)
        out = super().get(kind, keys, positions)
        if self._roll("nonsense"):
            return out[:-1]  # one answer short: the guard refuses them all
        if any(p is not None for p in out) and self._roll("short"):
            i = self.rng.choice([i for i, p in enumerate(out) if p is not None])
            out[i] = out[i][:-1]  # a buggy backend: a truncated payload
        return out

    def get_present(self, kind, keys, positions):
        self._maybe_raise("get_present")
        self._lose_some(kind, keys)
        return super().get_present(kind, keys, positions)

    def put(self, objects):
        self._maybe_raise("put")
        if self._roll("drop"):
            return 0  # the write was dropped (full, or a transient error)
        return super().put(objects)

    def put_many(self, kind, keys, positions, payloads=None, *, chain=False):
        self._maybe_raise("put_many")
        if self._roll("drop"):
            return 0
        return super().put_many(kind, keys, positions, payloads, chain=chain)
