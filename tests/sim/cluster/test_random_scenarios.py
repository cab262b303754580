"""Randomised toy clusters: every mode and policy, device tiers from roomy to too small for some
requests, few or many live slots, single- or many-step decode events. Whatever the scenario,
every request is accounted for (finished, or aborted with a reason), the caches pass their
integrity checks after the drain, and the run is reproducible."""

import random

import attrs
import pytest

from tests.cache.l2.chaos import ChaosL2
from tests.sim.cluster.helpers import (
    PAGE,
    PAGE_BYTES,
    STATE_BYTES,
    TOY_COST,
    assert_nothing_lost,
    toy_agentx,
    toy_config,
)
from tokenspeed.cache import CheckpointPolicy
from tokenspeed.sched import SchedulerConfig
from tokenspeed.sim.cluster import L2Mode, ranks, simulate
from tokenspeed.sim.workload import AgentXWorkload


def random_scenario(seed: int):
    rng = random.Random(seed)
    interval = rng.choice([1, 4, 8])
    live = rng.randint(2, 16)
    pages = rng.choice([300, 800, 4000])  # 300 pages: the longest histories do not fit
    aggregated = rng.random() < 0.3
    shape = (
        dict(mode="aggregated", prefill_ranks=rng.randint(1, 3), decode_ranks=0)
        if aggregated
        else dict(prefill_ranks=rng.randint(1, 3), decode_ranks=rng.randint(1, 3),
                  admission=rng.choice(["independent", "coupled"]))
    )  # fmt: skip
    config = toy_config(
        pages=pages,
        live=live,
        concurrency=rng.randint(2, 16),
        duration_s=rng.choice([20.0, 40.0]),
        routing=rng.choice(["least_work", "affinity"]),
        l2=rng.choice(["shared", "local", "none"]),
        max_decode_steps=rng.choice([1, 8, 64]),
        checkpoints=CheckpointPolicy(interval_pages=interval, max_per_path=rng.choice([2, 8])),
        scheduler=SchedulerConfig(
            page_size=PAGE,
            prefill_token_budget=rng.choice([PAGE, 256, 1024]),
            checkpoint_interval_pages=interval,
            decode_batch_sizes=rng.choice([(1, 2, 4), (1, 2, 4, 8, 16)]),
            max_preemptions=rng.choice([0, 2, 8]),
        ),
        decode_device_cache_bytes=(
            rng.choice([200, 700]) * PAGE_BYTES + (live + 1) * STATE_BYTES * 2
            if rng.random() < 0.3
            else None
        ),
        **shape,
    )
    workload = AgentXWorkload(toy_agentx(subagent_probability=rng.choice([0.0, 0.3])), seed=seed)
    return config, workload


@pytest.mark.parametrize("seed", range(24))
def test_random_clusters_account_for_every_request(seed):
    config, workload = random_scenario(seed)
    res = simulate(config, workload, TOY_COST)
    assert_nothing_lost(res)
    assert res.summary.requests_issued > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24, 200))
def test_many_random_clusters_account_for_every_request(seed):
    config, workload = random_scenario(seed)
    res = simulate(config, workload, TOY_COST)
    assert_nothing_lost(res)
    first = res.summary.as_dict()
    config, workload = random_scenario(seed)
    again = simulate(config, workload, TOY_COST).summary.as_dict()
    for key in ("wall_s", "cpu_s", "events_per_s"):
        first.pop(key), again.pop(key)
    assert first == again  # reproducible


def play_over_failing_tiers(seed: int, monkeypatch) -> list[ChaosL2]:
    """A random cluster whose host tiers (shared or rank-local) fail at random: they may cost
    hits, never a request. Returns the tiers."""
    config, workload = random_scenario(seed)
    rng = random.Random(seed)
    config = attrs.evolve(config, l2=rng.choice([L2Mode.SHARED, L2Mode.LOCAL]))
    rates = {"raise": 0.02, "nonsense": 0.02, "overclaim": 0.02, "drop": 0.05, "vanish": 0.1}
    scale = rng.choice([0.5, 1.0, 3.0])
    tiers = []

    def chaos(*, capacity_bytes, metadata_only):
        tier = ChaosL2(
            random.Random(rng.randrange(1 << 30)),
            capacity_bytes=capacity_bytes,
            rates={k: min(1.0, v * scale) for k, v in rates.items()},
            metadata_only=metadata_only,
        )
        tiers.append(tier)
        return tier

    monkeypatch.setattr(ranks, "LocalHostCache", chaos)
    res = simulate(config, workload, TOY_COST)
    assert_nothing_lost(res)
    for tier in tiers:
        tier.check_integrity()
    return tiers


def test_random_clusters_over_failing_host_tiers(monkeypatch):
    tiers = [t for seed in range(6) for t in play_over_failing_tiers(seed, monkeypatch)]
    faults = {k: sum(t.faults[k] for t in tiers) for k in tiers[0].faults}
    assert all(faults[k] > 0 for k in ("raise", "nonsense", "overclaim", "drop", "vanish")), faults


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 60))
def test_many_random_clusters_over_failing_host_tiers(seed, monkeypatch):
    play_over_failing_tiers(seed, monkeypatch)
