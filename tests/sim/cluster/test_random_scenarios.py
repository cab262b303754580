"""Randomised toy clusters: every mode and policy, device tiers from roomy to too small for some
requests, few or many live slots, single- or many-step decode events. Whatever the scenario,
every request is accounted for (finished, or aborted with a reason), the caches pass their
integrity checks after the drain, and the run is reproducible."""

import random

import pytest

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
from tokenspeed.sim.cluster import simulate
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
