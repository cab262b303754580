"""The multi-rank engine (`LLM(..., parallel=ParallelConfig(...))`): worker processes over gloo
on the CPU, requests placed by least outstanding work, ranks stepping in lockstep.

Greedy outputs must be token-identical to the single-rank engine's over one scenario: a batch of
mixed-length prompts, second turns that extend the first (prefix hits), a cache small enough to
preempt, and fewer requests than ranks. A worker killed mid-run fails `generate` within 30 s and
leaves no process behind (the world-2 engine's last test); bad layouts are refused before any
process starts. Every test runs under a deadline (SIGALRM), and every engine is closed (its
workers stopped by PID).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.runtime import EngineConfigError, RequestError
from tokenspeed.runtime.multirank import MultiRankEngine, WorkerError
from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError

from ..processes import alarm, pid_gone, prompt_ids

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A device cache of 28 pages of 16 tokens: a rank holding three of the second turns preempts.
OPTIONS = {
    "device": "cpu",
    "max_model_len": 512,
    "max_num_seqs": 4,
    "page_size": 16,
    "prefill_token_budget": 128,
    "cache_budget_bytes": 560_000,
}


def deadline(seconds: int):
    """A test's deadline in seconds (default 120)."""

    def mark(test):
        test.deadline_s = seconds
        return test

    return mark


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail a test that runs past its deadline instead of hanging."""
    with alarm(getattr(request.function, "deadline_s", 120)):
        yield


def _as_prompts(ids):
    return [{"prompt_token_ids": p} for p in ids]


def scenario(llm: LLM, second_turns: bool = True) -> dict:
    """Twelve mixed-length prompts; their second turns (prompt + reply + more); one prompt
    alone (idle ranks). Greedy token ids of every output, preemptions, prefix-hit tokens.
    second_turns=False: the first turn and the prompt alone only (their tokens are those of
    the whole scenario without its second turns: `first_and_alone`)."""
    first = prompt_ids(12, 3, 60, 140)
    one = llm.generate(_as_prompts(first), GREEDY, use_tqdm=False)
    two = []
    if second_turns:
        more = prompt_ids(12, 4, 10, 40)
        second = [p + o.token_ids + e for p, o, e in zip(first, one, more, strict=True)]
        two = llm.generate(_as_prompts(second), GREEDY, use_tqdm=False)
    alone = llm.generate(_as_prompts(prompt_ids(1, 5, 20, 30)), GREEDY, use_tqdm=False)
    return {
        "tokens": [o.token_ids for o in one + two + alone],
        "preemptions": sum(o.metrics.preemptions for o in one + two),
        "second_turn_hits": sum(o.metrics.cached_tokens for o in two),
    }


def first_and_alone(tokens: list) -> list:
    """Of the whole scenario's token ids, those of its first turn (12) and its prompt alone."""
    assert len(tokens) == 25
    return tokens[:12] + tokens[24:]


@contextlib.contextmanager
def multirank(world: int, tp: int = 1, dwdp: int | None = None, **options):
    parallel = ParallelConfig(world_size=world, tp=tp, dwdp=dwdp)
    llm = LLM("tiny", parallel=parallel, **{**OPTIONS, **options})
    try:
        yield llm
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def single(multirank_single):
    """The scenario on the single-rank engine (tests/runtime/conftest.py, shared with DCP)."""
    return multirank_single


@pytest.fixture(scope="module")
def llm2():
    with multirank(2) as llm:
        yield llm


def _check_scenario(llm, single) -> None:
    got = scenario(llm)
    assert single["preemptions"] > 0
    assert got["tokens"] == single["tokens"]
    assert got["preemptions"] > 0, "no rank was preempted: the cache is not small enough"
    assert got["second_turn_hits"] > 0, "no second turn hit its first turn's prefix"
    report = llm.engine.load_report()
    assert sum(r.finished for r in report.ranks) == 25
    assert all(r.requests > 0 for r in report.ranks)
    assert all(r.outstanding_requests == r.outstanding_tokens == 0 for r in report.ranks)
    assert 1.0 <= report.token_imbalance < 1.5
    assert llm.engine.metrics()["token_imbalance"] == report.token_imbalance
    assert llm.engine.mode == "dep" and llm.engine.rank_experts == ["dep"] * len(report.ranks)
    assert llm.engine.service_pids == []  # each rank its own host tier
    assert sum(r.cache_hit_tokens for r in report.ranks) >= got["second_turn_hits"]


def test_dep_world_2_matches_single_rank(llm2, single):
    _check_scenario(llm2, single)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dep4", "tp2"])
def test_dep_world_4_matches_single_rank(single, tp):
    with multirank(4, tp=tp) as llm:
        _check_scenario(llm, single)


def test_requests_go_to_the_least_loaded_rank_and_abort(llm2):
    engine = llm2.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    long_rank = engine.add_request("long", list(range(3, 200)), params)
    assert engine.add_request("short", [5, 6, 7], params) != long_rank
    assert engine.add_request("next", [5, 6, 7], params) != long_rank  # 597 against 403
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("long", [5], params)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("bad", [5, 10**6], params)
    assert engine.add_request("pinned", [5, 6, 7], params, rank=long_rank) == long_rank
    for bad in (2, -1, True, "0"):
        with pytest.raises(RequestError, match="rank must be None or an int in"):
            engine.add_request("bad rank", [5], params, rank=bad)
    assert engine.abort("long") and engine.abort("short") and engine.abort("next")
    assert engine.abort("pinned")
    assert not engine.abort("unknown")
    ended = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
    assert sorted(ended) == ["long", "next", "pinned", "short"]
    assert all(o.outputs[0].finish_reason == "abort" for o in ended.values())
    assert all(r.outstanding_requests == 0 for r in engine.load_report().ranks)


def kill_rank_1_mid_run(llm: LLM) -> None:
    """SIGKILL rank 1 once the first tokens are out: generate raises the front end's
    WorkerError naming it (within 30 s), every worker is gone and the engine stays failed."""
    engine = llm.engine
    pids = engine.worker_pids
    step, killed = engine.step, []

    def step_then_kill():
        outs = step()
        if outs and not killed:  # mid-run: the first tokens are out
            os.kill(pids[1], signal.SIGKILL)
            killed.append(time.monotonic())
        return outs

    engine.step = step_then_kill
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(WorkerError, match="rank 1") as failure:
        llm.generate(_as_prompts(prompt_ids(4, 6, 10, 40)), params, use_tqdm=False)
    assert time.monotonic() - killed[0] < 30
    assert failure.value.rank == 1 and "SIGKILL" in failure.value.cause
    assert all(pid_gone(pid) for pid in pids), pids
    with pytest.raises(WorkerError):  # it stays failed
        engine.step()


@deadline(90)
def test_a_killed_worker_fails_generate_and_stops_every_worker(llm2):
    """DEP ranks (coupled: the survivor's collectives fail) end with the front end's
    WorkerError and no worker left. The world-2 engine's last test: it kills a worker of it.
    (DWDP ranks, independent ones, in test_multirank_dwdp; a DCP pair in test_multirank_dcp.)"""
    pids = set(llm2.engine.worker_pids)
    kill_rank_1_mid_run(llm2)
    assert not llm2.engine.abort(0)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: ParallelConfig(world_size=0), ParallelError, "world_size must be an int >= 1"),
        (lambda: ParallelConfig(world_size=4, tp=3), ParallelError, "tp=3 does not divide"),
        (lambda: ParallelConfig(world_size=4, ep=8), ParallelError, "ep=8 does not divide"),
        (lambda: ParallelConfig(world_size=2, timeout_s=0), ParallelError, "timeout_s"),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=3), device="cpu"),
            ParallelError,
            r"ep=3 does not divide the routed experts \(16\)",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=8, tp=8), device="cpu"),
            ParallelError,
            r"tp=8 does not divide the KDA heads \(4\)",
        ),
        (lambda: LLM("tiny", parallel=2, device="cpu"), ParallelError, "must be a ParallelConfig"),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=2), max_model_len=10**9),
            EngineConfigError,
            "above the model's limit",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=2), cache_budget_bytes=300_000),
            EngineConfigError,
            "cannot hold one request",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=2), max_model_len=10**6),
            EngineConfigError,  # 2 x 32 requests of a million tokens
            "the cache needs",
        ),
        (
            lambda: MultiRankEngine("no/such/dir", ParallelConfig(world_size=2)),
            ValueError,
            "neither a preset",
        ),
    ],
)
def test_bad_configs_are_refused_before_any_process_starts(make, error, message):
    before = multiprocessing.active_children()
    with pytest.raises(error, match=message):
        make()
    assert multiprocessing.active_children() == before


@pytest.mark.slow
def test_workers_load_their_share_of_a_checkpoint(tmp_path):
    from tokenspeed.model import KimiForCausalLM, get_preset
    from tokenspeed.model.hf_writer import save_checkpoint
    from tokenspeed.model.init import init_random_weights

    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=7)
    save_checkpoint(model, tmp_path, layout="k3", max_shard_bytes=256 << 10)
    prompts = _as_prompts(prompt_ids(5, 8, 10, 80))
    options = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 4, "page_size": 16}
    single = LLM(str(tmp_path), **options)
    want = [o.token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(tmp_path), parallel=ParallelConfig(world_size=2), **options)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert got == want


def check_torchrun_worker(*layout: str) -> None:
    """`python -m tokenspeed.runtime.worker` under torchrun on 2 CPU ranks with the `layout`
    flags (none: DEP; `--dcp 2`, `--tep 2`): each prompt's outputs printed once, in order,
    the single-rank engine's greedy tokens."""
    prompts = [[5, 6, 7, 8, 9], list(range(10, 60)), [100, 101]]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "tokenspeed.runtime.worker", "--model", "tiny"]
    command += [*layout, "--device", "cpu", "--max-model-len", "256", "--max-tokens", "12"]
    command += ["--prompt-ids", str(prompts)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM("tiny", device="cpu", max_model_len=256) as llm:
        want = [o.token_ids for o in llm.generate(_as_prompts(prompts), params, use_tqdm=False)]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["token_ids"] for r in rows] == want


@pytest.mark.slow
def test_torchrun_runs_the_worker_loop():
    check_torchrun_worker()
