"""Randomised toy clusters: every mode and policy, device tiers from roomy to too small for some
requests, few or many live slots, single- or many-step decode events. Whatever the scenario,
every request is accounted for (finished, or aborted with a reason), the caches pass their
integrity checks after the drain, and the run is reproducible."""

import random
import sys

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
from tokenspeed.sim.cluster import L2Mode, Mode, build_simulator, ranks, simulate
from tokenspeed.sim.cluster.pd_sim import PDSimulator
from tokenspeed.workload import AgentXWorkload


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


class RouterViewChecked(PDSimulator):
    """Checks, at every arrival, the per-rank values the simulator keeps for the router: a rank
    that any scheduler call touched since the last pick must be marked stale, and the value kept
    for any other rank must be what the rank reports now."""

    _CALLS = (
        "add",
        "schedule",
        "complete",
        "abort",
        "preempt",
        "release",
        "start",
        "admit_pending",
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.touched: set = set()
        self.reused = 0
        for kind, ranks_ in (("prefill", self.prefill), ("decode", self.decode)):
            for rank in ranks_:
                for name in self._CALLS:
                    if hasattr(rank.sched, name):
                        self._watch(rank.sched, name, (kind, rank.idx))

    def _watch(self, sched, name, key) -> None:
        call = getattr(sched, name)

        def watched(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            finally:
                self.touched.add(key)

        setattr(sched, name, watched)

    def _admit_request(self, req) -> None:
        for kind, ranks_, kept, stale in (
            ("prefill", self.prefill, self._prefill_work, self._stale_prefill),
            ("decode", self.decode, self._decode_loads, self._stale_decode),
        ):
            for rank, value in zip(ranks_, kept, strict=True):
                if (kind, rank.idx) in self.touched:
                    assert rank.idx in stale, (self.now, kind, rank.idx)
                elif rank.idx not in stale:
                    now = (
                        rank.sched.outstanding_tokens() if kind == "prefill" else rank.sched.load()
                    )
                    assert value == now, (self.now, kind, rank.idx)
                    self.reused += 1
        self.touched.clear()
        super()._admit_request(req)


@pytest.mark.parametrize("seed", range(12))
def test_router_view_kept_between_arrivals_is_every_ranks_current_load(seed):
    config, workload = random_scenario(seed)
    if config.mode is not Mode.PD:  # the same scenario on a P/D cluster
        config = attrs.evolve(config, mode=Mode.PD, decode_ranks=2)
    sim = RouterViewChecked(config, workload, TOY_COST)
    sim.run()
    assert sim.reused > 0


def test_router_view_kept_between_arrivals_over_failing_host_tiers(monkeypatch):
    # `simulate` builds its simulator in the module of `build_simulator`.
    monkeypatch.setattr(sys.modules[build_simulator.__module__], "PDSimulator", RouterViewChecked)
    for seed in range(6):
        play_over_failing_tiers(seed, monkeypatch)
