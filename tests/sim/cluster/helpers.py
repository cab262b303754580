"""Small scenarios for simulator tests: a toy cache geometry and short sessions, so that a run of
a few hundred requests takes about a second with the real schedulers and caches."""

from __future__ import annotations

from tokenspeed.cache import CacheGeometry, CheckpointPolicy
from tokenspeed.sched import SchedulerConfig
from tokenspeed.sim.cluster import ClusterConfig
from tokenspeed.sim.cost import LinearCostModel
from tokenspeed.workload import AgentXConfig, AgentXWorkload, LogNormal

PAGE = 16
TOY = CacheGeometry(
    page_size=PAGE,
    num_mla_layers=1,
    mla_row_width=32,
    num_kda_layers=1,
    kda_conv_shape=(4, 3),
    kda_recurrent_shape=(1, 8, 8),
)
PAGE_BYTES = TOY.mla_page_bytes
STATE_BYTES = TOY.kda_state_bytes


def toy_config(*, pages: int = 4000, decode_pages: int | None = None, **kw) -> ClusterConfig:
    """A cluster whose device tier holds about `pages` pages per rank."""
    live = kw.pop("live", 16)
    base = dict(
        prefill_ranks=2,
        decode_ranks=2,
        concurrency=8,
        duration_s=60.0,
        geometry=TOY,
        checkpoints=CheckpointPolicy(interval_pages=8, max_per_path=8),
        scheduler=SchedulerConfig(
            page_size=PAGE,
            prefill_token_budget=1024,
            checkpoint_interval_pages=8,
            decode_batch_sizes=(1, 2, 4, 8, 16),
        ),
        device_cache_bytes=(pages + 1) * PAGE_BYTES + (live + 1) * STATE_BYTES * 2,
        prefill_live_requests=live,
        decode_live_requests=live,
        l2_bytes_per_rank=200_000 * PAGE_BYTES,
        max_decode_steps=64,
        hit_rate_bucket_s=10.0,
    )
    base.update(kw)
    return ClusterConfig(**base)


def toy_agentx(**kw) -> AgentXConfig:
    base = dict(
        shared_prefix_tokens=1024,
        group_prefix_tokens=512,
        num_groups=4,
        session_context=LogNormal(600, 400),
        new_tokens=LogNormal(300, 200),
        output_tokens=LogNormal(40, 30),
        agentic_delay_s=LogNormal(1.0, 0.7, low=0.01),
        human_delay_s=LogNormal(8.0, 5.0, low=0.01),
        max_prompt_tokens=8000,
        subagent_context=LogNormal(400, 300),
        subagent_probability=0.1,
        max_turns=12,
    )
    base.update(kw)
    return AgentXConfig(**base)


def toy_workload(seed: int = 0, **kw) -> AgentXWorkload:
    return AgentXWorkload(toy_agentx(**kw), seed=seed)


# Costs scaled to the toy token counts so that queues actually form.
TOY_COST = LinearCostModel(
    prefill_base_s=2e-3,
    prefill_per_token_s=200e-6,
    prefill_per_pair_s=5e-9,
    decode_base_s=10e-3,
    decode_per_row_s=1e-3,
    decode_per_history_token_s=1e-6,
    transfer_bytes_per_s=2e6,
    load_bytes_per_s=1e7,
)


def assert_nothing_lost(res):
    """Every request of a `SimResult` finished, or was aborted with a reason; no cache holds one."""
    s = res.summary
    assert s.requests_issued == len(res.records) > 0
    assert s.requests_finished + s.requests_aborted == s.requests_issued
    for r in res.records:
        assert r.finish is not None
        if r.abort_reason is None:
            assert r.generated == r.output_tokens
            assert r.arrival <= r.first_token <= r.finish
    assert all(st.requests == 0 for st in res.cache_stats)
