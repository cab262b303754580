"""Faults under the engine's random scenarios: a failing host tier, and failing steps.

`ChaosL2` is a local tier that, at random: raises from any call; loses objects just before they
are read (another process evicted them); flips a stored byte (caught by its checksum); hands back
truncated payloads; answers presence questions with nonsense or claims objects it never stored;
drops writes. Whatever it does, it may only cost cache hits: every request still ends exactly
once with the tokens it gets alone, the caches check out after every step, and everything the
requests held is back when the engines are idle.

Failing steps (`inject_failures`: a forward pass raises, before or after writing the batch's
cache and state, or a copy of a KDA state into or out of a checkpoint slot raises) may only cost
the requests of that batch (a preemption that cannot save its state: that request): they end
aborted with a prefix of their tokens, every other request gets exactly its own, and a request
sent again after a failure gets them too, whatever cache the failed one left behind.
"""

import random

import numpy as np
import pytest

from tokenspeed.cache import LocalHostCache
from tokenspeed.runtime.engine import cache_geometry

from .scenarios import PAGE, play, play_async, play_shared_l2


class ChaosL2(LocalHostCache):
    """A local tier with random faults; `faults` counts them by kind."""

    def __init__(
        self, rng: random.Random, capacity_bytes: int, rates: dict[str, float]
    ) -> None:
        super().__init__(capacity_bytes=capacity_bytes)
        self.rng = rng
        self.rates = rates  # per fault kind: its chance on each call where it can happen
        # A tier shared by other processes cannot vouch that unchanged presence answers stay
        # true (Mooncake answers None); half the tiers say so, half keep the local counter.
        self.versioned = rng.random() < 0.5
        self.faults = dict.fromkeys(rates, 0)

    def _roll(self, fault: str) -> bool:
        if self.rng.random() < self.rates[fault]:
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


READ_FAULTS = ("vanish", "corrupt", "short")
# Small device tiers and mostly follow-up turns: histories leave the device tier and come back
# from the host tier.
BUSY_L2 = {"tight": 1.0, "follow_ups": 0.8}


def chaos_tier(model, seed: int, scale: float = 1.0) -> ChaosL2:
    """A chaos tier of a roomy or a tight capacity (a few dozen pages: it evicts too). Reads are
    rarer than presence checks and writes (a failed check already costs the hit), so the faults
    of a read are likelier, to be met at all."""
    rng = random.Random(seed)
    page_bytes = cache_geometry(model, PAGE).mla_page_bytes
    capacity = rng.choice([1 << 30, 40 * page_bytes])
    rates = {"raise": 0.05, "nonsense": 0.03, "overclaim": 0.05, "drop": 0.05}
    rates = {k: v * scale for k, v in rates.items()}
    rates.update(dict.fromkeys(READ_FAULTS, min(1.0, 0.3 * scale)))
    return ChaosL2(rng, capacity_bytes=capacity, rates=rates)


def fault_count(tier: ChaosL2, kinds=None) -> int:
    return sum(n for k, n in tier.faults.items() if kinds is None or k in kinds)


@pytest.mark.parametrize("seed", range(3))
def test_a_failing_host_tier_costs_hits_never_tokens(steady, seed):
    tier = chaos_tier(steady, 1000 + seed)
    engine = play(steady, seed, l2=tier, **BUSY_L2).engine
    assert fault_count(tier) > 0
    assert engine.cache.stats().counters.l2_errors > 0  # the swallowed failures are counted
    tier.check_integrity()


def test_two_engines_sharing_a_failing_host_tier(steady):
    tiers = [chaos_tier(steady, 2000 + seed) for seed in range(3)]
    for seed, tier in enumerate(tiers):
        play_shared_l2(steady, seed, shared=tier, **BUSY_L2)
        tier.check_integrity()
    # Turns read histories the other engine published, and some of those reads went wrong.
    assert sum(fault_count(t, READ_FAULTS) for t in tiers) > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_many_scenarios_over_a_failing_host_tier(steady, seed):
    tier = chaos_tier(steady, 1000 + seed, scale=random.Random(seed).choice([0.5, 1, 3]))
    play(steady, seed, num_requests=20, l2=tier, **BUSY_L2)
    tier.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 25))
def test_many_pairs_of_engines_sharing_a_failing_host_tier(steady, seed):
    tier = chaos_tier(steady, 2000 + seed, scale=random.Random(seed).choice([0.5, 1, 3]))
    play_shared_l2(steady, seed, shared=tier, **BUSY_L2)
    tier.check_integrity()


# ---- failing steps ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_a_failing_step_aborts_only_its_batch(steady, seed):
    """Forward passes fail at random (out of memory, say): the requests of that step's batch end
    aborted with the error, the others with exactly their tokens; requests sent again after a
    failure (the same prompt, reusing whatever cache the failed one left) get theirs too."""
    played = play(steady, seed, num_requests=16, failures=0.1)
    assert played.failures > 0


@pytest.mark.parametrize("seed", range(2))
def test_async_consumers_of_a_failing_step_get_an_abort_and_the_others_go_on(steady, seed):
    assert play_async(steady, seed, failures=0.1) > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_many_scenarios_with_failing_steps(steady, seed):
    rate = random.Random(seed).choice([0.03, 0.1, 0.3])
    play(steady, seed, num_requests=20, failures=rate, l2=chaos_tier(steady, 3000 + seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 20))
def test_many_async_clients_with_failing_steps(steady, seed):
    play_async(steady, seed, failures=random.Random(seed).choice([0.03, 0.1, 0.3]))
