"""Speculative decoding under a seeded random workload (docs/spec.md, section 5): random prompt
lengths and max_tokens, arrivals and aborts at random steps, second turns hitting their first
turn's prefix, and a device cache small enough to preempt. After every step the engine's cache
is consistent; at the end no page, checkpoint or KDA slot is leaked; and every request that was
not aborted has the greedy output of the same workload run without speculation."""

import random
import tempfile

import pytest
import torch

from tokenspeed.cache import CacheConfig
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.spec import SpeculativeConfig

from .conftest import tiny_model, tokens
from .spec.helpers import drafter_config, write_drafter

NORMAL = ("length", "stop")
PAGES = 18
DRAFTER_PAGE_BYTES = 2 * 16 * 2 * 16 * 4  # the drafter's keys and values of a page (fp32)


@pytest.fixture(scope="module")
def model():
    """`tiny` with its attention outputs scaled down: it mostly follows its current token, so
    its outputs repeat spans and the n-gram proposer's drafts are sometimes accepted (partial
    acceptance, rollback), not only rejected."""
    net = tiny_model()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(0.05)
    return net


def workload(seed: int) -> dict:
    """Arrivals (step -> [(rid, prompt, max_tokens)]), aborts (step -> [rid]) and second turns
    (rid -> (earliest step, extra tokens, max_tokens)) of a seeded random workload."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    aborts: dict[int, list] = {}
    second: dict = {}
    for i in range(14):
        n = rng.randint(3, 90)
        span = tokens(rng.randint(2, 12), 1000 * seed + i)
        # Half the prompts repeat a span, so that the n-gram proposer finds matches at once.
        prompt = (span * (n // len(span) + 1))[:n] if i % 2 else tokens(n, 1000 * seed + 50 + i)
        at = rng.randint(0, 24)
        arrivals.setdefault(at, []).append((f"r{i}", prompt, rng.randint(1, 36)))
        if rng.random() < 0.3:
            aborts.setdefault(at + rng.randint(0, 25), []).append(f"r{i}")
        elif rng.random() < 0.5:
            extra = tokens(rng.randint(1, 20), 1000 * seed + 90 + i)
            second[f"r{i}"] = (at + rng.randint(5, 40), extra, rng.randint(1, 30))
    return {"arrivals": arrivals, "aborts": aborts, "second": second}


def run(model, load: dict, spec: SpeculativeConfig | None) -> dict:
    """Run the workload step by step, checking the cache after every step. Returns the outputs
    and finish reasons, the preemptions, prefix-hit tokens of second turns, and the metrics."""
    # 18 pages of 16 tokens (and the drafter's rows of each on top): four requests of ~100
    # tokens do not fit at once, so the scheduler preempts.
    budget = CacheConfig.budget_for(
        cache_geometry(model, 16), pages=PAGES, live_requests=4, checkpoints=8
    )
    if spec is not None and spec.method == "eagle3":
        budget += PAGES * DRAFTER_PAGE_BYTES
    config = EngineConfig(
        device="cpu",
        page_size=16,
        max_num_seqs=4,
        max_model_len=200,
        prefill_token_budget=64,
        cache_budget_bytes=budget,
        checkpoint_slots=8,
        speculative=spec,
    )
    engine = Engine(model, None, config)
    start = engine.cache.stats()
    prompts, done, reasons = {}, {}, {}
    preemptions = hits = 0
    pending = dict(load["second"])
    step = 0
    while step <= 200 or engine.has_unfinished() or pending:
        assert step < 5000, "the workload does not finish"
        for rid, prompt, max_tokens in load["arrivals"].get(step, []):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(rid, prompt, params)
            prompts[rid] = prompt
        for rid in load["aborts"].get(step, []):
            engine.abort(rid)
        for rid, (at, extra, max_tokens) in list(pending.items()):
            if step >= at and rid in reasons:
                del pending[rid]
                if reasons[rid] in NORMAL:
                    prompt = prompts[rid] + done[rid] + extra
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                    engine.add_request(f"{rid}+", prompt, params)
                    prompts[f"{rid}+"] = prompt
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
                reasons[out.request_id] = out.outputs[0].finish_reason
                preemptions += out.metrics.preemptions
                if str(out.request_id).endswith("+"):
                    hits += out.metrics.cached_tokens
        engine.check_integrity()
        step += 1
    assert not engine.has_unfinished() and set(done) == set(prompts)
    # Nothing leaked: with every cached entry evicted the pools are back to their start.
    stats = engine.cache.stats()
    engine.cache.evict(pages=stats.pages.total, checkpoints=stats.checkpoints.total)
    end = engine.cache.stats()
    assert end.requests == 0
    assert (end.pages.free, end.pages.used, end.pages.cached) == (start.pages.free, 0, 0)
    assert (end.live_slots.free, end.live_slots.used) == (start.live_slots.free, 0)
    assert (end.checkpoints.free, end.checkpoints.used) == (start.checkpoints.free, 0)
    engine.check_integrity()
    metrics = engine.metrics
    engine.close()
    return {
        "tokens": done,
        "reasons": reasons,
        "preemptions": preemptions,
        "hits": hits,
        "metrics": metrics,
    }


@pytest.fixture(scope="module")
def plain(model):
    return {seed: run(model, workload(seed), None) for seed in (1, 2)}


def _drafter(model, root: str) -> str:
    return write_drafter(f"{root}/drafter", drafter_config(), model.model.embed_tokens, seed=5)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_random_workload_with_aborts(model, plain, method, seed):
    load = workload(seed)
    with tempfile.TemporaryDirectory(prefix="spec-random-") as root:
        if method == "ngram":
            spec = SpeculativeConfig(method="ngram", num_steps=3, min_n=1, max_n=3)
        else:
            spec = SpeculativeConfig(
                method="eagle3", draft_model=_drafter(model, root), num_steps=2
            )
        got = run(model, load, spec)
    want = plain[seed]
    aborted = {rid for rids in load["aborts"].values() for rid in rids}
    # Every request that was not aborted by the workload ends normally in both runs, with the
    # same greedy tokens.
    kept = {rid for rid in got["tokens"] if rid not in aborted}
    assert kept == {rid for rid in want["tokens"] if rid not in aborted}
    assert all(got["reasons"][rid] in NORMAL for rid in kept)
    assert all(want["reasons"][rid] in NORMAL for rid in kept)
    assert {rid: got["tokens"][rid] for rid in kept} == {rid: want["tokens"][rid] for rid in kept}
    # The workload exercised what it is meant to.
    assert any(got["reasons"][rid] == "abort" for rid in aborted)
    assert got["preemptions"] > 0 and got["hits"] > 0
    m = got["metrics"]
    assert m.spec_verify_rows > 0 and sum(m.spec_proposed) > 0
    if method == "ngram":
        assert sum(m.spec_accepted) > 0
