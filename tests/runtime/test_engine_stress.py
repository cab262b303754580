"""Randomised scenarios through the engine: arrivals while others run, follow-up turns of earlier
conversations, stop tokens, seeded sampling, aborts at any point, tight caches that force
preemption, L2 on and off, single- and multi-step decoding, outputs cut at `max_model_len`, and
two engines sharing one host tier. Whatever happens, every request ends exactly once with the
tokens it gets when it runs alone (greedy: the model's own decoding; seeded sampling: a fresh
engine serving only it), a prefix of them when aborted; the cache checks out after every step,
and everything it held is back when the engine is idle.

The model is the tiny one with its routers' expert preferences spaced far apart (`steady`).
Batching a request differently (a prefill in 16-token pieces here, in one piece in the reference)
moves fp32 activations by ~1e-6, and in the plain tiny model that is enough, now and then, to swap
two experts whose router scores tie to 1e-7 (seen at seed 37: scores 0.7186442 / 0.7186441), after
which the continuations part for good. That is arithmetic, not a serving bug; the fixed routing
keeps such ties out of this test, whose subject is the engine, the cache and the scheduler (the
tests in test_engine.py use the plain model on prompts without such ties).
"""

import asyncio
import copy
import random

import pytest
import torch

from tokenspeed.cache import CacheConfig, LocalHostCache
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.engine import cache_geometry

from .conftest import reference, tokens

PAGE = 16
MAX_OUT = 20


def make_engine(model, rng: random.Random, l2=None) -> Engine:
    """A random engine config; `l2`: a host tier to share with other engines (else its own or
    none, at random)."""
    seqs = rng.choice([2, 3, 4])
    options = dict(
        page_size=PAGE,
        max_num_seqs=seqs,
        max_model_len=rng.choice([400, 400, 130]),  # 130: outputs cut at the model's limit
        prefill_token_budget=rng.choice([32, 48, 96]),
        checkpoint_interval_pages=rng.choice([1, 2, 3]),
        decode_steps=rng.choice([1, 3, 6]),
        l2=rng.choice(["local", "none"]),
        max_preemptions=100,
    )
    if rng.random() < 0.6:  # a device tier of a few requests' worth: preemption and eviction
        slots = rng.randint(4, 12)
        options["cache_budget_bytes"] = CacheConfig.budget_for(
            cache_geometry(model, PAGE), pages=rng.randint(16, 30), live_requests=seqs,
            checkpoints=slots,
        )
        options["checkpoint_slots"] = slots
    return Engine(model, None, EngineConfig(**options), l2=l2)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens of one request served alone by a fresh engine (single steps, a roomy cache)."""
    engine = Engine(model, None, EngineConfig(page_size=PAGE, max_num_seqs=1, max_model_len=400))
    engine.add_request("alone", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("the request did not finish")


class Scenario:
    """Requests made up as the engine runs, each with the tokens it must produce."""

    def __init__(self, model, rng: random.Random, limit: int = 400):
        self.model, self.rng, self.limit = model, rng, limit  # limit: the engines' max_model_len
        self.expected: dict[str, list[int]] = {}  # rid -> tokens if it runs to its end
        self.prompts: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}  # rid -> final RequestOutput
        self.aborted: set[str] = set()
        self._references: dict[tuple[int, ...], list[int]] = {}

    def _reference(self, prompt: list[int], seed: int | None = None) -> list[int]:
        key = (tuple(prompt), seed)
        if key not in self._references:
            if seed is None:
                self._references[key] = reference(self.model, prompt, MAX_OUT)
            else:
                self._references[key] = alone(self.model, prompt, sampled(MAX_OUT, seed))
        return self._references[key]

    def make_request(
        self, n: int, limit: int | None = None
    ) -> tuple[str, list[int], SamplingParams]:
        """Request n: a new conversation or the next turn of a finished one, greedy (maybe with
        a stop token) or seeded sampling; its expected tokens are noted. limit: the max_model_len
        of the engine it goes to (default: the scenario's)."""
        rng, rid = self.rng, f"r{n}"
        limit = limit or self.limit
        done = [r for r in self.finished if r not in self.aborted]
        if done and rng.random() < 0.5:  # the next turn of a finished conversation
            prev = rng.choice(done)
            prompt = self.prompts[prev] + self.finished[prev].token_ids
            prompt = prompt + tokens(rng.randint(1, 20), seed=rng.randrange(1 << 30))
            if len(prompt) + MAX_OUT > limit:
                prompt = prompt[-(limit // 2) :]
        elif limit < 200 and rng.random() < 0.4:  # near the model's limit: outputs get cut
            prompt = tokens(rng.randint(limit - MAX_OUT, limit - 1), seed=rng.randrange(1 << 30))
        else:
            prompt = tokens(rng.randint(1, 120), seed=rng.randrange(1 << 30))
        seed = rng.randrange(1 << 20) if rng.random() < 0.15 else None
        full = self._reference(prompt, seed)
        max_tokens = rng.randint(1, MAX_OUT)
        expected = full[: min(max_tokens, limit - len(prompt))]
        self.prompts[rid] = prompt
        if seed is not None:
            self.expected[rid] = expected
            return rid, prompt, sampled(max_tokens, seed)
        stop_ids = []
        if rng.random() < 0.3:
            stop = full[rng.randrange(MAX_OUT)]
            stop_ids = [stop]
            if stop in expected:
                expected = expected[: expected.index(stop) + 1]
        self.expected[rid] = expected
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_ids,
            logprobs=1 if rng.random() < 0.2 else None,
        )
        return rid, prompt, params

    def new_request(self, engine: Engine, n: int) -> None:
        engine.add_request(*self.make_request(n))

    def check(self, rid: str, out) -> None:
        """A final output against what the request must produce."""
        want = self.expected[rid]
        if rid in self.aborted:
            assert out.outputs[0].finish_reason == "abort", rid
            assert out.token_ids == want[: len(out.token_ids)], rid
        else:
            assert out.token_ids == want, rid
            assert out.outputs[0].finish_reason in ("length", "stop"), rid

    def record(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in self.finished, f"{out.request_id} finished twice"
                self.finished[out.request_id] = out


def play(model, seed: int, num_requests: int = 12) -> None:
    rng = random.Random(seed)
    engine = make_engine(model, rng)
    idle_pages = engine.cache.available_pages
    scenario = Scenario(model, rng, engine.config.max_model_len)
    added = 0
    for _ in range(3000):
        if added < num_requests and (not engine.has_unfinished() or rng.random() < 0.4):
            scenario.new_request(engine, added)
            added += 1
        if engine.has_unfinished() and rng.random() < 0.08:
            running = [r for r in scenario.prompts if r not in scenario.finished]
            victim = rng.choice(running)
            if engine.abort(victim, reason="test abort"):
                scenario.aborted.add(victim)
        if not engine.has_unfinished():
            if added == num_requests:
                break
            continue
        scenario.record(engine.step())
        engine.check_integrity()
    assert not engine.has_unfinished() and added == num_requests

    assert set(scenario.finished) == set(scenario.prompts)
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
        assert engine.cache.get(rid) is None, rid
    # Idle again: every page the requests held is free or cached (evictable).
    assert engine.cache.available_pages == idle_pages
    engine.check_integrity()


def play_async(model, seed: int, num_requests: int = 10) -> None:
    """The same through `AsyncEngine`: consumers arrive at random moments; some read to the end,
    some walk away after a few outputs (their requests are aborted), some are aborted by another
    task. Every consumer ends (no hang), and the engine ends idle with its cache intact."""
    rng = random.Random(seed)
    engine = make_engine(model, rng)
    idle_pages = engine.cache.available_pages
    server = AsyncEngine(engine)
    scenario = Scenario(model, rng, engine.config.max_model_len)
    requests = [scenario.make_request(n) for n in range(num_requests)]
    plans = [(rng.randint(0, 30), rng.choice(["read", "read", "leave", "abort"]),
              rng.randint(1, 4)) for _ in requests]  # fmt: skip

    async def client(request, plan):
        rid, prompt, params = request
        start, how, after = plan
        for _ in range(start):
            await asyncio.sleep(0)
        seen = 0
        async for out in server.generate(rid, prompt, params):
            seen += 1
            if out.finished:
                scenario.finished[rid] = out
            elif how == "leave" and seen == after:
                scenario.aborted.add(rid)  # the consumer goes away: the request is aborted
                return
            elif how == "abort" and seen == after and await server.abort(rid):
                scenario.aborted.add(rid)  # its final output (an abort) still comes

    async def main():
        clients = [client(r, p) for r, p in zip(requests, plans, strict=True)]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=120)
        for _ in range(1000):  # the abort of a consumer that left is reported by a later step
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0)

    asyncio.run(main())
    assert not engine.has_unfinished()
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
    left = {r[0] for r, p in zip(requests, plans, strict=True) if p[1] == "leave"}
    assert set(scenario.finished) | left == {r[0] for r in requests}
    for rid, _, _ in requests:
        assert engine.cache.get(rid) is None, rid
    assert engine.cache.available_pages == idle_pages
    engine.check_integrity()


def play_shared_l2(model, seed: int, num_requests: int = 14) -> int:
    """Two engines (two servers) sharing one host tier: each request goes to either, follow-up
    turns included, so a turn often finds its history in the L2 the other engine published to.
    Tokens stay those of the request alone, and both engines end idle and intact."""
    rng = random.Random(seed)
    shared = LocalHostCache(capacity_bytes=1 << 30)
    engines = [make_engine(model, rng, l2=shared) for _ in range(2)]
    idle = [e.cache.available_pages for e in engines]
    scenario = Scenario(model, rng)
    where: dict[str, int] = {}
    added = 0
    for _ in range(5000):
        busy = any(e.has_unfinished() for e in engines)
        if added < num_requests and (not busy or rng.random() < 0.3):
            target = rng.randrange(2)
            rid, prompt, params = scenario.make_request(added, engines[target].config.max_model_len)
            where[rid] = target
            engines[target].add_request(rid, prompt, params)
            added += 1
        for engine in engines:
            if engine.has_unfinished():
                scenario.record(engine.step())
                engine.check_integrity()
        if added == num_requests and not any(e.has_unfinished() for e in engines):
            break
    assert set(scenario.finished) == set(scenario.prompts)
    crossed = 0
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
        crossed += out.metrics.cached_tokens > 0 and any(
            where[prev] != where[rid] and scenario.prompts[rid][: len(p)] == p
            for prev, p in scenario.prompts.items()
            if prev != rid and len(p) >= PAGE
        )
    for engine, pages in zip(engines, idle, strict=True):
        assert engine.cache.available_pages == pages
        engine.check_integrity()
    shared.check_integrity()
    return crossed


@pytest.fixture(scope="module")
def steady(tiny):
    """`tiny` whose routers always pick the same experts: the score correction bias of expert e
    is 2e, larger than any spread of the sigmoid scores, so no two experts ever tie."""
    model = copy.deepcopy(tiny)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates
    with torch.no_grad():
        for gate in gates:
            bias = gate.e_score_correction_bias
            bias.copy_(2.0 * torch.arange(len(bias), dtype=bias.dtype))
    return model


@pytest.mark.parametrize("seed", range(4))
def test_random_scenarios_end_every_request_exactly(steady, seed):
    play(steady, seed)


@pytest.mark.parametrize("seed", range(3))
def test_random_async_clients_all_end_and_leave_the_engine_idle(steady, seed):
    play_async(steady, seed)


def test_two_engines_sharing_an_l2_hand_turns_to_each_other(steady):
    crossed = sum(play_shared_l2(steady, seed) for seed in range(3))
    assert crossed > 0  # some turns reused a history the other engine had published


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_many_pairs_of_engines_sharing_an_l2(steady, seed):
    play_shared_l2(steady, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 30))
def test_many_random_async_clients_all_end_and_leave_the_engine_idle(steady, seed):
    play_async(steady, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 60))
def test_many_random_scenarios_end_every_request_exactly(steady, seed):
    play(steady, seed, num_requests=20)
