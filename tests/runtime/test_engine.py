"""The engine against the model's own greedy decoding of each request alone."""

import time

import numpy as np
import pytest
import torch

from tokenspeed.cache import CacheConfig
from tokenspeed.runtime import Engine, EngineConfig, RequestError, SamplingParams, StepError
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.config import EngineConfigError

from .conftest import reference, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(engine, requests):
    """Add (rid, prompt, params) requests, step until all finish, check the cache every step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    assert not engine.has_unfinished()
    return done


def small_engine(model, **options):
    base = dict(
        page_size=16,
        max_num_seqs=4,
        max_model_len=400,
        prefill_token_budget=48,
        checkpoint_interval_pages=2,
    )
    base.update(options)
    return Engine(model, None, EngineConfig(**base))


# decode_steps=4: multi-step decoding (steps fed on the device, reported after the run).
STEPS = pytest.mark.parametrize("decode_steps", [1, 4])


@STEPS
def test_mixed_length_batch_matches_each_request_alone(tiny, decode_steps):
    prompts = [tokens(n, seed=n) for n in (37, 5, 120, 16, 64, 1)]
    engine = small_engine(tiny, decode_steps=decode_steps)
    done = run(engine, [(i, p, GREEDY) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert done[i].token_ids == reference(tiny, p, 12), i
        assert done[i].outputs[0].finish_reason == "length"


@STEPS
def test_turns_hit_the_prefix_cache_and_stay_exact(tiny, decode_steps):
    engine = small_engine(tiny, decode_steps=decode_steps)
    first = tokens(70, seed=1)
    out1 = run(engine, [("t1", first, GREEDY)])["t1"]
    second = first + out1.token_ids + tokens(9, seed=2)  # the next turn of the conversation
    out2 = run(engine, [("t2", second, GREEDY)])["t2"]
    assert out2.metrics.cached_tokens >= 64  # resumed from the first turn's pages + checkpoint
    assert out2.token_ids == reference(tiny, second, 12)
    assert engine.metrics.hit_rate > 0.3


@STEPS
def test_preemption_under_a_tiny_cache_loses_nothing(tiny, decode_steps):
    geometry = cache_geometry(tiny, 16)
    budget = CacheConfig.budget_for(geometry, pages=14, live_requests=4, checkpoints=16)
    engine = small_engine(
        tiny,
        max_model_len=14 * 16,
        cache_budget_bytes=budget,
        checkpoint_slots=16,
        max_preemptions=50,
        decode_steps=decode_steps,
    )
    prompts = [tokens(n, seed=100 + n) for n in (50, 40, 45, 30)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    done = run(engine, [(i, p, params) for i, p in enumerate(prompts)])
    assert sum(o.metrics.preemptions for o in done.values()) > 0  # the budget forced some
    for i, p in enumerate(prompts):
        assert done[i].token_ids == reference(tiny, p, 40), i


def _replay(model, l2, decode_steps=1):
    """Three conversations, three turns each, one request at a time, on a device tier that holds
    about one conversation: earlier sessions' turns are evicted before they come back, so their
    hits can only come from the host tier (L2)."""
    geometry = cache_geometry(model, 16)
    budget = CacheConfig.budget_for(geometry, pages=9, live_requests=4, checkpoints=3)
    engine = small_engine(
        model,
        max_model_len=9 * 16,
        cache_budget_bytes=budget,
        checkpoint_slots=3,
        l2=l2,
        decode_steps=decode_steps,
    )
    sessions = {s: tokens(30 + 7 * s, seed=200 + s) for s in range(3)}
    outputs = []
    for turn in range(3):
        for s, history in sessions.items():
            out = run(engine, [(f"s{s}t{turn}", history, GREEDY)])[f"s{s}t{turn}"]
            assert out.token_ids == reference(model, history, 12)
            outputs.append(out.token_ids)
            sessions[s] = history + out.token_ids + tokens(5, seed=300 + 10 * s + turn)
    return outputs, engine.metrics.hit_rate


@STEPS
def test_multi_turn_replay_is_identical_with_and_without_l2(tiny, decode_steps):
    with_l2, rate_l2 = _replay(tiny, "local", decode_steps)
    without, rate_none = _replay(tiny, "none", decode_steps)
    print(f"prefix hit rate: L2 on {rate_l2:.2f}, L2 off {rate_none:.2f}")
    assert with_l2 == without
    assert rate_l2 > 0.4 and rate_l2 > rate_none + 0.2


def test_abort_frees_the_cache(tiny):
    engine = small_engine(tiny)
    free = engine.cache.available_pages
    engine.add_request("a", tokens(60, seed=3), GREEDY)
    engine.add_request("b", tokens(20, seed=4), GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("a")
    assert not engine.abort("a")  # already aborted
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert engine.cache.get("a") is None
    assert engine.cache.available_pages == free


def test_the_abort_of_the_last_request_is_still_reported(tiny):
    """`while engine.has_unfinished(): engine.step()` delivers the final output of a request
    aborted when nothing else runs (it comes with the next step)."""
    engine = small_engine(tiny)
    engine.add_request("a", tokens(30, seed=5), GREEDY)
    engine.step()
    assert engine.abort("a", reason="client went away")
    assert engine.has_unfinished()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [
        ("a", True, "abort")
    ]
    assert outs[0].abort_reason == "client went away"
    engine.add_request("a", tokens(5, seed=6), GREEDY)  # the id is free again


def test_bad_requests_are_refused_before_any_work(tiny):
    engine = small_engine(tiny)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("x", [1, 512], GREEDY)
    with pytest.raises(RequestError, match="max_model_len=400"):
        engine.add_request("x", [5] * 400, GREEDY)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        engine.add_request("x", [5], SamplingParams(stop=["\n"]))
    for ids in ([1.5, 2], "hello", 7):
        with pytest.raises(RequestError, match="sequence of integers"):
            engine.add_request("x", ids, GREEDY)
    with pytest.raises(RequestError, match="logprobs=513 exceeds the vocabulary"):
        engine.add_request("x", [5], SamplingParams(logprobs=513))
    engine.add_request("x", [5], GREEDY)
    engine.add_request("y", np.array([5, 6]), SamplingParams(max_tokens=2, logprobs=512))
    engine.add_request("z", torch.tensor([5, 6]), GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("x", [6], GREEDY)
    assert engine.num_unfinished == 3
    while engine.has_unfinished():
        engine.step()


def test_a_request_that_cannot_be_queued_leaves_nothing_behind(tiny):
    engine = small_engine(tiny)
    real = engine.scheduler.add

    def failing(req):
        raise RuntimeError("queue fault")

    engine.scheduler.add = failing
    with pytest.raises(RuntimeError, match="queue fault"):
        engine.add_request("x", [5, 6], SamplingParams(seed=3, max_tokens=2))
    assert not engine.has_unfinished() and engine.num_unfinished == 0
    assert "x" not in engine.sampler._request_generators
    engine.scheduler.add = real
    engine.add_request("x", [5, 6], SamplingParams(seed=3, max_tokens=2))  # the id is free
    while engine.has_unfinished():
        engine.step()


def test_a_stop_token_as_the_first_output_ends_the_request(tiny):
    prompt = tokens(23, seed=9)
    first = reference(tiny, prompt, 1)[0]
    engine = small_engine(tiny)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first])
    other = tokens(10, seed=10)
    done = run(engine, [("a", prompt, params), ("b", other, GREEDY)])
    assert done["a"].token_ids == [first]
    assert done["a"].outputs[0].finish_reason == "stop"
    assert done["b"].token_ids == reference(tiny, other, 12)
    assert engine.cache.get("a") is None


def test_reset_metrics_starts_the_counters_afresh(tiny):
    engine = small_engine(tiny)
    run(engine, [("warm", tokens(30, seed=11), GREEDY)])
    before = engine.reset_metrics()
    assert before.steps > 0 and len(before.ttfts) == 1
    assert engine.metrics.summary()["steps"] == 0 and engine.metrics.ttfts == []
    run(engine, [("a", tokens(20, seed=12), GREEDY)])
    assert len(engine.metrics.ttfts) == 1 and engine.metrics.prompt_tokens == 20


@pytest.mark.parametrize("stop_at", range(3, 11))
def test_a_stop_inside_a_multi_step_run_ends_there_and_the_next_turn_stays_exact(tiny, stop_at):
    """A stop token sampled at output `stop_at` ends the request there, although the run computed
    up to 3 more steps for it; the cache it leaves (its turn-end checkpoint, taken from the
    state kept at its last page boundary, not from its live state, which ran on) serves the
    next turn exactly. Prompts of 41 and 38 tokens put the stop on both sides of a 16-token
    page boundary."""
    for length in (41, 38):
        prompt = tokens(length, seed=40 + length)
        expected = reference(tiny, prompt, 12)
        stop = expected[stop_at]
        if stop in expected[:stop_at]:
            continue  # the stop would fire earlier
        engine = small_engine(tiny, decode_steps=4)
        calls = 0
        engine.add_request(
            "t1", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
        )
        while engine.has_unfinished():
            outs = {o.request_id: o for o in engine.step()}
            calls += 1
            engine.check_integrity()
        assert calls < engine.metrics.steps  # some step() call ran several decode steps
        out = outs["t1"]
        assert out.token_ids == expected[: stop_at + 1]
        assert out.outputs[0].finish_reason == "stop"
        second = prompt + out.token_ids + tokens(7, seed=50 + length)
        out2 = run(engine, [("t2", second, GREEDY)])["t2"]
        assert out2.metrics.cached_tokens >= 32
        assert out2.token_ids == reference(tiny, second, 12)


def test_decode_steps_must_be_positive():
    with pytest.raises(EngineConfigError, match="decode_steps"):
        EngineConfig(decode_steps=0)


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_a_model_without_both_layer_kinds_is_refused_clearly(tiny, kind):
    config = tiny.config.evolve(layer_kinds=(kind,) * tiny.config.num_layers)
    with pytest.raises(EngineConfigError, match=r"hybrid models .* has \d+ MLA and \d+ KDA"):
        Engine(type(tiny)(config), None, EngineConfig(device="cpu"))


def test_a_cache_larger_than_the_free_memory_is_refused_before_allocating(tiny):
    """max_model_len sizes the default cache (2 x max_num_seqs x max_model_len tokens of pages):
    a figure past the machine's free memory is a clear error, not an allocation the kernel
    kills the process for."""
    config = EngineConfig(device="cpu", max_model_len=10**11, max_num_seqs=4, page_size=16)
    long = type(tiny)(tiny.config.evolve(max_position_embeddings=10**11))
    with pytest.raises(EngineConfigError, match=r"GiB .* free"):
        Engine(long, None, config)
    with pytest.raises(EngineConfigError, match="cache_budget_bytes"):
        Engine(tiny, None, EngineConfig(device="cpu", cache_budget_bytes=1 << 60))


def test_logprobs_are_the_same_in_multi_step_runs(tiny):
    """Per-step logprobs land on the right rows when an earlier row stopped inside the run."""
    a, b = tokens(33, seed=60), tokens(20, seed=61)
    stop = reference(tiny, a, 12)[4]

    def outputs(decode_steps):
        engine = small_engine(tiny, decode_steps=decode_steps)
        done = run(
            engine,
            [
                ("a", a, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])),
                ("b", b, SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
            ],
        )
        return {
            k: (o.token_ids, o.outputs[0].logprobs, o.outputs[0].top_logprobs)
            for k, o in done.items()
        }

    multi, single = outputs(4), outputs(1)
    assert len(multi["a"][0]) < 12 and len(multi["b"][1]) == 12
    for rid in "ab":
        assert multi[rid][0] == single[rid][0]
    # Same tokens; the values may differ in the last bits (the stopped row stays in the multi-step
    # batch, so b's rows are computed in batches of another size).
    assert multi["b"][1] == pytest.approx(single["b"][1], rel=1e-5)
    for got, want in zip(multi["b"][2], single["b"][2], strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)
    assert multi["a"][1] is None  # a did not ask


class FailsOn:
    """Bytes as text, but decoding any output holding `poison` raises (as tiktoken does for an
    id past its encoding)."""

    eos_token_ids = ()

    def __init__(self, poison: int):
        self.poison = poison

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        if self.poison in ids:
            raise KeyError(f"Invalid token for decoding: {self.poison}")
        return bytes(i % 256 for i in ids).decode(errors="replace")


@pytest.mark.parametrize("stop", [(), ("zz",)], ids=["text", "stop-strings"])
def test_a_tokenizer_that_fails_on_one_request_costs_that_request_only(tiny, stop):
    """Before, the failure escaped the step after its bookkeeping; every later step rendered the
    aborted request again and failed again, for good."""
    bad, good = tokens(15, seed=31), tokens(12, seed=32)
    want_good = reference(tiny, good, 5)
    poison = reference(tiny, bad, 1)[0]
    assert poison not in want_good
    engine = small_engine(tiny)
    engine.tokenizer = FailsOn(poison)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop=stop)
    done = run(engine, [("bad", bad, params), ("good", good, params)])
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert done["bad"].abort_reason.startswith("tokenizer failed")
    assert "Invalid token for decoding" in done["bad"].abort_reason
    assert done["good"].token_ids == want_good and done["good"].outputs[0].finish_reason == "length"
    assert engine.cache.get("bad") is None
    again = run(engine, [("next", good, params)])  # the engine goes on serving
    assert again["next"].token_ids == want_good


def test_inter_token_latencies_of_a_multi_step_run_share_its_time(tiny):
    """Tokens of a multi-step run reach the host together. Before, the first of them got the
    whole gap since the row's previous token as its latency and the others about a microsecond
    each, so the P90 ITL and interactivity said nothing of the decode speed (at 11 steps a run
    or more, P90 interactivity came out near a million tokens/s). Now each token of the run gets
    an equal share of that gap, as the simulator scores a request (1 / its mean ITL)."""
    engine = small_engine(tiny, decode_steps=4)
    real = engine.runner.decode

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return real(*args, **kwargs)

    engine.runner.decode = slow
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = run(engine, [("a", tokens(20, seed=70), params)])["a"]
    itls = engine.metrics.itls
    assert len(itls) == len(out.token_ids) - 1 == 11  # one per token after the first
    assert min(itls) >= 0.01  # every token waited for a decode step of its own
    m = out.metrics
    assert sum(itls) == pytest.approx(m.last_token_time - m.first_token_time)
    assert engine.metrics.summary()["p90_interactivity_tok_s"] <= 100


def test_p90_interactivity_is_the_simulators_per_request_score(tiny):
    """AgentX scores interactivity per request, as `sim.cluster.records.summarize` does: 1 / the
    request's mean inter-token latency, then the value 90% of requests reach or beat (1 / the
    P90 of those means). The engine's used to be 1 / the P90 of every token's latency, which
    weights a request by its length: here the slow short request's tokens set it alone."""
    from tokenspeed.sim.cluster.records import RequestRecord, summarize

    engine = small_engine(tiny)
    real, delay = engine.runner.decode, [0.0]

    def slow(*args, **kwargs):
        time.sleep(delay[0])
        return real(*args, **kwargs)

    engine.runner.decode = slow
    done = {}
    for rid, max_tokens, seconds in [
        ("long", 12, 0.0),
        ("slow", 4, 0.03),
        ("mid", 6, 0.01),
        ("one", 1, 0.0),
    ]:
        delay[0] = seconds
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        done |= run(engine, [(rid, tokens(10, seed=len(done)), params)])
    records = [
        RequestRecord(
            rid=rid,
            session=rid,
            kind="main",
            arrival=out.metrics.arrival_time,
            prompt_tokens=10,
            output_tokens=len(out.token_ids),
            first_token=out.metrics.first_token_time,
            finish=out.metrics.last_token_time,
            generated=len(out.token_ids),
        )
        for rid, out in done.items()
    ]
    sim = summarize(
        records, start=min(r.arrival for r in records), num_gpus=1, events=0, wall_s=0.0
    )
    assert engine.metrics.summary()["p90_interactivity_tok_s"] == pytest.approx(
        sim.p90_interactivity, rel=1e-9
    )


def test_p90_interactivity_leaves_out_aborted_and_single_token_requests(tiny):
    """As in the simulator: an aborted request, and one whose tokens came all at once (one
    token), have no interactivity to score; with nothing scored it is None, not infinite."""
    engine = small_engine(tiny)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run(engine, [("one", tokens(10, seed=1), one)])
    engine.add_request("gone", tokens(10, seed=2), GREEDY)
    for _ in range(3):
        engine.step()  # its prefill and first decode steps
    assert engine.abort("gone")
    run(engine, [])
    assert engine.metrics.request_itls == [] and len(engine.metrics.itls) >= 1
    assert engine.metrics.summary()["p90_interactivity_tok_s"] is None


def test_a_request_preempted_by_a_failed_step_and_then_aborted_is_not_resumed(tiny):
    """The scheduler preempts a request to make room, then the step's forward fails: the
    preempted request is not in the failed batch, and waits to be queued again by the next step.
    The caller aborts it meanwhile (as `LLM.generate` does after a failure). Before, the next
    step queued it again all the same: the scheduler held a request the engine had forgotten,
    every later step failed on it (KeyError), taking the new requests of each batch with it,
    and its id could never be used again."""
    geometry = cache_geometry(tiny, 16)
    budget = CacheConfig.budget_for(geometry, pages=14, live_requests=4, checkpoints=16)
    engine = small_engine(
        tiny,
        max_model_len=14 * 16,
        cache_budget_bytes=budget,
        checkpoint_slots=16,
        max_preemptions=50,
    )
    free = engine.cache.available_pages
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate((50, 40, 45, 30)):
        engine.add_request(i, tokens(n, seed=100 + n), params)
    real_schedule, real_decode = engine.scheduler.schedule, engine.runner.decode
    preempted = []

    def schedule(**kwargs):
        plan = real_schedule(**kwargs)
        if not preempted:
            preempted.extend(r.rid for r in engine.scheduler.decode.preempted)
        return plan

    def decode(*args, **kwargs):
        if preempted and engine.scheduler.decode.preempted:  # the step that preempted
            raise RuntimeError("injected: device error")
        return real_decode(*args, **kwargs)

    engine.scheduler.schedule, engine.runner.decode = schedule, decode
    failed = None
    while failed is None and engine.has_unfinished():
        try:
            engine.step()
        except StepError as exc:
            failed = exc
    assert failed is not None and preempted  # a step preempted, then failed
    assert not set(preempted) & set(failed.aborted)  # the preempted were not in its batch
    for rid in range(4):
        engine.abort(rid, "the caller gave up")
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert not engine.scheduler.has_work  # nothing left behind in the scheduler
    assert engine.cache.available_pages == free
    del vars(engine.scheduler)["schedule"], vars(engine.runner)["decode"]
    prompt = tokens(10, seed=5)
    done = run(engine, [(preempted[0], prompt, GREEDY), ("new", prompt, GREEDY)])
    for rid in (preempted[0], "new"):
        assert done[rid].token_ids == reference(tiny, prompt, 12)
