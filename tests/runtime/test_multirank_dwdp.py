"""DWDP prefill ranks (`ParallelConfig(dwdp=W)`) sharing one Mooncake host tier (L2).

World 2 on the CPU over gloo. Turn 1 of a conversation runs on rank 0 (its prompt published to
the shared L2 at the turn's end); turn 2 (turn 1's prompt + output + new tokens) is placed on
rank 1, which has never seen the conversation: its prefix must come from the shared L2 (the
request's cached tokens and rank 1's L2 hit counter), and the greedy tokens of both turns must
equal the single-rank engine's. The ranks step independently: running different amounts of work
they all finish. Closing the engine leaves no worker and no Mooncake service alive (by PID).

With local host tiers instead (no Mooncake), the other rank misses the conversation's prefix;
that engine's last test kills a rank mid-run: `generate` fails with the front end's WorkerError
(the survivor, independent, would go on alone) and no worker is left.

The Mooncake services run on loopback free ports: started by the engine, or (one test) by the
test as a user's running master. The tests that use them are skipped where mooncake is not
installed (the reason is given); every test under a deadline (SIGALRM).
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.cache.l2.mooncake_services import start_master, start_segment_owner
from tokenspeed.parallel import apply_dwdp
from tokenspeed.runtime import EngineConfig, RequestError
from tokenspeed.runtime.multirank import MultiRankEngine
from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError
from tokenspeed.runtime.worker import dwdp_one_sided

from ..cache.l2.mooncake_env import needs_mooncake, require_mooncake
from ..processes import alarm, pid_gone, prompt_ids
from .test_multirank import kill_rank_1_mid_run

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTIONS = {
    "device": "cpu",
    "max_model_len": 512,
    "max_num_seqs": 4,
    "page_size": 16,
    "prefill_token_budget": 128,
}
DEADLINE_S = 150


@pytest.fixture(autouse=True)
def _deadline():
    """Fail a test that runs past its deadline instead of hanging."""
    with alarm(DEADLINE_S):
        yield


def _run(engine: MultiRankEngine, placed: dict[str, tuple[list[int], int]]) -> dict:
    """Queue every request on its rank and step until all finished; the final outputs."""
    for rid, (ids, rank) in placed.items():
        assert engine.add_request(rid, ids, GREEDY, rank=rank) == rank
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# Turn 1: a prompt of several pages (7+ pages of 16 tokens); turn 2 extends it by turn 1's
# output and a few new tokens.
FIRST = prompt_ids(1, 11, 120, 140)[0]
MORE = prompt_ids(1, 12, 10, 20)[0]
UNEVEN = prompt_ids(5, 13, 20, 100)


@pytest.fixture(scope="module")
def single() -> dict:
    llm = LLM("tiny", **OPTIONS)
    one = llm.generate([{"prompt_token_ids": FIRST}], GREEDY, use_tqdm=False)[0]
    second = FIRST + one.token_ids + MORE
    two = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    uneven = llm.generate([{"prompt_token_ids": p} for p in UNEVEN], GREEDY, use_tqdm=False)
    return {
        "turns": [one.token_ids, two.token_ids],
        "second": second,
        "uneven": [o.token_ids for o in uneven],
    }


def _second_turn_on_the_other_rank(engine: MultiRankEngine, single) -> None:
    one = _run(engine, {"t1": (FIRST, 0)})["t1"]
    assert one.token_ids == single["turns"][0]
    report = engine.load_report()
    assert report.ranks[0].l2_published > 0, "turn 1 was not published to the shared L2"
    assert report.ranks[1].cache_prompt_tokens == 0  # rank 1 has not seen the conversation
    second = FIRST + one.token_ids + MORE
    assert second == single["second"]
    two = _run(engine, {"t2": (second, 1)})["t2"]
    assert two.token_ids == single["turns"][1]
    # Rank 1 computed nothing of this conversation: every cached token came from the shared L2.
    assert two.metrics.cached_tokens >= len(FIRST) // 16 * 16 - 16 > 0
    report = engine.load_report()
    assert report.ranks[1].l2_hit_tokens == two.metrics.cached_tokens
    assert report.ranks[1].cache_hit_tokens == two.metrics.cached_tokens
    assert report.l2_hit_tokens == two.metrics.cached_tokens
    assert engine.metrics()["l2_hit_tokens"] == two.metrics.cached_tokens
    assert [r.requests for r in report.ranks] == [1, 1]


@needs_mooncake
def test_second_turn_on_another_dwdp_rank_hits_the_shared_l2(single):
    require_mooncake()
    before = set(multiprocessing.active_children())
    parallel = ParallelConfig(world_size=2, dwdp=2, l2="mooncake", l2_segment_bytes=64 << 20)
    engine = MultiRankEngine("tiny", parallel, EngineConfig(**OPTIONS))
    try:
        assert engine.mode == "dwdp" and len(engine.service_pids) == 2
        split = "dwdp" if dwdp_one_sided() else "replicated"
        assert engine.rank_experts == [split, split]
        assert all(not pid_gone(pid) for pid in engine.service_pids)
        _second_turn_on_the_other_rank(engine, single)
    finally:
        pids = engine.worker_pids + engine.service_pids
        engine.close()
    assert all(pid_gone(pid) for pid in pids), pids
    assert set(multiprocessing.active_children()) <= before


@contextlib.contextmanager
def _user_cluster():
    """A master and a segment owner the 'user' runs (loopback, free ports), killed after."""
    master = start_master()
    try:
        owner = start_segment_owner(master_address=master.address, segment_bytes=64 << 20)
        try:
            yield master, owner
        finally:
            owner.stop()
    finally:
        master.stop()


@needs_mooncake
def test_ranks_join_a_given_master_and_run_different_work_independently(single):
    require_mooncake()
    with _user_cluster() as (master, owner):
        parallel = ParallelConfig(world_size=2, dwdp=2, l2_master=master.address)
        with LLM("tiny", parallel=parallel, **OPTIONS) as llm:
            engine = llm.engine
            assert engine.service_pids == [] and engine.l2_master == master.address
            # Rank 0 runs four requests (several prefill chunks, many decode steps), rank 1
            # one: independent ranks run different numbers of forwards and all finish.
            placed = {f"u{i}": (ids, 0 if i < 4 else 1) for i, ids in enumerate(UNEVEN)}
            done = _run(engine, placed)
            assert [done[f"u{i}"].token_ids for i in range(5)] == single["uneven"]
            assert [r.requests for r in engine.load_report().ranks] == [4, 1]
            _second_turn_on_the_other_rank_again(engine, single)
            pids = engine.worker_pids
        assert all(pid_gone(pid) for pid in pids), pids
        assert master.alive() and owner.alive()  # the user's services are the user's


def _second_turn_on_the_other_rank_again(engine: MultiRankEngine, single) -> None:
    """Turn 1 on rank 1 this time, turn 2 on rank 0 (the other direction)."""
    one = _run(engine, {"b1": (FIRST, 1)})["b1"]
    assert one.token_ids == single["turns"][0]
    before = engine.load_report().ranks[0].l2_hit_tokens
    two = _run(engine, {"b2": (single["second"], 0)})["b2"]
    assert two.token_ids == single["turns"][1]
    assert two.metrics.cached_tokens > 0
    assert engine.load_report().ranks[0].l2_hit_tokens - before == two.metrics.cached_tokens


def test_one_sided_fetch_is_used_when_dwdp_offers_it():
    """The ranks split the experts only with a one-sided fetch (else they are replicated)."""
    assert dwdp_one_sided() == ("transport" in inspect.signature(apply_dwdp).parameters)


@needs_mooncake
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: MultiRankEngine(
                "tiny",
                ParallelConfig(world_size=2, dwdp=2, l2="mooncake"),
                EngineConfig(device="cpu", l2="none"),
            ),
            "EngineConfig.l2='none' turns it off",
        ),
        (
            lambda: MultiRankEngine(
                "tiny",
                ParallelConfig(world_size=2, dwdp=2, l2_master="127.0.0.1:1"),
                EngineConfig(device="cpu"),
            ),
            "no Mooncake master answers there",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=2, dwdp=2, tp=2)),
            "DWDP takes tp=1",
        ),
    ],
)
def test_bad_dwdp_configs_are_refused_before_any_process_starts(make, message):
    before = multiprocessing.active_children()
    with pytest.raises(ParallelError, match=message):
        make()
    assert multiprocessing.active_children() == before


@pytest.fixture(scope="module")
def local_tiers():
    """World 2 DWDP ranks, each with a local host tier (no Mooncake), shared by the two tests
    below (the last one kills a worker); closed whatever happened."""
    parallel = ParallelConfig(world_size=2, dwdp=2, l2="local")
    llm = LLM("tiny", parallel=parallel, decode_steps=1, **OPTIONS)
    pids = list(llm.engine.worker_pids)
    try:
        yield llm
    finally:
        llm.engine.close()
    assert all(pid_gone(pid) for pid in pids), pids


def test_local_tiers_miss_on_the_other_rank_and_bad_ranks_are_refused(local_tiers, single):
    engine = local_tiers.engine
    for bad in (2, -1, True, "0"):
        with pytest.raises(RequestError, match="rank must be None or an int in"):
            engine.add_request("x", [5, 6, 7], GREEDY, rank=bad)
    assert engine.service_pids == [] and engine.l2_master is None
    # Local tiers: the other rank misses the conversation's prefix.
    one = _run(engine, {"t1": (FIRST, 0)})["t1"]
    two = _run(engine, {"t2": (FIRST + one.token_ids + MORE, 1)})["t2"]
    assert two.token_ids == single["turns"][1] and two.metrics.cached_tokens == 0


def test_a_killed_dwdp_worker_fails_generate_and_stops_every_worker(local_tiers):
    """DWDP ranks are independent (the survivor would go on alone), yet a killed one ends
    `generate` with the front end's WorkerError naming it, and no worker is left. The local
    tiers engine's last test."""
    pids = set(local_tiers.engine.worker_pids)
    kill_rank_1_mid_run(local_tiers)
    assert not local_tiers.engine.abort(0)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
