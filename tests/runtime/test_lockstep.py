"""`LockstepEngine`: DEP ranks stepping in step give the single-rank engine's greedy tokens.

In-process (one rank): `forwards_in` counts exactly the forwards a plan issues (prefill rounds cut
at checkpoints, single- and multi-step decodes), and the failure paths. Multi-process (gloo CPU
ranks, `run_ranks`): every rank builds the same seeded tiny model, parallelizes it (DEP, with
and without TP subgroups), serves its own requests (uneven counts, one rank with none, mixed
lengths, a second turn over the first for prefix hits, a cache small enough to preempt, multi-
step decoding) and returns its greedy tokens, which must equal a single-rank engine's over the
unparallelized model serving every rank's requests.
"""

from __future__ import annotations

from datetime import timedelta

import attrs
import pytest
import torch
import torch.distributed as dist

from tokenspeed.cache import CacheConfig
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel import parallelize
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams, StepError
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.lockstep import LockstepEngine, LockstepError

from ..parallel.harness import run_ranks

MAX_STEPS = 3000  # a loop that has not ended by then is a bug, not a slow run


def _tiny() -> KimiForCausalLM:
    """The seeded tiny model, every router pinned to one expert per quarter of the experts.

    DEP's expert sums differ from one device's in the last bit (tests/parallel/test_dep.py), and
    the random tiny model has routing near-ties: seen, a token whose 4th and 5th experts' scores
    were within 1e-6 picking the other one on 4 ranks, which moved a greedy token a few steps
    later. A correction bias of 2 on experts 0, E/4, E/2, 3E/4 (scores are in (0, 1)) makes
    every router select those, whatever the rounding, with weights that still vary by token;
    and every rank's experts get rows from every rank (one pinned expert per rank at ep=4)."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)
    moe = model.config.moe
    pinned = torch.arange(moe.top_k) * (moe.num_experts // moe.top_k)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.zero_()[pinned] = 2.0
    return model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@attrs.frozen
class Case:
    """One multi-rank configuration: layout, engine options, and each rank's first turns
    (rid, prompt length); every rid in `second` gets a second turn (its first turn's prompt and
    output, then 9 new tokens) once all first turns are done."""

    world: int
    dims: dict
    requests: tuple[tuple[tuple[str, int], ...], ...]
    second: tuple[str, ...] = ()
    control: str = "new"  # "new": a gloo group of its own; "ep": the ep group (spans the world)
    decode_steps: int = 1
    max_tokens: int = 8
    small_cache: bool = False


def _config(model: KimiForCausalLM, case: Case) -> EngineConfig:
    options = dict(
        device="cpu",
        page_size=16,
        max_model_len=256,
        max_num_seqs=4,
        prefill_token_budget=48,
        checkpoint_interval_pages=2,
        decode_steps=case.decode_steps,
    )
    if case.small_cache:  # about one request's pages less than four need: preemption
        geometry = cache_geometry(model, 16)
        options.update(
            max_model_len=14 * 16,
            cache_budget_bytes=CacheConfig.budget_for(
                geometry, pages=14, live_requests=4, checkpoints=16
            ),
            checkpoint_slots=16,
            max_preemptions=50,
        )
    return EngineConfig(**options)


def _seed(rid: str) -> int:
    return sum(map(ord, rid))


def _serve(step, engine: Engine, requests, max_tokens: int, collective: LockstepEngine | None):
    """Add the requests, step until they are done (and, in a group, until no rank is busy: a
    do-while, so that a rank without requests still joins the group's steps); their outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(MAX_STEPS):
        for out in step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        busy = collective is not None and collective.group_busy
        if not engine.has_unfinished() and not busy:
            return done
    raise AssertionError(f"not done after {MAX_STEPS} steps")


def _turns(step, engine: Engine, case: Case, firsts, collective=None) -> dict:
    """Serve `firsts` [(rid, length)], then the second turns; {rid: (tokens, preemptions,
    cached tokens)}."""
    prompts = {rid: _tokens(n, _seed(rid)) for rid, n in firsts}
    done = _serve(step, engine, list(prompts.items()), case.max_tokens, collective)
    seconds = [
        (rid + "/2", prompts[rid] + done[rid].token_ids + _tokens(9, _seed(rid) + 1))
        for rid in case.second
        if rid in prompts
    ]
    done |= _serve(step, engine, seconds, case.max_tokens, collective)
    return {
        rid: (out.token_ids, out.metrics.preemptions, out.metrics.cached_tokens)
        for rid, out in done.items()
    }


def _rank(rank: int, world: int, case: Case) -> dict:
    timeout = timedelta(seconds=60)
    groups = ParallelGroups.build(ParallelDims(world_size=world, **case.dims), timeout=timeout)
    model = _tiny()
    parallelize(model, groups)
    if case.control == "ep":
        control = groups["ep"]
        assert control.size == world
    else:
        ranks = list(range(world))
        control = Group(dist.new_group(ranks, backend="gloo", timeout=timeout), tuple(ranks), rank)
    engine = Engine(model, None, _config(model, case))
    lock = LockstepEngine(engine, control)
    outputs = _turns(lock.step, engine, case, case.requests[rank], lock)
    engine.close()
    return {
        "outputs": outputs,
        "steps": lock.steps,
        "forwards": lock.forwards,
        "idle": lock.idle_forwards,
    }


def _reference(case: Case) -> dict:
    model = _tiny()
    engine = Engine(model, None, _config(model, case))
    firsts = [r for rank in case.requests for r in rank]
    outputs = _turns(engine.step, engine, case, firsts)
    engine.close()
    return outputs


def _check(case: Case) -> list[dict]:
    results = run_ranks(_rank, case.world, case, timeout=240)
    want = _reference(case)
    got = {rid: out for r in results for rid, out in r["outputs"].items()}
    assert sorted(got) == sorted(want)
    for rid, (tokens, _, _) in want.items():
        assert got[rid][0] == tokens, rid
        assert len(tokens) == case.max_tokens
    for rid in case.second:  # the second turn resumed from the first one's pages
        assert got[rid + "/2"][2] >= 16, rid
    # The ranks stepped together, and each ran the same number of forwards (its own + empty).
    assert len({r["steps"] for r in results}) == 1
    assert len({r["forwards"] + r["idle"] for r in results}) == 1
    for rank, r in enumerate(results):
        if not case.requests[rank]:
            assert r["forwards"] == 0 and r["idle"] > 0
    return results


WORLD2 = Case(
    world=2,
    dims=dict(ep=2),
    requests=((("a", 70), ("b", 5), ("c", 37)), (("d", 19),)),
    second=("a", "d"),
)
WORLD4 = (((("a", 70), ("b", 5)), (("c", 37),), (("d", 120), ("e", 1), ("f", 16)), ()),)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_dep_world_2_matches_one_rank(decode_steps):
    _check(attrs.evolve(WORLD2, decode_steps=decode_steps))


@pytest.mark.parametrize("dims", [dict(ep=4), dict(tp=2, ep=4)], ids=["dep", "dep+tp2"])
def test_dep_world_4_with_an_idle_rank_matches_one_rank(dims):
    _check(Case(world=4, dims=dims, requests=WORLD4[0], second=("a", "c"), control="ep"))


@pytest.mark.slow
def test_more_ranks_than_requests():
    _check(Case(world=4, dims=dict(ep=4), requests=((), (("a", 40),), (), ()), control="ep"))


@pytest.mark.slow
def test_preemption_under_a_small_cache_matches_one_rank():
    case = Case(
        world=2,
        dims=dict(ep=2),
        requests=((("a", 50), ("b", 40), ("c", 45), ("d", 30)), (("e", 33), ("f", 20))),
        max_tokens=40,
        small_cache=True,
    )
    results = _check(case)
    assert sum(p for _, p, _ in results[0]["outputs"].values()) > 0  # the cache forced some


# ---------------------------------------------------------------------- one rank, in process
def _single(**options) -> Engine:
    base = dict(
        device="cpu",
        page_size=16,
        max_model_len=256,
        max_num_seqs=4,
        prefill_token_budget=48,
        checkpoint_interval_pages=2,
    )
    return Engine(_tiny(), None, EngineConfig(**(base | options)))


def _alone(engine: Engine) -> LockstepEngine:
    return LockstepEngine(engine, Group(None, (0,), 0))


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_forwards_in_counts_what_run_plan_issues(decode_steps):
    engine = _single(decode_steps=decode_steps)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, n in enumerate((70, 5, 120, 33)):
        engine.add_request(i, _tokens(n, i), params)
    seen = set()
    while engine.has_unfinished():
        plan = engine.plan_step()
        n, before = engine.forwards_in(plan), engine.runner.forwards_started
        engine.run_plan(plan)
        assert engine.runner.forwards_started - before == n
        assert engine.runner.forwards_done == engine.runner.forwards_started
        seen.add(n)
    assert max(seen) > 1  # prefills of several rounds, or multi-step decodes, were counted


def test_idle_forward_changes_nothing():
    engine = _single()
    lock = _alone(engine)
    assert lock.step() == [] and lock.group_busy is False
    assert engine.runner.forwards_started == 0  # no rank had a forward: none ran
    engine.add_request("a", _tokens(40, 1), SamplingParams(max_tokens=3))
    lock.step()  # a prefill: pages and live state to keep
    assert lock.group_busy is True
    pools = engine.runner.pools
    config = engine.model.config

    def snapshot():
        mla = [pools.mla_layer(i).clone() for i in range(len(config.mla_layers))]
        kda = [t.clone() for i in range(len(config.kda_layers)) for t in pools.kda_layer(i)]
        return mla + kda, engine.cache.stats().as_dict()

    before = snapshot()
    engine.idle_forward()
    after = snapshot()
    assert engine.runner.forwards_done == engine.runner.forwards_started
    assert before[1] == after[1]
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0], strict=True))


def test_a_forward_count_that_drifts_is_refused():
    engine = _single()
    engine.add_request("a", _tokens(70, 1), SamplingParams(max_tokens=2))
    engine.forwards_in = lambda plan: Engine.forwards_in(engine, plan) + 1
    with pytest.raises(LockstepError, match="forwards_in said"):
        _alone(engine).step()


def test_a_failure_between_forwards_keeps_the_group_in_step():
    engine = _single()
    lock = _alone(engine)
    # One chunk of 40 tokens, cut at the checkpoint at 32: two forwards, and between them the
    # KDA state at 32 is stashed, which fails here.
    engine.add_request("a", _tokens(40, 1), SamplingParams(max_tokens=2))
    stash = engine.keeper.stash

    def failing(*args):
        raise RuntimeError("stash failed")

    engine.keeper.stash = failing
    with pytest.raises(StepError):
        lock.step()
    # The rank's plan stopped after its first forward; the other was run empty, as peers expect.
    assert (lock.forwards, lock.idle_forwards) == (1, 1)
    engine.keeper.stash = stash
    outs = lock.step()  # the next step reports the aborted request
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert not engine.has_unfinished() and lock.group_busy is True


def test_a_failure_inside_a_forward_breaks_the_group():
    engine = _single()
    engine.add_request("a", _tokens(20, 1), SamplingParams(max_tokens=2))

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    engine.model.model.norm.register_forward_pre_hook(broken)  # after every layer
    with pytest.raises(LockstepError, match="midway") as info:
        _alone(engine).step()
    assert isinstance(info.value.__cause__, StepError)
