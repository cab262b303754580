"""Faults under the engine's random scenarios: a failing host tier, and failing steps.

`ChaosL2` (tests/cache/l2/chaos.py) fails in every way a host tier can, at random. Whatever it
does, it may only cost cache hits: every request still ends exactly once with the tokens it gets
alone, the caches check out after every step, and everything the requests held is back when the
engines are idle.

Failing steps (`inject_failures`: a forward pass raises, before or after writing the batch's
cache and state, or a copy of a KDA state into or out of a checkpoint slot raises) may only cost
the requests of that batch (a preemption that cannot save its state: that request): they end
aborted with a prefix of their tokens, every other request gets exactly its own, and a request
sent again after a failure gets them too, whatever cache the failed one left behind. A failure
while admitting a request (zeroing or restoring its state, starting its host-tier load) costs
only that request: it ends aborted, and the step goes on without it.
"""

import random

import pytest

from tests.cache.l2.chaos import ChaosL2
from tokenspeed.cache import LocalHostCache
from tokenspeed.runtime.cache_sizing import cache_geometry

from .scenarios import PAGE, Scenario, make_engine, play, play_async, play_shared_l2

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
def test_a_failing_admission_aborts_only_that_request(steady, seed):
    """The device work of admitting a request fails at random (zeroing or restoring its state,
    starting its host-tier load): that request ends aborted with the error, gives back what it
    took, and the step goes on without it (no StepError); every other request gets exactly its
    tokens."""
    played = play(
        steady,
        seed,
        num_requests=16,
        failures=0.3,
        kinds=("admission",),
        l2=LocalHostCache(capacity_bytes=1 << 30),
        **BUSY_L2,
    )
    assert played.admissions > 0


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


def test_an_interrupted_step_aborts_its_batch_and_stays_an_interrupt(steady):
    """Ctrl-C in the middle of a forward: the interrupt propagates as it is, the batch it cut
    is aborted, and a caller that steps on gets the other requests' exact tokens."""
    rng = random.Random(5)
    scenario = Scenario(steady, rng)
    engine = make_engine(steady, rng, tight=0.0)
    requests = [scenario.make_request(n) for n in range(3)]
    for rid, prompt, params in requests[:2]:
        engine.add_request(rid, prompt, params)
    real = engine.runner.forward

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)  # the state moved on; then the interrupt
        raise KeyboardInterrupt

    engine.runner.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # the first prefill (r0, and r1 if the budget lets it in)
    del vars(engine.runner)["forward"]
    engine.add_request(*requests[2])
    while engine.has_unfinished():
        scenario.record(engine.step())
        engine.check_integrity()
    assert set(scenario.finished) == {r[0] for r in requests}
    cut = {rid for rid, out in scenario.finished.items()
           if (out.abort_reason or "").startswith("step failed: KeyboardInterrupt")}  # fmt: skip
    assert "r0" in cut and "r2" not in cut
    scenario.aborted.update(cut)
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
        assert rid not in cut or not out.token_ids
