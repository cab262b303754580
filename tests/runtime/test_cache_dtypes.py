"""The engine with an FP8 MLA cache and bf16 KDA checkpoints (`EngineConfig.kv_cache_dtype`,
`kda_checkpoint_dtype`): chunking, prefix hits, L2 and preemption change no token against the
same engine without any of them; the logits stay near the default cache's; a restored bf16
checkpoint continues close to the fp32 state."""

import pytest
import torch

from tokenspeed.cache import CacheConfig, LocalHostCache
from tokenspeed.cache.errors import CacheConfigError
from tokenspeed.model import DecoderState, ForwardBatch, PagedKda, PagedMla, PagedState
from tokenspeed.model.ops.mla import quantize_rows_e4m3
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.config import EngineConfigError

from .conftest import tokens
from .test_engine import run, small_engine

NARROW = dict(kv_cache_dtype="fp8_e4m3", kda_checkpoint_dtype="bfloat16")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Measured on the steady tiny model (fp32, CPU; logits' std ~1.0): a 96-token prefill over an
# FP8 cache against the default (fp32) cache: |logit diff| max 0.0985, mean 0.0063 over all 96
# rows. A bf16 checkpoint (conv window and recurrent state rounded) restored after 64 tokens:
# |logit diff| max 0.062, mean 0.004 over the next 32 tokens. The bounds leave ~1.5x headroom.
FP8_LOGIT_TOLERANCE = 0.15
FP8_MEAN_TOLERANCE = 0.01
BF16_CHECKPOINT_LOGIT_TOLERANCE = 0.1
BF16_CHECKPOINT_MEAN_TOLERANCE = 0.008


def engine(model, **options):
    """test_engine's small engine with the narrow cache dtypes (`options` override)."""
    return small_engine(model, **{**NARROW, **options})


def alone(model, prompt, params=GREEDY):
    """The same FP8 engine without chunking or cache reuse: a fresh engine, one prefill."""
    e = engine(model, prefill_token_budget=512, l2="none")
    out = run(e, [("r", prompt, params)])["r"]
    e.close()
    return out.token_ids


def test_chunked_prefill_matches_one_prefill(steady):
    prompts = [tokens(n, seed=n) for n in (37, 5, 120, 16, 64)]
    e = engine(steady, prefill_token_budget=16)
    done = run(e, [(i, p, GREEDY) for i, p in enumerate(prompts)])
    assert e.cache.storage.mla.dtype == torch.float8_e4m3fn
    assert e.cache.storage.ckpt_recurrent.dtype == torch.bfloat16
    for i, p in enumerate(prompts):
        assert done[i].token_ids == alone(steady, p), i


def test_prefix_hits_match_no_reuse(steady):
    e = engine(steady)
    first = tokens(70, seed=1)
    out1 = run(e, [("t1", first, GREEDY)])["t1"]
    second = first + out1.token_ids + tokens(9, seed=2)
    out2 = run(e, [("t2", second, GREEDY)])["t2"]
    assert out2.metrics.cached_tokens >= 64  # restored a bf16 checkpoint and FP8 pages
    assert out1.token_ids == alone(steady, first)
    assert out2.token_ids == alone(steady, second)


def test_l2_round_trip_matches_no_reuse(steady):
    geometry = cache_geometry(steady, 16, **EngineConfig(**NARROW).cache_dtypes)
    budget = CacheConfig.budget_for(geometry, pages=9, live_requests=4, checkpoints=3)
    e = engine(steady, max_model_len=9 * 16, cache_budget_bytes=budget, checkpoint_slots=3)
    sessions = {s: tokens(30 + 7 * s, seed=200 + s) for s in range(3)}
    for turn in range(3):
        for s, history in sessions.items():
            out = run(e, [(f"s{s}t{turn}", history, GREEDY)])[f"s{s}t{turn}"]
            assert out.token_ids == alone(steady, history), (s, turn)
            sessions[s] = history + out.token_ids + tokens(5, seed=300 + 10 * s + turn)
    assert e.metrics.hit_rate > 0.4  # hits that could only come from L2


def test_forced_preemption_matches_no_reuse(steady):
    geometry = cache_geometry(steady, 16, **EngineConfig(**NARROW).cache_dtypes)
    budget = CacheConfig.budget_for(geometry, pages=14, live_requests=4, checkpoints=16)
    e = engine(
        steady,
        max_model_len=14 * 16,
        cache_budget_bytes=budget,
        checkpoint_slots=16,
        max_preemptions=50,
    )
    prompts = [tokens(n, seed=100 + n) for n in (50, 40, 45, 30)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    done = run(e, [(i, p, params) for i, p in enumerate(prompts)])
    assert sum(o.metrics.preemptions for o in done.values()) > 0
    for i, p in enumerate(prompts):
        assert done[i].token_ids == alone(steady, p, params), i


@pytest.mark.parametrize(
    "other", [dict(kv_cache_dtype="fp8_e4m3"), dict(kda_checkpoint_dtype="bfloat16")]
)
def test_an_engine_never_reads_l2_objects_of_another_cache_dtype(steady, other):
    l2 = LocalHostCache(capacity_bytes=1 << 24)
    base = dict(page_size=16, max_num_seqs=4, max_model_len=400, prefill_token_budget=48)
    writer = Engine(steady, None, EngineConfig(**base), l2=l2)
    run(writer, [("w", tokens(70, seed=1), GREEDY)])
    assert l2.geometry is not None
    with pytest.raises(CacheConfigError, match="geometry differs"):
        Engine(steady, None, EngineConfig(**base, **other), l2=l2)
    writer.close()
    l2.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_cache_dtype", "fp8"),
        ("kv_cache_dtype", "bfloat16"),
        ("kv_cache_dtype", None),
        ("kda_checkpoint_dtype", "bf16"),
        ("kda_checkpoint_dtype", torch.bfloat16),
        ("kda_checkpoint_dtype", "float16"),
    ],
)
def test_bad_cache_dtypes_are_refused(field, value):
    with pytest.raises(EngineConfigError, match=field):
        EngineConfig(**{field: value})


def _prefill_logits(model, prompt, fp8: bool) -> torch.Tensor:
    """Logits of one paged prefill of `prompt` over an FP8 or a model-dtype page pool."""
    cfg, page = model.config, 16
    pages = -(-len(prompt) // page) + 1
    table = torch.arange(1, pages, dtype=torch.long)[None]
    mla = {}
    for layer in cfg.mla_layers:
        pool = torch.zeros(pages, page, cfg.mla.latent_width)
        if fp8:
            q, s = quantize_rows_e4m3(pool)
            mla[layer] = PagedMla(q, table, s)
        else:
            mla[layer] = PagedMla(pool, table)
    slots = torch.tensor([1])
    kda = {
        layer: PagedKda(
            torch.zeros(2, cfg.kda.conv_channels, cfg.kda.conv_kernel - 1),
            torch.zeros(2, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim),
            slots,
        )
        for layer in cfg.kda_layers
    }
    batch = ForwardBatch.build([len(prompt)], [0])
    with torch.no_grad():
        return model(torch.tensor(prompt), batch, PagedState(kda=kda, mla=mla)).logits


def test_fp8_logits_stay_near_the_default_cache(steady):
    prompt = tokens(96, seed=7)
    want, got = _prefill_logits(steady, prompt, False), _prefill_logits(steady, prompt, True)
    diff = (got - want).abs().max().item()
    mean = (got - want).abs().mean().item()
    print(f"FP8 cache: |logit diff| max {diff:.4g} mean {mean:.4g} (logit std {want.std():.3g})")
    assert 0 < diff <= FP8_LOGIT_TOLERANCE and mean <= FP8_MEAN_TOLERANCE
    assert torch.equal(got.argmax(-1)[-8:], want.argmax(-1)[-8:])


def test_a_restored_bf16_checkpoint_continues_close_to_the_fp32_state(steady):
    """A restore converts the bf16 checkpoint up: the state continues from the rounded copy.
    Against the exact state over the next 32 tokens, the logits stay within the bound."""
    seq = tokens(96, seed=11)
    state = DecoderState.empty(steady.config)
    with torch.no_grad():
        out = steady(torch.tensor(seq[:64]), ForwardBatch.build([64], [0]), state)
        exact = out.state
        rounded = exact.clone()
        for s in rounded.kda.values():
            s.recurrent.copy_(s.recurrent.to(torch.bfloat16).float())
            s.conv.copy_(s.conv.to(torch.bfloat16).to(s.conv.dtype))
        rest = torch.tensor(seq[64:])
        want = steady(rest, ForwardBatch.build([32], [64]), exact).logits
        got = steady(rest, ForwardBatch.build([32], [64]), rounded).logits
    diff = (got - want).abs().max().item()
    mean = (got - want).abs().mean().item()
    print(f"bf16 checkpoint: |logit diff| over 32 tokens max {diff:.4g} mean {mean:.4g}")
    assert 0 < diff <= BF16_CHECKPOINT_LOGIT_TOLERANCE
    assert mean <= BF16_CHECKPOINT_MEAN_TOLERANCE
