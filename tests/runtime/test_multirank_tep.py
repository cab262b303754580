"""Plain tensor parallelism (TEP) in the multi-rank engine (`ParallelConfig(world_size=T, tep=T)`).

TEP is one replica group spanning the world: every rank runs every request (placed, applied at a
lockstep-agreed command count and checked by plan digests as a DCP group's members are), its
model split by `apply_tp` (1/T of the heads, of every expert's intermediate columns: two
all-reduces per layer). On the CPU over gloo, world 2 gives the single-rank engine's greedy
tokens over test_multirank's scenario (mixed lengths, second turns with prefix hits,
preemption). The fp32 partial sums over heads and expert slices add up in another order than
one device's GEMMs (logits within 5e-5 of the single process, tests/parallel/test_tp.py), while
the smallest top-1 / top-2 log-probability gap of the scenario's greedy choices is 6.6e-4
(measured on its first turn): the tokens are identical, deterministically (gloo's all-reduce
order is fixed). A TEP rank's cache holds its heads' KDA state (half the bytes of a live slot)
and whole MLA rows (per token, shared by every head), so one budget holds more pages than on
one rank. Also: an AgentX replay through the engine (what `bench agentx --parallel tep=N`
runs), placement on the group, refusals before any process starts, a killed rank failing the
front end cleanly, and the per-rank random weights of large presets (a rank's slices of one
single-device model, the same for DEP and TEP). Every test runs under a deadline (SIGALRM);
every engine is closed (its workers stopped by PID).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import types

import attrs
import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.cache import CacheGeometry
from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.parallel import init_rank_random_weights
from tokenspeed.runtime import EngineConfig
from tokenspeed.runtime.agentx_replay import agentx_sessions, replay
from tokenspeed.runtime.multirank import MultiRankEngine
from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError

from ..parallel.harness import run_ranks
from ..processes import alarm
from .test_multirank import (
    OPTIONS,
    check_torchrun_worker,
    deadline,
    kill_rank_1_mid_run,
    scenario,
)


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail a test that runs past its deadline instead of hanging."""
    with alarm(getattr(request.function, "deadline_s", 120)):
        yield


@contextlib.contextmanager
def tep_llm(world: int = 2, **options):
    llm = LLM(
        "tiny", parallel=ParallelConfig(world_size=world, tep=world), **{**OPTIONS, **options}
    )
    try:
        yield llm
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tep2():
    """A TEP pair over test_multirank's options, shared by the tests below (the last one kills
    a rank of it); closed whatever happened."""
    with tep_llm(2) as llm:
        yield llm


@pytest.fixture(scope="module")
def single(multirank_single):
    """The scenario on the single-rank engine, its pages and MLA page bytes (conftest.py)."""
    return multirank_single


@deadline(150)
def test_tep_world_2_matches_single_rank(tep2, single):
    engine = tep2.engine
    assert engine.mode == "tep" and engine.rank_experts == ["tep", "tep"]
    # Every rank: its heads' KDA state (half a single rank's live slot), whole MLA rows.
    whole = CacheGeometry.from_model_config(get_preset("tiny"), page_size=16, dtype=torch.float32)
    caches = engine.rank_caches
    assert caches[0] == caches[1]
    cache = caches[0]
    assert 2 * cache["kda_state_bytes"] == whole.kda_state_bytes
    assert cache["mla_rows_per_page"] == 16
    assert cache["mla_page_bytes"] == single["mla_page_bytes"] == whole.mla_page_bytes
    assert cache["num_pages"] > single["pages"]  # the budget's KDA slots cost half
    got = scenario(tep2)
    assert single["preemptions"] > 0
    assert got["tokens"] == single["tokens"]
    assert got["preemptions"] > 0, "the group was not preempted: the cache is not small enough"
    assert got["second_turn_hits"] > 0, "no second turn hit its first turn's prefix"
    # One load entry (the group, by its leader), each request counted once.
    report = engine.load_report()
    assert [r.rank for r in report.ranks] == [0]
    (load,) = report.ranks
    assert load.requests == load.finished == 25
    assert load.outstanding_requests == load.outstanding_tokens == 0
    assert load.cache_hit_tokens >= got["second_turn_hits"]


@deadline(60)
def test_an_agentx_replay_and_placement_on_the_group(tep2):
    """What `bench agentx --parallel tep=2` runs (the CLI itself: the slow test below): every
    request on the group, one rank entry; a rank named by the caller places on the group."""
    sessions, block = agentx_sessions(2, seed=0, scale=1 / 128, max_turns=2)
    result = replay(tep2.engine, sessions, 2, block, None)
    assert result["requests"] == 4 and result["generated_tokens"] > 0
    assert result["p90_interactivity_tok_s"] > 0 and result["output_tokens_per_s"] > 0
    assert [r["rank"] for r in result["ranks"]] == [0]
    assert result["request_imbalance"] == result["token_imbalance"] == 1.0
    engine = tep2.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    assert engine.add_request("pinned", [5, 6, 7], params, rank=1) == 0
    assert engine.abort("pinned")
    ended = [o for _ in range(200) for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in ended] == ["abort"]
    assert not engine.has_unfinished()


@deadline(90)
def test_a_killed_rank_fails_generate_and_stops_every_worker(tep2):
    """Rank 1 of the pair: rank 0's all-reduces fail, the front end names the rank that died
    and no worker is left. The TEP pair's last test."""
    pids = set(tep2.engine.worker_pids)
    kill_rank_1_mid_run(tep2)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


# ------------------------------------------------------------------ the layout and refusals


def test_tep_layout():
    config = ParallelConfig(world_size=4, tep=4)
    assert config.replicas == 4 and config.attention_dp == 1 and config.expert_parallel == 1
    assert [config.replica_ranks(r) for r in (0, 3)] == [(0, 1, 2, 3)] * 2
    assert config.dcp_ranks(3) == (3,)  # no DCP
    dims = config.dims()
    assert (dims.tep, dims.ep, dims.tp, dims.dcp) == (4, 1, 1, 1)
    assert ParallelConfig(world_size=2, tep=2, ep=1).expert_parallel == 1
    # DEP and DCP keep their replica groups.
    assert ParallelConfig(world_size=4, dcp=2).replica_ranks(3) == (2, 3)
    assert ParallelConfig(world_size=4).replica_ranks(3) == (3,)
    # A rank's model configuration: its heads and intermediate widths.
    tiny = get_preset("tiny")
    local = config.rank_model_config(tiny)
    assert (local.kda.num_heads, local.mla.num_heads) == (1, 1)
    assert local.moe.expert_intermediate_size == tiny.moe.expert_intermediate_size // 4
    assert local.dense_intermediate_size == tiny.dense_intermediate_size // 4
    assert ParallelConfig(world_size=4).rank_model_config(tiny) is tiny


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ParallelConfig(world_size=4, tep=2), r"tep=2 must equal world_size=4"),
        (lambda: ParallelConfig(world_size=2, tep=3), r"tep=3 must equal world_size=2"),
        (lambda: ParallelConfig(world_size=2, tep=0), r"tep must be an int >= 1"),
        (lambda: ParallelConfig(world_size=2, tep=2, tp=2), r"does not combine with tp=2"),
        (lambda: ParallelConfig(world_size=2, tep=2, ep=2), r"does not combine with ep=2"),
        (lambda: ParallelConfig(world_size=2, tep=2, dcp=2), r"does not combine with dcp=2"),
        (
            lambda: ParallelConfig(world_size=2, tep=2, dwdp=2),
            r"tep=2 ranks run the same tokens in lockstep, and dwdp=2",
        ),
        (
            lambda: ParallelConfig(world_size=2, tep=2, l2="mooncake"),
            r"tep=2: a rank's KDA checkpoints hold only its 1/2 of the heads",
        ),
        (
            lambda: ParallelConfig(world_size=2, tep=2, l2_master="127.0.0.1:1"),
            r"tep=2: a rank's KDA checkpoints hold only its 1/2 of the heads",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=8, tep=8), device="cpu"),
            r"tep=8 does not divide the KDA heads \(4\)",
        ),
    ],
    ids=["world", "world3", "zero", "tp", "ep", "dcp", "dwdp", "mooncake", "l2_master", "heads"],
)
def test_bad_tep_configs_are_refused_before_any_process_starts(make, message):
    before = multiprocessing.active_children()
    with pytest.raises(ParallelError, match=message):
        make()
    assert multiprocessing.active_children() == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c.evolve(moe=attrs.evolve(c.moe, expert_intermediate_size=33)),
            r"tep=2 does not divide the expert intermediate size \(33\)",
        ),
        (
            lambda c: c.evolve(dense_intermediate_size=129),
            r"tep=2 does not divide the dense MLP's intermediate size \(129\)",
        ),
    ],
    ids=["experts", "dense"],
)
def test_widths_tep_cannot_split_are_refused(monkeypatch, change, message):
    config = change(get_preset("tiny"))
    monkeypatch.setattr("tokenspeed.runtime.multirank.model_config_of", lambda model: config)
    before = multiprocessing.active_children()
    with pytest.raises(ParallelError, match=message):
        MultiRankEngine("tiny", ParallelConfig(world_size=2, tep=2), EngineConfig(device="cpu"))
    assert multiprocessing.active_children() == before


def test_tep_over_mxfp4_experts_is_refused(monkeypatch):
    monkeypatch.setattr(
        "tokenspeed.runtime.multirank.model_config_of", lambda m: get_preset("tiny")
    )
    monkeypatch.setattr("tokenspeed.runtime.multirank.load_config_json", lambda m: {})
    monkeypatch.setattr("tokenspeed.model.loader.expert_format_of", lambda raw: "mxfp4")
    with pytest.raises(ParallelError, match="stores its routed experts in MXFP4"):
        MultiRankEngine("/a/k3/checkpoint", ParallelConfig(world_size=2, tep=2))


def test_the_front_end_sizes_a_rank_cache_from_its_heads():
    """500_000 bytes: one rank needs 534_528 for one request of 512 tokens, a TEP pair's rank
    457_728 (its KDA slots cost half). The front end's check before any process starts uses
    the rank's heads, as the rank's engine does (else it would refuse this budget)."""
    from tokenspeed.runtime import EngineConfigError
    from tokenspeed.runtime.cache_sizing import fit_config
    from tokenspeed.runtime.multirank import check_rank_cache

    tiny = get_preset("tiny")
    config = EngineConfig(**{**OPTIONS, "cache_budget_bytes": 500_000})
    config = fit_config(config, types.SimpleNamespace(config=tiny))
    cpu = torch.device("cpu")
    with pytest.raises(EngineConfigError, match="cannot hold one request"):
        check_rank_cache("tiny", tiny, config, "auto", cpu, 1)
    local = ParallelConfig(world_size=2, tep=2).rank_model_config(tiny)
    check_rank_cache("tiny", local, config, "auto", cpu, 2)


def test_parallel_option_takes_tep():
    from tokenspeed.cli import _layout, _parallel

    config = _parallel("tep=4")
    assert (config.world_size, config.tep, config.expert_parallel, config.attention_dp) == (
        4,
        4,
        1,
        1,
    )
    assert _layout(config) == "4 ranks: TEP 4 (every rank runs every request)"
    assert _parallel("world=2,tep=2").tep == 2
    for bad, message in (
        ("world=4,tep=2", "tep=2 must equal world_size=4"),
        ("tep=2,ep=2", "does not combine with ep=2"),
        ("tep=2,dcp=2", "does not combine with dcp=2"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            _parallel(bad)


@pytest.mark.slow
def test_bench_agentx_runs_tep(capsys):
    """The command the GPU comparison runs (`tokenspeed bench agentx --parallel tep=N`), on the
    CPU; the same replay on a TEP pair runs in the default suite above."""
    import re

    from tokenspeed.cli import main

    argv = ["bench", "agentx", "--sessions", "3", "--concurrency", "3", "--max-turns", "2"]
    before = set(multiprocessing.active_children())
    assert main([*argv, "--device", "cpu", "--no-progress", "--parallel", "tep=2"]) == 0
    assert set(multiprocessing.active_children()) <= before
    out = capsys.readouterr().out
    assert "2 ranks: TEP 2 (every rank runs every request)" in out
    for key in ("output_tokens_per_s", "p90_interactivity_tok_s", "prefix_hit_rate"):
        assert re.search(rf"^  {key} +\d", out, re.M), key
    rows = re.findall(r"^ +(\d) +(\d+) +(\d+) +(\d+) +([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0"]


# ------------------------------------------------------------------ per-rank random weights


def _rank_logits(rank: int, world: int, seed: int) -> dict:
    """This rank's model as a worker draws a large preset (`_rank_random_model`: a meta model,
    split, its slices drawn), for TEP and for DEP over the world; logits of a prefill and a
    decode step (TEP: every rank the same batch; DEP: each rank its own)."""
    from tokenspeed.parallel import ParallelGroups
    from tokenspeed.runtime.worker import WorkerSpec, _rank_random_model

    out = {}
    for kind, parallel in (
        ("tep", ParallelConfig(world_size=world, tep=world)),
        ("dep", ParallelConfig(world_size=world)),
    ):
        groups = ParallelGroups.build(parallel.dims())
        spec = WorkerSpec(
            model="tiny", seed=seed, config=EngineConfig(device="cpu"), parallel=parallel
        )
        model, _ = _rank_random_model(spec, groups, torch.device("cpu"))
        batch_rank = 0 if kind == "tep" else rank
        out[kind] = _forward(model, batch_rank)
    return out


def _forward(model, batch_rank: int) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts and one decode step (the prompts depend on
    batch_rank)."""
    gen = torch.Generator().manual_seed(batch_rank)
    lens = [7 + batch_rank, 5]
    state = model.empty_state(2)
    logits = []
    for step_lens in (lens, [1, 1]):
        ids = torch.randint(3, 500, (sum(step_lens),), generator=gen)
        with torch.no_grad():
            got = model(ids, ForwardBatch.build(step_lens, prefix_lens=state.num_tokens), state)
        logits.append(got.logits)
        state = got.state
    return logits


@deadline(90)
def test_per_rank_random_weights_are_slices_of_one_model():
    """A large preset's ranks draw their slices of one seeded single-device model: TEP ranks'
    and DEP ranks' logits are that model's (TEP within its fp32 reassociation, DEP exactly up to
    the last bit of its expert sums)."""
    seed = 3
    with torch.device("meta"):
        whole = KimiForCausalLM(get_preset("tiny"))
    init_rank_random_weights(whole, seed=seed)
    results = run_ranks(_rank_logits, 2, seed, timeout=80)
    for rank, got in enumerate(results):
        for kind, batch_rank in (("tep", 0), ("dep", rank)):
            want = _forward(whole, batch_rank)
            for a, b in zip(got[kind], want, strict=True):
                assert a.shape == b.shape
                err = float((a - b).abs().max())
                assert err < 5e-5 * max(1.0, float(b.abs().max())), (rank, kind, err)


@pytest.mark.slow
def test_torchrun_runs_tep_ranks():
    """`python -m tokenspeed.runtime.worker --tep 2` under torchrun: every prompt on both
    ranks, rank 0's outputs printed once, the single-rank engine's tokens."""
    check_torchrun_worker("--tep", "2")
