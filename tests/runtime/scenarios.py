"""Random engine scenarios shared by the stress and fault tests: engine configs, requests made
up as the engine runs (each with the tokens it must produce), and engines playing them (one
engine, one behind `AsyncEngine`, two sharing a host tier), optionally with failing steps."""

import asyncio
import random
from typing import NamedTuple

from tokenspeed.cache import CacheConfig, LocalHostCache
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams, StepError
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.cache_sizing import cache_geometry

from .conftest import reference, tokens

PAGE = 16
MAX_OUT = 20


def make_engine(model, rng: random.Random, l2=None, tight: float = 0.6) -> Engine:
    """A random engine config; `l2`: a host tier to share with other engines (else its own or
    none, at random); `tight`: the chance of a device tier of a few requests' worth."""
    seqs = rng.choice([2, 3, 4])
    options = dict(
        device="cpu",  # the same engine on every machine (a GPU one is tested on its own)
        page_size=PAGE,
        max_num_seqs=seqs,
        max_model_len=rng.choice([400, 400, 130]),  # 130: outputs cut at the model's limit
        prefill_token_budget=rng.choice([32, 48, 96]),
        checkpoint_interval_pages=rng.choice([1, 2, 3]),
        decode_steps=rng.choice([1, 3, 6]),
        l2=rng.choice(["local", "none"]),
        max_preemptions=100,
    )
    if rng.random() < tight:  # a device tier of a few requests' worth: preemption and eviction
        slots = rng.randint(4, 12)
        pages = rng.randint(16, 30)
        # max_model_len at most what the cache holds: the engine refuses a cache that cannot
        # hold one request of max_model_len tokens.
        options["max_model_len"] = min(options["max_model_len"], pages * PAGE)
        options["cache_budget_bytes"] = CacheConfig.budget_for(
            cache_geometry(model, PAGE),
            pages=pages,
            live_requests=seqs,
            checkpoints=slots,
        )
        options["checkpoint_slots"] = slots
    return Engine(model, None, EngineConfig(**options), l2=l2)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_k=50, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True
    )


def alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens of one request served alone by a fresh engine (single steps, a roomy cache)."""
    engine = Engine(
        model, None, EngineConfig(device="cpu", page_size=PAGE, max_num_seqs=1, max_model_len=400)
    )
    engine.add_request("alone", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("the request did not finish")


class Scenario:
    """Requests made up as the engine runs, each with the tokens it must produce."""

    def __init__(self, model, rng: random.Random, limit: int = 400, follow_ups: float = 0.5):
        self.model, self.rng, self.limit = model, rng, limit  # limit: the engines' max_model_len
        self.follow_ups = follow_ups  # the chance that a request continues a conversation
        self.params: dict[str, SamplingParams] = {}
        self.failed: set[str] = set()  # aborted by a failed step, not yet tried again
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
        if self.failed and rng.random() < 0.5:  # a request a failed step aborted, again
            prev = rng.choice(sorted(self.failed))
            self.failed.discard(prev)
            self.prompts[rid], self.expected[rid] = self.prompts[prev], self.expected[prev]
            self.params[rid] = self.params[prev]
            return rid, self.prompts[rid], self.params[rid]
        done = [r for r in self.finished if r not in self.aborted]
        if done and rng.random() < self.follow_ups:  # the next turn of a finished conversation
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
            self.params[rid] = sampled(max_tokens, seed)
            return rid, prompt, self.params[rid]
        stop_ids = []
        if rng.random() < 0.3:
            stop = full[rng.randrange(MAX_OUT)]
            stop_ids = [stop]
            if stop in expected:
                expected = expected[: expected.index(stop) + 1]
        self.expected[rid] = expected
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            stop_token_ids=stop_ids,
            logprobs=1 if rng.random() < 0.2 else None,
        )
        self.params[rid] = params
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

    def failed_step(self, err: StepError) -> None:
        """A step failed: the requests of its batch end aborted (and may be sent again)."""
        assert err.aborted, err
        self.aborted.update(err.aborted)
        self.failed.update(err.aborted)

    def record(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in self.finished, f"{out.request_id} finished twice"
                self.finished[out.request_id] = out
                if (out.abort_reason or "").startswith("admission failed"):
                    # Its admission failed (no StepError: the step went on without it).
                    self.aborted.add(out.request_id)
                    self.failed.add(out.request_id)


# The device calls `inject_failures` makes fail: the runner's forwards and the port's KDA state
# copies (the state keeper's), of a step; the cache storage's, of an admission.
STEP_CALLS = ("forward", "decode")
STATE_COPY_CALLS = ("read_live_state", "write_checkpoint_state")
ADMISSION_CALLS = ("zero_live", "restore_checkpoint", "page_load_steps", "state_load_steps")


def inject_failures(
    engine: Engine, rng: random.Random, rate: float, kinds=("step", "admission")
) -> dict[str, int]:
    """Make the engine's device work raise at random (as an out-of-memory or a device error
    would), each call with probability `rate`: forward passes (half of them before the pass,
    half after it has written the rows' cache and state), the copies of KDA states out of the
    live slots and into checkpoint slots, and the device work of admitting a request (zeroing or
    restoring its live state, setting up the copies of its host-tier hit); `kinds` picks "step"
    and / or "admission". Returns the counts of failures ("failures" in all, "admissions" of
    them while admitting), kept up to date."""
    count = {"failures": 0, "admissions": 0}
    targets = []
    if "step" in kinds:
        targets += [(engine.runner, name) for name in STEP_CALLS]
        targets += [(engine.port, name) for name in STATE_COPY_CALLS]
    if "admission" in kinds:
        targets += [(engine.cache.storage, name) for name in ADMISSION_CALLS]
    for owner, name in targets:
        real = getattr(owner, name)
        forward = name in ("forward", "decode")
        admission = owner is engine.cache.storage

        def failing(*args, _real=real, _forward=forward, _admission=admission, **kwargs):
            if rng.random() >= rate:
                return _real(*args, **kwargs)
            count["failures"] += 1
            count["admissions"] += _admission
            if _forward and rng.random() < 0.5:
                _real(*args, **kwargs)  # the state moved on; then something failed
            raise RuntimeError("injected: CUDA error")

        setattr(owner, name, failing)  # the instance attribute shadows the method
    return count


def failed_by_injection(out) -> bool:
    """Whether a final output is an abort caused by a failing step or admission."""
    reason = out.abort_reason or ""
    return reason.startswith(("step failed", "admission failed"))


def assert_idle(engine: Engine, idle_pages: int, rids=()) -> None:
    """The engine holds nothing for `rids`, every page the requests held is free or cached
    (evictable) again, and the cache checks out."""
    for rid in rids:
        assert engine.cache.get(rid) is None, rid
    assert engine.cache.available_pages == idle_pages
    engine.check_integrity()


class Played(NamedTuple):
    engine: Engine  # idle
    failures: int  # device calls made to fail (`inject_failures`)
    admissions: int  # of them, while admitting a request


def play(
    model,
    seed: int,
    num_requests: int = 12,
    l2=None,
    tight: float = 0.6,
    follow_ups: float = 0.5,
    failures: float = 0.0,
    kinds=("step", "admission"),
) -> Played:
    """One engine (its host tier `l2` when given) serving `num_requests` random requests that
    arrive while others run, some aborted. `tight`, `follow_ups`: as in `make_engine` and
    `Scenario`; `failures`: the chance that a device call fails, of `kinds` (`inject_failures`)."""
    rng = random.Random(seed)
    engine = make_engine(model, rng, l2=l2, tight=tight)
    injected = inject_failures(engine, random.Random(seed + 1), failures, kinds)
    idle_pages = engine.cache.available_pages
    scenario = Scenario(model, rng, engine.config.max_model_len, follow_ups)
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
        try:
            scenario.record(engine.step())
        except StepError as err:
            assert failures, err
            scenario.failed_step(err)
        engine.check_integrity()
    assert not engine.has_unfinished() and added == num_requests

    assert set(scenario.finished) == set(scenario.prompts)
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
    assert_idle(engine, idle_pages, scenario.prompts)
    return Played(engine, injected["failures"], injected["admissions"])


def play_async(
    model, seed: int, num_requests: int = 10, failures: float = 0.0, step_thread: bool = False
) -> int:
    """`play`'s scenarios through `AsyncEngine`: consumers arrive at random moments; some read to
    the end, some walk away after a few outputs or have their task cancelled (their requests are
    aborted), some are aborted by another task. Every consumer ends (no hang), and the engine
    ends idle with its cache intact. `failures`: the chance that a device call fails
    (`inject_failures`); `step_thread`: steps on `AsyncEngine`'s worker thread, so consumers
    come and go while a step runs. Returns the failures made."""
    rng = random.Random(seed)
    engine = make_engine(model, rng)
    injected = inject_failures(engine, random.Random(seed + 1), failures)
    idle_pages = engine.cache.available_pages
    server = AsyncEngine(engine, step_thread=step_thread)
    scenario = Scenario(model, rng, engine.config.max_model_len)
    requests = [scenario.make_request(n) for n in range(num_requests)]
    plans = [(rng.randint(0, 30), rng.choice(["read", "read", "leave", "abort", "cancel"]),
              rng.randint(1, 4)) for _ in requests]  # fmt: skip

    async def consume(rid, prompt, params, how, after, seen):
        async for out in server.generate(rid, prompt, params):
            seen.append(out)
            if out.finished:
                scenario.finished[rid] = out
                if failed_by_injection(out):
                    assert failures, out.abort_reason
                    scenario.aborted.add(rid)
            elif how == "leave" and len(seen) == after:
                scenario.aborted.add(rid)  # the consumer goes away: the request is aborted
                return
            elif how == "abort" and len(seen) == after and await server.abort(rid):
                scenario.aborted.add(rid)  # its final output (an abort) still comes

    async def client(request, plan):
        rid, prompt, params = request
        start, how, after = plan
        for _ in range(start):
            await asyncio.sleep(0)
        seen: list = []
        task = asyncio.ensure_future(consume(rid, prompt, params, how, after, seen))
        if how == "cancel":  # the handler's task is cancelled (the client disconnected)
            while not task.done() and len(seen) < after:
                await asyncio.sleep(0)
            if task.cancel():
                scenario.aborted.add(rid)
        try:
            await task
        except asyncio.CancelledError:
            assert how == "cancel"

    async def main():
        clients = [client(r, p) for r, p in zip(requests, plans, strict=True)]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=120)
        # The abort of a consumer that left is reported by a later step.
        await asyncio.wait_for(server.wait_idle(), timeout=60)

    asyncio.run(main())
    assert not engine.has_unfinished()
    for rid, out in scenario.finished.items():
        scenario.check(rid, out)
    left = {r[0] for r, p in zip(requests, plans, strict=True) if p[1] in ("leave", "cancel")}
    assert set(scenario.finished) | left == {r[0] for r in requests}
    assert_idle(engine, idle_pages, [r[0] for r in requests])
    return injected["failures"]


def play_shared_l2(
    model,
    seed: int,
    num_requests: int = 14,
    shared=None,
    tight: float = 0.6,
    follow_ups: float = 0.5,
) -> int:
    """Two engines (two servers) sharing one host tier (`shared`, default a roomy local one):
    each request goes to either, follow-up turns included, so a turn often finds its history in
    the L2 the other engine published to. Tokens stay those of the request alone, and both
    engines end idle and intact. Returns how many turns reused the other engine's history.
    `tight`, `follow_ups`: as in `make_engine` and `Scenario`."""
    rng = random.Random(seed)
    if shared is None:
        shared = LocalHostCache(capacity_bytes=1 << 30)
    engines = [make_engine(model, rng, l2=shared, tight=tight) for _ in range(2)]
    idle = [e.cache.available_pages for e in engines]
    scenario = Scenario(model, rng, follow_ups=follow_ups)
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
        assert_idle(engine, pages)
    shared.check_integrity()
    return crossed
