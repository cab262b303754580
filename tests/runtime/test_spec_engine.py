"""Speculative decoding in the engine (docs/spec.md, section 5): greedy outputs are the plain
engine's, acceptance behaves as the proposer dictates, sampling keeps the target distribution,
and the cache stays consistent."""

import math

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.cache import CacheConfig
from tokenspeed.model import ForwardBatch
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.config import EngineConfigError
from tokenspeed.runtime.spec import SpeculativeConfig, SpeculativeConfigError, target_probs

from .conftest import reference, tiny_model, tokens
from .test_multirank import OPTIONS, scenario

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return done


def engine(model, spec=None, **options):
    base = dict(device="cpu", page_size=16, max_num_seqs=4, max_model_len=400)
    return Engine(model, None, EngineConfig(**{**base, **options}, speculative=spec))


class Oracle:
    """Test-only: proposes the target's own greedy continuation (computed beforehand);
    `wrong`: the same tokens shifted by one, never accepted."""

    def __init__(self, prompts, outputs, wrong=False):
        self.want = {rid: prompts[rid] + outputs[rid] for rid in prompts}
        self.wrong = wrong

    def propose(self, rid, history, k):
        want = self.want[rid]
        assert list(history) == want[: len(history)]
        draft = want[len(history) : len(history) + k]
        return [(t + 1) % 512 for t in draft] if self.wrong else draft

    def forget(self, rid):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def requests(model):
    prompts = {i: tokens(n, 100 + i) for i, n in enumerate([5, 17, 40, 70])}
    return prompts, {i: reference(model, p, 40) for i, p in prompts.items()}


def test_config_is_validated():
    with pytest.raises(SpeculativeConfigError, match="num_steps"):
        SpeculativeConfig(num_steps=4)
    with pytest.raises(SpeculativeConfigError, match="forced_acceptance"):
        SpeculativeConfig(num_steps=2, forced_acceptance=3)
    with pytest.raises(SpeculativeConfigError, match="draft_model"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(SpeculativeConfigError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(EngineConfigError, match="decode_steps"):
        EngineConfig(speculative=SpeculativeConfig(), decode_steps=4)
    with pytest.raises(EngineConfigError, match="speculative"):
        EngineConfig(speculative={"method": "ngram"})


def test_eagle3_without_a_checkpoint_is_refused(model):
    # EAGLE3 itself: tests/runtime/test_spec_eagle3.py.
    with pytest.raises(EngineConfigError, match="draft_model='/nowhere'.*no config.json"):
        engine(model, SpeculativeConfig(method="eagle3", draft_model="/nowhere"))


def test_ngram_scenario_matches_plain_greedy():
    """Mixed lengths, second turns hitting their first turn's prefix, preemption: the same
    tokens as the plain engine, and a consistent cache afterwards."""
    plain = scenario(LLM("tiny", **OPTIONS))
    llm = LLM("tiny", speculative=SpeculativeConfig(num_steps=3), **OPTIONS)
    got = scenario(llm)
    assert got["tokens"] == plain["tokens"]
    assert got["preemptions"] > 0 and got["second_turn_hits"] > 0
    assert llm.engine.metrics.spec_verify_rows > 0
    llm.engine.check_integrity()
    llm.close()


def test_l2_hit_matches_plain(model):
    """A tight device tier (eviction) and the engine's host tier: follow-up turns after their
    pages were evicted from the device hit L2, and still produce the reference tokens."""
    prompts = {i: tokens(60 + 13 * i, 200 + i) for i in range(4)}
    want = {i: reference(model, p, 40) for i, p in prompts.items()}
    spec = SpeculativeConfig(num_steps=3)
    budget = CacheConfig.budget_for(
        cache_geometry(model, 16), pages=20, live_requests=3, checkpoints=6
    )
    small = dict(max_num_seqs=3, max_model_len=200, cache_budget_bytes=budget, checkpoint_slots=6)
    e = engine(model, spec, **small)
    got = run(e, [(i, p, GREEDY) for i, p in prompts.items()])
    assert got == want
    again = run(e, [(f"again{i}", p + want[i], GREEDY) for i, p in prompts.items()])
    for i, p in prompts.items():
        assert again[f"again{i}"] == reference(model, p + want[i], 40)
    stats = e.cache.stats()
    assert stats.counters.l2_hit_tokens > 0
    assert e.metrics.spec_verify_rows > 0
    e.check_integrity()
    e.close()


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_proposer_accepts_every_draft(model, requests, k):
    prompts, outputs = requests
    e = engine(model, SpeculativeConfig(num_steps=k))
    e.proposer = Oracle(prompts, outputs)
    assert run(e, [(i, p, GREEDY) for i, p in prompts.items()]) == outputs
    m = e.metrics
    assert m.spec_accepted == m.spec_proposed and len(m.spec_proposed) == k
    # Every verify row emits all its drafts and one more; k + 1 except where the window
    # stops at a page boundary or the request's end.
    assert m.spec_emitted_tokens == m.spec_verify_rows + sum(m.spec_proposed)
    assert m.acceptance_rates == [1.0] * k
    if k == 3:
        assert m.mean_acceptance_length > 3.0
    e.check_integrity()


def test_wrong_proposer_accepts_nothing(model, requests):
    prompts, outputs = requests
    e = engine(model, SpeculativeConfig(num_steps=3))
    e.proposer = Oracle(prompts, outputs, wrong=True)
    assert run(e, [(i, p, GREEDY) for i, p in prompts.items()]) == outputs
    assert e.metrics.mean_acceptance_length == 1.0
    assert sum(e.metrics.spec_accepted) == 0 and sum(e.metrics.spec_proposed) > 0
    e.check_integrity()


def test_ngram_accepts_on_repeating_text():
    """A model whose attention outputs are scaled down follows its current token mostly, so
    its output repeats spans: the n-gram proposer's drafts are then accepted."""
    net = tiny_model()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(0.05)
    prompts = {0: tokens(12, 3) * 4, 1: tokens(12, 7) * 3}
    want = {i: reference(net, p, 48) for i, p in prompts.items()}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    e = engine(net, SpeculativeConfig(num_steps=3, min_n=1, max_n=3))
    assert run(e, [(i, p, params) for i, p in prompts.items()]) == want
    assert e.metrics.mean_acceptance_length > 1.0
    summary = e.metrics.summary()
    assert summary["spec_mean_acceptance_length"] == e.metrics.mean_acceptance_length
    assert len(summary["spec_acceptance_rates"]) == 3
    e.check_integrity()


@pytest.mark.parametrize("forced", [0, 2])
def test_forced_acceptance_gives_exactly_that_length(model, requests, forced):
    prompts, _ = requests
    e = engine(model, SpeculativeConfig(num_steps=3, forced_acceptance=forced))
    run(e, [(i, p, GREEDY) for i, p in prompts.items()])
    m = e.metrics
    assert m.spec_verify_rows > 0
    for j, (accepted, proposed) in enumerate(zip(m.spec_accepted, m.spec_proposed, strict=True)):
        assert accepted == (proposed if j < forced else 0)
    e.check_integrity()


def test_sampled_first_speculative_token_keeps_the_target_distribution(model):
    """Goodness of fit (chi-square) of the (first, second) output tokens of many seeded
    requests against the exact probabilities computed from the model: the second token comes
    from a verify step (one draft, the most likely token: accepted often, rejected often)."""
    prompt = tokens(10, 5)
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    first = target_probs(_logits(model, prompt)[None, None], [SamplingParams(**params)])[0, 0]
    cells, expected = [], []
    best = {}
    for t1 in first.nonzero().flatten().tolist():
        p2 = target_probs(_logits(model, [*prompt, t1])[None, None], [SamplingParams(**params)])
        best[t1] = int(p2[0, 0].argmax())
        for t2 in p2[0, 0].nonzero().flatten().tolist():
            cells.append((t1, t2))
            expected.append(float(first[t1] * p2[0, 0, t2]))

    class Likely:
        def propose(self, rid, history, k):
            return [best[history[-1]]] if len(history) == len(prompt) + 1 else []

        def forget(self, rid):
            pass

    n = 600
    e = engine(model, SpeculativeConfig(num_steps=2), max_num_seqs=32)
    e.proposer = Likely()
    got = run(e, [(i, prompt, SamplingParams(seed=i, **params)) for i in range(n)])
    counts = {c: 0 for c in cells}
    for out in got.values():
        counts[tuple(out[:2])] += 1
    chi2 = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in zip(cells, expected, strict=True))
    dof = len(cells) - 1
    # 1e-4 upper tail of chi-square(dof) (Wilson-Hilferty), deterministic given the seeds.
    bound = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound, counts)
    m = e.metrics
    assert m.spec_verify_rows == n and 0 < m.spec_accepted[0] < n
    e.check_integrity()


def _logits(model, ids):
    out = model(torch.tensor(ids), ForwardBatch.build([len(ids)]), model.empty_state())
    return out.logits[-1]
