"""EAGLE3 speculative decoding in the engine (docs/spec.md, section 5): a tiny random drafter
written in the Hugging Face layout drafts for the tiny target. Greedy outputs are the plain
engine's (prefix hits, L2 hits, preemption), the drafter reads the target's states at the
documented alignment, a drafter that cannot draft for the target is refused, and its KV bytes
come out of the cache budget."""

import tempfile

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.cache import CacheConfig
from tokenspeed.model import ForwardBatch
from tokenspeed.model.eagle3 import Eagle3Drafter, PagedDraftKv
from tokenspeed.runtime import EngineConfig, SamplingParams
from tokenspeed.runtime.cache_sizing import cache_geometry, smallest_budget
from tokenspeed.runtime.config import EngineConfigError
from tokenspeed.runtime.spec import SpeculativeConfig
from tokenspeed.runtime.spec.eagle3 import Eagle3Drafts, drafter_page_bytes

from .conftest import reference, tiny_model, tokens
from .spec.helpers import drafter_config, write_drafter
from .test_multirank import OPTIONS, scenario
from .test_spec_engine import GREEDY, engine, run

PAGE_BYTES = 2 * 16 * 2 * 16 * 4  # the drafter's keys and values of a 16-token page (fp32)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory(prefix="eagle3-") as root:
        yield root


@pytest.fixture(scope="module")
def draft_path(model, folder):
    """The drafter shares the target's embedding (the checkpoint has none): every tiny
    target has the same shapes, so `LLM("tiny")` loads it too."""
    return write_drafter(f"{folder}/drafter", drafter_config(), model.model.embed_tokens)


def eagle3(path, k=3) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle3", draft_model=path, num_steps=k)


def test_scenario_matches_plain_greedy(draft_path):
    """Mixed lengths, second turns hitting their first turn's prefix, preemption: the same
    tokens as the plain engine, and a consistent cache afterwards."""
    base = LLM("tiny", **OPTIONS)
    plain = scenario(base)
    # As many pages as the plain engine's, the drafter's rows of each on top.
    sizes = base.engine.cache.sizes
    options = {
        **OPTIONS,
        "cache_budget_bytes": OPTIONS["cache_budget_bytes"] + sizes.num_pages * PAGE_BYTES,
        "checkpoint_slots": sizes.num_checkpoint_slots,
    }
    base.close()
    llm = LLM("tiny", speculative=eagle3(draft_path), **options)
    assert llm.engine.cache.sizes == sizes
    got = scenario(llm)
    assert got["tokens"] == plain["tokens"]
    assert got["preemptions"] > 0 and got["second_turn_hits"] > 0
    m = llm.engine.metrics
    assert m.spec_verify_rows > 0 and sum(m.spec_proposed) > 0
    llm.engine.check_integrity()
    llm.close()


def test_l2_hit_matches_plain(model, draft_path):
    """A tight device tier and the engine's host tier: follow-up turns hit L2 (whose pages carry
    no drafter rows) and still produce the reference tokens."""
    prompts = {i: tokens(60 + 13 * i, 200 + i) for i in range(4)}
    want = {i: reference(model, p, 40) for i, p in prompts.items()}
    geometry = cache_geometry(model, 16)
    budget = CacheConfig.budget_for(geometry, pages=20, live_requests=3, checkpoints=6)
    budget += 21 * PAGE_BYTES  # the drafter's rows of those pages
    small = dict(max_num_seqs=3, max_model_len=200, cache_budget_bytes=budget, checkpoint_slots=6)
    e = engine(model, eagle3(draft_path), **small)
    assert e.cache.sizes.num_pages == 21
    got = run(e, [(i, p, GREEDY) for i, p in prompts.items()])
    assert got == want
    again = run(e, [(f"again{i}", p + want[i], GREEDY) for i, p in prompts.items()])
    for i, p in prompts.items():
        assert again[f"again{i}"] == reference(model, p + want[i], 40)
    assert e.cache.stats().counters.l2_hit_tokens > 0
    assert e.metrics.spec_verify_rows > 0
    e.check_integrity()
    e.close()


def test_drafts_follow_the_documented_alignment(model, draft_path):
    """One request alone, no prefix hit: every round's drafts are those of the drafter run from
    scratch over the request's history (the target's states of positions 0..L-1, tokens
    1..L, then the chain), so the engine fed it each position once, in order."""
    e = engine(model, eagle3(draft_path), max_num_seqs=1)
    drafts = e.spec.drafter
    seen = []
    propose = drafts.propose

    def record(records, ks, table, gens):
        out = propose(records, ks, table, gens)
        for r, d in zip(records, out[0], strict=True):
            if d:
                seen.append((list(r.tokens), d))
        return out

    drafts.propose = record
    prompt = tokens(37, 11)
    run(e, [(0, prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))])
    assert len(seen) > 10
    drafter, points = drafts.drafter, e.runner.aux_layers
    agree = 0
    for history, got in seen:
        n = len(history) - 1  # the target's computed tokens
        ids = torch.tensor(history[:n])
        out = model(ids, ForwardBatch.build([n]), model.empty_state(), aux_hidden_layers=points)
        kv = PagedDraftKv.contiguous(drafter.config, 1, n + 8)
        want = drafter.propose(
            torch.tensor(history[1:]), out.aux_hidden, ForwardBatch.build([n]), kv, len(got)
        )
        agree += want.tokens[0].tolist() == got
    # Rounding (the engine's target ran prefill chunks and verify windows) may flip a near tie.
    assert agree >= 0.9 * len(seen), (agree, len(seen))
    e.close()


def test_unspeculated_and_sampled_rows(model, draft_path):
    """Rows with penalties or logprobs ride along in verify steps undrafted and give the plain
    engine's tokens; seeded sampled rows are reproducible; the cache stays consistent."""
    prompts = {i: tokens(20 + 9 * i, 300 + i) for i in range(4)}
    params = {
        0: GREEDY,
        1: SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        2: SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
        3: SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=5, ignore_eos=True),
    }
    requests = [(i, prompts[i], params[i]) for i in prompts]
    plain = run(engine(model), requests)
    spec = [engine(model, eagle3(draft_path, k=2)) for _ in range(2)]
    got = [run(e, requests) for e in spec]
    assert {i: got[0][i] for i in (0, 1, 2)} == {i: plain[i] for i in (0, 1, 2)}
    assert got[0][3] == got[1][3] and len(got[0][3]) == 30
    assert spec[0].metrics.spec_verify_rows > 0
    for e in spec:
        e.check_integrity()
        e.close()


@pytest.mark.parametrize(
    "changes, problem",
    [
        (dict(vocab_size=1000), "vocab_size is 1000 but the target's is 512"),
        (dict(target_hidden_size=32), "target_hidden_size"),
        (dict(aux_layer_ids=(1, 3, 20)), "past the target's 9"),
    ],
)
def test_a_drafter_for_another_model_is_refused(model, folder, changes, problem):
    path = write_drafter(f"{folder}/bad-{len(changes)}-{problem[:8]}", drafter_config(**changes))
    with pytest.raises(EngineConfigError, match="draft_model") as err:
        engine(model, eagle3(path))
    assert problem in str(err.value)


def test_drafter_kv_comes_out_of_the_cache_budget(model, draft_path):
    """The drafter's rows cost 2 * P * Hkv * Dh * 4 bytes a page: a budget that holds one
    request of max_model_len without a drafter is refused with one, and a larger budget
    yields fewer pages, the cache and the drafter's pool together within it."""
    options = dict(device="cpu", page_size=16, max_num_seqs=2, max_model_len=256)
    config = EngineConfig(**options, checkpoint_slots=2)
    need = smallest_budget(cache_geometry(model, 16), config)
    engine(model, None, **options, checkpoint_slots=2, cache_budget_bytes=need).close()
    with pytest.raises(EngineConfigError, match="EAGLE3 drafter"):
        engine(model, eagle3(draft_path), **options, checkpoint_slots=2, cache_budget_bytes=need)

    budget = 3 * need
    plain = engine(model, None, **options, checkpoint_slots=2, cache_budget_bytes=budget)
    spec = engine(
        model, eagle3(draft_path), **options, checkpoint_slots=2, cache_budget_bytes=budget
    )
    pages, drafted = plain.cache.sizes.num_pages, spec.cache.sizes.num_pages
    per_page = drafter_page_bytes(spec.spec.drafter.drafter, 16)
    assert per_page == PAGE_BYTES
    assert drafted < pages
    geometry = cache_geometry(model, 16)
    used = (
        (spec.cache.sizes.num_live_slots + spec.cache.sizes.num_checkpoint_slots)
        * geometry.kda_state_bytes
        + drafted * geometry.mla_page_bytes
        + spec.spec.drafter.pool_bytes
    )
    assert spec.spec.drafter.pool_bytes == drafted * per_page
    assert used <= budget
    plain.close()
    spec.close()


def test_pending_states_continue_cut_or_restart(model):
    """What the drafter is handed: a later chunk continues the pending positions, a resumed
    prefill inside them cuts them there and continues, one before them starts afresh."""
    drafts = Eagle3Drafts(Eagle3Drafter(drafter_config()), 2, 16, torch.device("cpu"))

    def rows(start, n):  # the states of positions start..start+n-1, told apart by value
        return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 192)

    def pending():
        p = drafts._pending["a"]
        return p.start, p.rows()[:, 0].tolist() if p.count else []

    drafts.observe("a", 0, rows(0, 5))
    drafts.observe("a", 5, rows(5, 3))  # the next chunk
    assert pending() == (0, list(range(8)))
    drafts.observe("a", 6, rows(6, 4))  # resumed at 6: positions 6, 7 computed again
    assert pending() == (0, list(range(10)))
    drafts.observe("a", 10, rows(10, 0))  # nothing new
    assert pending() == (0, list(range(10)))
    drafts.observe("a", 32, rows(32, 2))  # a prefill from a prefix hit past them
    assert pending() == (32, [32.0, 33.0])
    drafts.observe("a", 16, rows(16, 2))  # resumed before them: afresh
    assert pending() == (16, [16.0, 17.0])
    drafts.forget("a")
    assert "a" not in drafts._pending
