"""Decode context parallelism in the multi-rank engine (`ParallelConfig(dcp=C)`).

A DCP group of C ranks serves each of its requests on every member, each member holding 1/C of
every request's MLA rows: the cache's pages stay `page_size` tokens, a member's device page
holds `page_size / C` rows. On the CPU over gloo, world 2 (one DCP pair, DEP over both) gives
greedy outputs token-identical to the single-rank engine over test_multirank's scenario (mixed
lengths, second turns with prefix hits, preemption: the DCP budget is cut so that a member
holds as many pages as the single rank, and preempts too); world 4 (two DCP pairs, DEP over
the 4 ranks) over the scenario's first turn and its prompt alone, each pair a load entry of
its own (the whole scenario in world 4, and with TP pairs too, are marked slow). For one budget
a member's MLA page is half the bytes and the cache holds twice the tokens (the scenario then
runs without preemption; a budget refused for one rank serves a whole max_model_len request on
a pair, whose follower is then killed: `generate` fails cleanly). Members that would run
different steps are stopped by the lockstep all-reduce; bad layouts are refused before any
process starts. Every test runs under a deadline (SIGALRM), and every engine is closed.
"""

from __future__ import annotations

import contextlib
import multiprocessing

import attrs
import pytest
import torch.distributed as dist

from tokenspeed import LLM, SamplingParams
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel.groups import Group
from tokenspeed.runtime import Engine, EngineConfig, EngineConfigError
from tokenspeed.runtime.lockstep import LockstepEngine, LockstepError
from tokenspeed.runtime.multirank import MultiRankEngine
from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError

from ..parallel.harness import run_ranks
from ..processes import alarm, prompt_ids
from .test_multirank import (
    OPTIONS,
    _as_prompts,
    check_torchrun_worker,
    deadline,
    first_and_alone,
    kill_rank_1_mid_run,
    scenario,
)

# The single rank's 560_000 bytes hold 34 pages of 16 tokens (and preempt in the scenario).
# A DCP pair's page is half the MLA bytes: this budget gives each member the same 34 pages.
DCP_BUDGET = 393_600


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail a test that runs past its deadline instead of hanging."""
    with alarm(getattr(request.function, "deadline_s", 120)):
        yield


@contextlib.contextmanager
def dcp_llm(world: int, dcp: int = 2, tp: int = 1, **options):
    parallel = ParallelConfig(world_size=world, dcp=dcp, tp=tp)
    llm = LLM("tiny", parallel=parallel, **{**OPTIONS, **options})
    try:
        yield llm
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def single(multirank_single):
    """The scenario on the single-rank engine, its pages and MLA page bytes (conftest.py)."""
    return multirank_single


def _check_caches(engine, single) -> None:
    """Every member holds the single rank's pages, each page half its MLA rows and bytes."""
    for cache in engine.rank_caches:
        assert cache["num_pages"] == single["pages"]
        assert cache["page_size"] == 16 and cache["mla_rows_per_page"] == 8
        assert 2 * cache["mla_page_bytes"] == single["mla_page_bytes"]


@deadline(150)
@pytest.mark.parametrize(
    ("world", "tp"),
    [
        (2, 1),
        pytest.param(4, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, marks=pytest.mark.slow),
    ],
    ids=["world2", "world4", "world4-tp2"],
)
def test_dcp_matches_single_rank(single, world, tp):
    with dcp_llm(world, tp=tp, cache_budget_bytes=DCP_BUDGET) as llm:
        engine = llm.engine
        got = scenario(llm)
        assert single["preemptions"] > 0
        assert got["tokens"] == single["tokens"]
        assert got["preemptions"] > 0, "no group was preempted: the cache is not small enough"
        assert got["second_turn_hits"] > 0, "no second turn hit its first turn's prefix"
        # One load entry per DCP group (its leader), each request counted once.
        report = engine.load_report()
        assert [r.rank for r in report.ranks] == list(range(0, world, 2))
        assert sum(r.finished for r in report.ranks) == 25
        assert all(r.requests > 0 for r in report.ranks)
        assert all(r.outstanding_requests == r.outstanding_tokens == 0 for r in report.ranks)
        assert sum(r.cache_hit_tokens for r in report.ranks) >= got["second_turn_hits"]
        assert engine.mode == "dep" and engine.rank_experts == ["dep"] * world
        _check_caches(engine, single)


@deadline(150)
def test_two_dcp_pairs_in_world_4_each_serve_their_requests_as_the_single_rank(single):
    """World 4: two DCP pairs, DEP over the 4 ranks, over the scenario's first turn and its
    prompt alone (one pair then idle). The single rank's tokens; one load entry per pair (its
    leader), both pairs served. (Preemption and prefix hits on a pair: world 2 above; the
    whole scenario in world 4: the slow test above.)"""
    with dcp_llm(4, cache_budget_bytes=DCP_BUDGET) as llm:
        engine = llm.engine
        got = scenario(llm, second_turns=False)
        assert got["tokens"] == first_and_alone(single["tokens"])
        report = engine.load_report()
        assert [r.rank for r in report.ranks] == [0, 2]
        assert sum(r.finished for r in report.ranks) == 13
        assert all(r.requests > 0 for r in report.ranks)
        assert all(r.outstanding_requests == r.outstanding_tokens == 0 for r in report.ranks)
        assert engine.mode == "dep" and engine.rank_experts == ["dep"] * 4
        _check_caches(engine, single)


@deadline(90)
def test_one_budget_holds_twice_the_tokens_on_a_dcp_pair(single):
    """The single rank's budget: each member's MLA page is half the bytes (8 rows of the page's
    16 tokens), so the cache holds about twice the pages, and the scenario that preempted on
    the single rank runs without preemption (with the same tokens)."""
    with dcp_llm(2) as llm:
        caches = llm.engine.rank_caches
        assert caches[0] == caches[1]
        cache = caches[0]
        assert cache["mla_rows_per_page"] == 8
        assert 2 * cache["mla_page_bytes"] == single["mla_page_bytes"]
        assert 2 * single["pages"] <= cache["num_pages"] <= 2 * single["pages"] + 3
        assert cache["token_capacity"] == 16 * cache["num_pages"]
        got = scenario(llm)
        assert got["tokens"] == single["tokens"]
        assert single["preemptions"] > 0 and got["preemptions"] == 0


SMALL_BUDGET = {**OPTIONS, "cache_budget_bytes": 450_000}


@pytest.fixture(scope="module")
def small_budget_pair():
    """A DCP pair on a budget too small for one rank, shared by the two tests below (the last
    one kills a member); closed whatever happened."""
    with dcp_llm(2, decode_steps=1, **SMALL_BUDGET) as llm:
        yield llm


@deadline(90)
def test_a_budget_too_small_for_one_rank_serves_a_whole_request_on_a_dcp_pair(
    small_budget_pair,
):
    """450_000 bytes cannot hold one request of max_model_len=512 tokens on one rank (refused
    before any process starts), but they hold it on a DCP pair, which serves it."""
    before = multiprocessing.active_children()
    with pytest.raises(EngineConfigError, match="cannot hold one request of max_model_len=512"):
        LLM("tiny", parallel=ParallelConfig(world_size=2), **SMALL_BUDGET)
    assert multiprocessing.active_children() == before
    prompt = prompt_ids(1, 9, 400, 401)
    params = SamplingParams(temperature=0, max_tokens=112, ignore_eos=True)
    llm = small_budget_pair
    assert llm.engine.rank_caches[0]["token_capacity"] >= 512
    (out,) = llm.generate(_as_prompts(prompt), params, use_tqdm=False)
    assert len(out.token_ids) == 112 and out.outputs[0].finish_reason == "length"
    # A rank named by the caller places the request on its group (the leader's rank).
    engine = llm.engine
    assert engine.add_request("pinned", [5, 6, 7], params, rank=1) == 0
    assert engine.abort("pinned")
    ended = [o for _ in range(200) for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in ended] == ["abort"]
    assert not engine.has_unfinished()


@deadline(90)
def test_a_killed_member_fails_generate_and_stops_every_worker(small_budget_pair):
    """Rank 1, the follower of the pair: its leader's collectives fail, the front end names
    the rank that died and no worker is left. The small-budget pair's last test."""
    pids = set(small_budget_pair.engine.worker_pids)
    kill_rank_1_mid_run(small_budget_pair)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ParallelConfig(world_size=4, dcp=3), r"dcp=3 does not divide world_size=4"),
        (lambda: ParallelConfig(world_size=2, dcp=0), r"dcp must be an int >= 1"),
        (
            lambda: ParallelConfig(world_size=2, dcp=2, dwdp=2),
            r"dcp=2 members run the same tokens in lockstep, and dwdp=2",
        ),
        (
            lambda: ParallelConfig(world_size=2, dcp=2, l2="mooncake"),
            r"dcp=2 members must see the same prefix hits",
        ),
        (
            lambda: ParallelConfig(world_size=2, dcp=2, l2_master="127.0.0.1:1"),
            r"dcp=2 members must see the same prefix hits",
        ),
        (
            lambda: LLM(
                "tiny", parallel=ParallelConfig(world_size=2, dcp=2), device="cpu", page_size=15
            ),
            r"EngineConfig.page_size=15 is not a multiple of 2",
        ),
        (
            lambda: LLM("tiny", parallel=ParallelConfig(world_size=4, dcp=2, tp=8), device="cpu"),
            r"tp=8 does not divide world_size=4",
        ),
    ],
    ids=["world", "zero", "dwdp", "mooncake", "l2_master", "page_size", "tp"],
)
def test_bad_dcp_configs_are_refused_before_any_process_starts(make, message):
    before = multiprocessing.active_children()
    with pytest.raises(ParallelError, match=message):
        make()
    assert multiprocessing.active_children() == before


def test_dcp_on_a_model_without_mla_layers_is_refused(monkeypatch):
    config = attrs.evolve(get_preset("tiny"), layer_kinds=("kda",) * 9, name="kda-only")
    monkeypatch.setattr("tokenspeed.runtime.multirank.model_config_of", lambda model: config)
    before = multiprocessing.active_children()
    with pytest.raises(ParallelError, match="dcp=2 splits the MLA latent cache, but model "):
        MultiRankEngine("tiny", ParallelConfig(world_size=2, dcp=2), EngineConfig(device="cpu"))
    assert multiprocessing.active_children() == before


# ------------------------------------------------------------------ the lockstep's DCP checks


def _members(rank: int, world: int, same: bool):
    """Both ranks as one DCP pair (the plain tiny model: the check comes before any forward),
    given the same request or (same=False) each its own."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)
    config = EngineConfig(device="cpu", page_size=16, max_model_len=128, max_num_seqs=2)
    engine = Engine(model, None, config)
    control = Group(dist.new_group([0, 1], backend="gloo"), (0, 1), rank)
    lock = LockstepEngine(engine, control, control)
    rid = "a" if same or rank == 0 else "b"
    engine.add_request(rid, list(range(5, 40)), SamplingParams(temperature=0, max_tokens=4))
    agreed, tokens = [], []
    try:
        for _ in range(20):
            # The leader's count is agreed; the follower's is ignored.
            tokens += [o.token_ids for o in lock.step(commands=7 if rank == 0 else 99)]
            agreed.append(lock.commands_agreed)
            if not lock.group_busy and not engine.has_unfinished():
                break
    except LockstepError as exc:
        return "refused", str(exc)
    finally:
        engine.close()
    return "ran", (agreed, tokens[-1])


@pytest.mark.parametrize("same", [True, False], ids=["same", "different"])
def test_members_agree_on_commands_and_steps_or_stop(same):
    results = run_ranks(_members, 2, same, timeout=90)
    if same:
        assert results[0] == results[1]
        kind, (agreed, tokens) = results[0]
        assert kind == "ran" and set(agreed) == {7} and len(tokens) == 4
    else:
        for kind, message in results:  # both members stop, at the same step
            assert kind == "refused"
            assert "members of DCP group (0, 1) disagree" in message


@pytest.mark.slow
def test_torchrun_runs_dcp_ranks():
    """`python -m tokenspeed.runtime.worker --dcp 2` under torchrun: one DCP pair, every prompt
    on it, its leader's outputs printed once, the single-rank engine's tokens."""
    check_torchrun_worker("--dcp", "2")
