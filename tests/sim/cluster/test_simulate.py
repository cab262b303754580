"""The simulator drives the real schedulers and caches; every run must account for every request.

`simulate` itself raises LostRequestError when a request is neither finished nor aborted with a
reason, or a cache still holds one after the drain; each test also checks the counts directly.
"""

import json
import re

import attrs
import pytest

from tests.sim.cluster.helpers import (
    PAGE_BYTES,
    STATE_BYTES,
    TOY_COST,
    assert_nothing_lost,
    toy_config,
    toy_workload,
)
from tokenspeed.cache import CacheManager
from tokenspeed.sched import AggregatedScheduler, DecodeScheduler, PrefillScheduler
from tokenspeed.sim.cluster import ClusterConfig, LostRequestError, build_simulator, simulate
from tokenspeed.sim.cluster.records import RequestRecord
from tokenspeed.workload import LogNormal, Session, Turn, Workload, load_mooncake_trace


def test_pd_run_finishes_every_request_with_real_caches():
    res = simulate(toy_config(), toy_workload(seed=1), TOY_COST)
    assert_nothing_lost(res)
    s = res.summary
    assert s.requests_aborted == 0 and s.requests_issued > 100
    assert 0.5 < s.hit_rate < 1.0  # shared prefixes and growing histories are reused
    assert s.throughput_per_gpu > 0 and s.p90_interactivity > 0
    assert s.ttft_p90_s >= s.ttft_mean_s * 0.5
    # Subagent requests were issued too.
    assert any(r.kind == "subagent" for r in res.records)
    # Every prefill rank and decode rank did work.
    assert all(st.counters.allocations > 0 for st in res.cache_stats)


def test_simulation_is_reproducible():
    a = simulate(toy_config(), toy_workload(seed=3), TOY_COST).summary.as_dict()
    b = simulate(toy_config(), toy_workload(seed=3), TOY_COST).summary.as_dict()
    for key in ("wall_s", "cpu_s", "events_per_s"):
        a.pop(key), b.pop(key)
    assert a == b


def test_simulator_uses_the_real_sched_and_cache_objects():
    sim = build_simulator(toy_config(), toy_workload(), TOY_COST)
    assert all(isinstance(r.cache, CacheManager) for r in sim.ranks)
    assert all(isinstance(r.sched, PrefillScheduler) for r in sim.prefill)
    assert all(isinstance(r.sched, DecodeScheduler) for r in sim.decode)
    shared = {id(r.cache.l2) for r in sim.ranks}
    assert len(shared) == 1  # one host tier for all ranks
    local = build_simulator(toy_config(l2="local"), toy_workload(), TOY_COST)
    assert len({id(r.cache.l2) for r in local.ranks}) == len(local.ranks)
    agg = build_simulator(toy_config(mode="aggregated", decode_ranks=0), toy_workload(), TOY_COST)
    assert all(isinstance(r.sched, AggregatedScheduler) for r in agg.ranks)


def test_aggregated_mode():
    res = simulate(
        toy_config(mode="aggregated", prefill_ranks=3, decode_ranks=0),
        toy_workload(seed=2),
        TOY_COST,
    )
    assert_nothing_lost(res)
    assert res.summary.requests_aborted == 0 and res.summary.hit_rate > 0.5
    assert res.summary.num_gpus == 3


def test_decode_memory_pressure_preempts_but_loses_nothing():
    # Decode ranks hold 700 pages (11k tokens) for 12 conversations of several thousand tokens.
    cfg = toy_config(
        concurrency=12, decode_device_cache_bytes=701 * PAGE_BYTES + 17 * STATE_BYTES * 2
    )
    res = simulate(cfg, toy_workload(seed=5), TOY_COST)
    assert_nothing_lost(res)
    s = res.summary
    assert s.preemptions > 0 or s.decode_admission_mean_s > 0
    assert s.requests_finished > 50


def test_requests_too_big_for_a_rank_are_aborted_with_a_reason():
    huge = Session(sid="huge", turns=(Turn(new_tokens=20_000, output_tokens=5),))
    small = [
        Session(
            sid=f"s{i}",
            turns=(
                Turn(new_tokens=300, output_tokens=5),
                Turn(new_tokens=100, output_tokens=5, delay_s=1.0),
            ),
        )
        for i in range(6)
    ]
    res = simulate(toy_config(pages=600, duration_s=None), Workload.of([huge, *small]), TOY_COST)
    assert_nothing_lost(res)
    aborted = [r for r in res.records if r.abort_reason]
    assert [r.session for r in aborted] == ["huge"]
    assert "device pages" in aborted[0].abort_reason
    assert res.summary.requests_finished == 12
    assert res.abort_reasons == {aborted[0].abort_reason: 1}


def test_finite_workload_runs_to_its_end_and_timed_trace_is_open_loop(tmp_path):
    rows = [
        {"timestamp": 1000 * i, "input_length": 900, "output_length": 8, "hash_ids": [0, 1]}
        for i in range(10)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    res = simulate(toy_config(duration_s=None, concurrency=1), load_mooncake_trace(path), TOY_COST)
    assert_nothing_lost(res)
    arrivals = sorted(r.arrival for r in res.records)
    assert arrivals == pytest.approx([float(i) for i in range(10)])  # timestamps, not slots
    # Requests after the first reuse the shared 512-token block (32 of 900 tokens cached).
    assert res.summary.hit_rate > 0.4


def test_duration_stops_issuing_and_the_drain_counts():
    res = simulate(toy_config(duration_s=20.0), toy_workload(seed=4), TOY_COST)
    assert_nothing_lost(res)
    assert max(r.arrival for r in res.records) < 20.0
    assert res.summary.makespan_s >= 20.0 - 5.0


def test_lost_request_is_detected():
    sim = build_simulator(toy_config(), toy_workload(), TOY_COST)
    sim.records[0] = RequestRecord(
        rid=0, session="s", kind="main", arrival=0.0, prompt_tokens=10, output_tokens=2
    )
    with pytest.raises(LostRequestError, match="neither finished nor aborted"):
        sim._check_nothing_lost()


def test_impossible_cluster_configs_are_rejected():
    with pytest.raises(ValueError, match="at least one prefill and one decode rank"):
        ClusterConfig(prefill_ranks=0, decode_ranks=4)
    with pytest.raises(ValueError, match="at least one prefill and one decode rank"):
        ClusterConfig(prefill_ranks=4, decode_ranks=0)
    with pytest.raises(ValueError, match="aggregated mode has no decode ranks"):
        ClusterConfig(mode="aggregated", prefill_ranks=4, decode_ranks=2)
    with pytest.raises(ValueError, match="prefill_ranks must be a non-negative integer"):
        ClusterConfig(prefill_ranks=-1)
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        ClusterConfig(concurrency=0)
    with pytest.raises(ValueError, match=r"scheduler.page_size \(64\) must equal geometry"):
        toy_config(scheduler=attrs.evolve(toy_config().scheduler, page_size=64))
    with pytest.raises(ValueError, match="is smaller than one page"):
        attrs.evolve(toy_config().scheduler, prefill_token_budget=8)


def test_ablation_directions_at_toy_scale():
    """The three cluster-level claims, same seed and workload (docs/perf/sim.md at full scale)."""
    base = dict(concurrency=16, prefill_ranks=4, decode_ranks=2, duration_s=60.0, pages=1500)

    def run(**kw):
        res = simulate(toy_config(**base, **kw), toy_workload(seed=0), TOY_COST)
        assert_nothing_lost(res)
        return res.summary

    shared, local = run(), run(l2="local")
    assert shared.hit_rate > local.hit_rate + 0.1
    assert shared.throughput_per_gpu > local.throughput_per_gpu
    affinity = run(routing="affinity")
    assert shared.ttft_p90_s < affinity.ttft_p90_s
    tight = dict(decode_device_cache_bytes=701 * PAGE_BYTES + 17 * STATE_BYTES * 2)
    independent, coupled = run(**tight), run(admission="coupled", **tight)
    assert independent.prefill_queue_mean_s < coupled.prefill_queue_mean_s
    assert independent.pinned_mean_s > 0  # finished prefills waited, pinned, for decode


@pytest.mark.parametrize("mode", ["pd", "aggregated"])
def test_requests_join_a_running_decode_batch_at_the_next_step(mode):
    """Decode ranks run many steps per event; a request that arrives mid-run must cut it after
    the step in flight instead of waiting for the whole run."""
    extra = {"decode_ranks": 0} if mode == "aggregated" else {}
    cfg = toy_config(mode=mode, max_decode_steps=64, **extra)
    res = simulate(cfg, toy_workload(seed=6, output_tokens=LogNormal(200, 150)), TOY_COST)
    assert_nothing_lost(res)
    # The longest possible step here: base + 16 padded rows + every cached token of 16 rows.
    longest_step = TOY_COST.decode_step_time(16, 16, 16 * 8000)
    waits = [
        r.first_decode_step - r.first_token
        for r in res.records
        if r.first_decode_step is not None and r.first_token is not None
    ]
    assert waits and max(waits) <= longest_step
    if mode == "pd":
        assert sum(w > 0 for w in waits) > len(waits) // 4  # many landed mid-run


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # Counts must be integers: a fractional one fails (or misbehaves) deep in a run.
        ("concurrency", 2.5),
        ("max_decode_steps", 0.5),
        ("prefill_live_requests", 1.5),
        ("decode_live_requests", True),
        ("device_cache_bytes", 1.5e10),
        ("decode_device_cache_bytes", True),
        # duration_s=True is 1 s; inf never stops an endless workload.
        ("duration_s", True),
        ("duration_s", float("inf")),
        ("duration_s", "10"),
        ("device_checkpoint_fraction", False),
        ("hit_rate_bucket_s", float("inf")),
    ],
)
def test_cluster_config_rejects_values_that_fail_deep_in_a_run(field, value):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: value})


def test_device_cache_too_small_for_the_live_states_fails_at_construction():
    from tokenspeed.cache import BudgetTooSmallError

    with pytest.raises(
        BudgetTooSmallError, match="device_cache_bytes is too small for prefill ranks"
    ):
        ClusterConfig(device_cache_bytes=1 << 30)  # 24 K3 states are 10.8 GB
    with pytest.raises(BudgetTooSmallError, match="decode_device_cache_bytes is too small"):
        ClusterConfig(decode_device_cache_bytes=20 << 30)  # 64 states do not fit
    with pytest.raises(BudgetTooSmallError, match="too small for aggregated ranks"):
        ClusterConfig(mode="aggregated", decode_ranks=0, device_cache_bytes=20 << 30)
    toy_config(pages=1)  # one usable page is enough


def test_whole_workload_runs_need_a_finite_workload(capsys):
    """duration_s=None runs the workload to its end: an endless generator is refused before the
    run starts (it would never end); a trace runs to its end, progress bar included."""
    with pytest.raises(ValueError, match="is endless"):
        build_simulator(toy_config(duration_s=None), toy_workload(seed=0), TOY_COST)
    workload = toy_workload(seed=0).take(6)
    res = simulate(toy_config(duration_s=None), workload, TOY_COST, progress=True)
    assert_nothing_lost(res)
    assert res.summary.requests_finished == sum(s.num_requests for s in workload)
    # No end time to count up to: the bar shows simulated seconds so far.
    assert re.search(r"c=8 [1-9]\d* sim-s \[.*0 in flight", capsys.readouterr().err)
