"""On a GPU: the engine with an FP8 MLA cache (`kv_cache_dtype="fp8_e4m3"`: e4m3 rows with one
fp32 scale per row, read by the e4m3 MLA kernels in bf16) and bf16 KDA checkpoints
(`kda_checkpoint_dtype="bfloat16"`).

- CUDA graphs (single and multi-step) and eager steps give identical greedy tokens over an FP8
  cache, as they do over the default cache (tests/runtime/test_engine_gpu.py).
- Against a bf16 cache on the same bf16 model and prompts: greedy tokens agree except at
  near-ties, and on most prompts over the first AGREEMENT_TOKENS tokens.
- Within FP8: a prefix-hit turn and forced preemption give the tokens of a fresh FP8 engine.
- bf16 KDA checkpoints serve prefix hits (from the device tier and from L2) on CUDA with the
  cache's integrity checked after every step.

"Identical" here is to floating-point rounding (docs/guide.md): two computations of the same
tokens that differ only in how they are batched or chunked change the last bits of the
activations, and where the two best logits are that close the greedy pick can flip, and the
continuation with it. So comparisons use `check_same_up_to_a_near_tie`: the tokens are equal,
or at the first position where they differ (both runs having seen the same tokens so far) each
run's pick is within a bound of the other run's best under the other run's logits; and before
that position the chosen tokens' logprobs stay within a second bound (`Tol`). A wrong kernel,
scale or page moves logits by far more than these bounds.

The model: `tiny` (tests/runtime/conftest.py) with the routers' correction bias set as in the
`steady` fixture, so that no two experts ever tie (a random router's near-ties flip experts
under bf16 rounding and move logits by far more than the cache does: the kernel-path tests
saw cosine 0.93 for that reason). Built here, on CUDA, not from the session fixture: an engine
on a GPU would move the shared CPU model there.
"""

from typing import NamedTuple

import pytest
import torch

from tokenspeed.cache import CacheConfig
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.cache_sizing import cache_geometry
from tokenspeed.runtime.llm import _keep_fp32

from .conftest import steady_model, tokens
from .test_engine import run, small_engine
from .test_engine_gpu import gpu_engine

pytestmark = pytest.mark.gpu

FP8_DTYPE = torch.float8_e4m3fn
FP8 = dict(kv_cache_dtype="fp8_e4m3")
NARROW = dict(kv_cache_dtype="fp8_e4m3", kda_checkpoint_dtype="bfloat16")


class Tol(NamedTuple):
    """Bounds of a comparison, in logprob units: `tie`, how close the two runs' picks must be
    under each run's own logits where the tokens first differ; `drift`, how far the chosen
    tokens' logprobs may move before that."""

    tie: float
    drift: float


# fp32 model (the dequantising torch paths): rounding noise ~1e-7 relative rarely flips the e4m3
# rounding of a row element; token identity but for a tie. Measured 0 drift, no difference.
FP32_TOL = Tol(tie=0.02, drift=0.02)
# bf16 model (the e4m3 MLA kernels) for every comparison here: FP8 vs bf16 cache, reuse within
# FP8 (prefix hits, chunking, preemption vs a fresh engine: bf16 rounding noise of rows computed
# in other batch shapes flips the e4m3 rounding of a few % of their elements, a perturbation of
# the order of the FP8 rounding itself), a restored bf16 KDA checkpoint vs the exact state.
# Measured with the CPU's bf16 torch references (these tests with device "cpu"; logits rounded
# to bf16 move in steps of 2^-6 = 0.016 near |3|): margins where tokens first differed 0 to
# 0.125 (three-way near-ties among them), chosen-token drift up to 0.32 (one preempted request;
# at most 0.15 elsewhere). The tiny model's logits are flat (best logprob ~-3.8 of 512 tokens),
# so near-ties are common; a wrong kernel, scale or page moves logits by O(1).
BF16_TOL = Tol(tie=0.25, drift=0.75)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}
# Candidates per position the outputs carry (logprobs=TOP): a pick where two runs differ must be
# among the other run's best TOP tokens, within `tie` of its best.
TOP = 20
# The bf16 vs FP8 cache comparison: prompts that must agree on their first AGREEMENT_TOKENS
# greedy tokens: more than half (measured with the CPU's bf16 references: 11 of 12). A floor,
# not a property of the cache alone: one near-tie flips the rest of a continuation. Where it
# fails, the table printed shows whether every divergence was at a near-tie.
AGREEMENT_TOKENS = 8


def steady(dtype: torch.dtype) -> KimiForCausalLM:
    """`steady_model()` on CUDA in `dtype`."""
    model = steady_model().to("cuda", dtype)
    _keep_fp32(model)
    return model


def engine(model, **options) -> Engine:
    """An FP8-cache engine on CUDA (graphs on): test_engine's small engine; `options`
    override any `EngineConfig` field."""
    return small_engine(model, **{"device": "cuda", **FP8, **options})


def alone(model, prompt, params, **options):
    """The request in a fresh engine of the same cache dtypes, one prefill, no L2: its output."""
    e = engine(model, prefill_token_budget=512, l2="none", **options)
    out = run(e, [("r", prompt, params)])["r"]
    e.close()
    return out.outputs[0]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


def margin(top: list[tuple[int, float]]) -> float:
    """The top-2 logprob margin of one position (`top`: the best tokens, best first)."""
    return top[0][1] - top[1][1]


def first_difference(want: list[int], got: list[int]) -> int | None:
    return next((k for k, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)


def check_same_up_to_a_near_tie(want, got, tol: Tol, what: str) -> int | None:
    """want, got: `CompletionOutput`s of the same prompt (logprobs=TOP). Identical tokens, or at
    the first position k where they differ (the same tokens seen before): each run's pick is
    among the other's best TOP tokens and within tol.tie of that run's own best. Before k, the
    chosen tokens' logprobs differ by <= tol.drift. Returns k (None: identical)."""
    assert len(want.token_ids) == len(got.token_ids), what
    assert len(want.top_logprobs) == len(want.token_ids) == len(got.top_logprobs), what
    k = first_difference(want.token_ids, got.token_ids)
    same = len(want.token_ids) if k is None else k
    drift = [abs(a - b) for a, b in zip(want.logprobs[:same], got.logprobs[:same], strict=True)]
    assert max(drift, default=0.0) <= tol.drift, (
        f"{what}: chosen tokens' logprobs differ by up to {max(drift):.4g} > {tol.drift} over "
        f"the first {same} (identical) tokens"
    )
    if k is None:
        return None
    w_top, g_top = dict(want.top_logprobs[k]), dict(got.top_logprobs[k])
    w, g = want.token_ids[k], got.token_ids[k]
    detail = (
        f"{what}: tokens first differ at {k}: want {w}, got {g}; want's best "
        f"{want.top_logprobs[k][:4]}, got's best {got.top_logprobs[k][:4]}; bound {tol.tie}"
    )
    assert g in w_top and w in g_top, detail
    assert w_top[w] - w_top[g] <= tol.tie and g_top[g] - g_top[w] <= tol.tie, detail
    return k


# ------------------------------------------------------------------ (a) graphs vs eager


def generate(model, graphs: bool, decode_steps: int = 1) -> list[list[int]]:
    """Greedy outputs of six mixed-length prompts over an FP8 cache (test_engine_gpu's set)."""
    e = gpu_engine(model, graphs, decode_steps, **FP8)
    assert e.runner.graphs.captured == graphs
    assert e.cache.storage.mla.dtype == FP8_DTYPE and e.cache.storage.mla_scales is not None
    prompts = [tokens(n, seed=n) for n in (5, 40, 77, 130, 16, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    done = run(e, [(i, p, params) for i, p in enumerate(prompts)])
    e.close()
    return [done[i].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_graphs_and_eager_give_identical_greedy_tokens(dtype):
    """fp32 runs the dequantising torch paths, bf16 the e4m3 MLA kernels (decode and paged
    prefill with row scales)."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to("cuda", dtype)
    _keep_fp32(model)
    eager = generate(model, graphs=False)
    graph = generate(model, graphs=True)
    multi = generate(model, graphs=True, decode_steps=5)
    assert graph == eager
    assert multi == eager


# --------------------------------------------------------------- (b) against a bf16 cache


def test_fp8_cache_greedy_tokens_agree_with_the_bf16_cache():
    model = steady(torch.bfloat16)
    prompts = [tokens(n, seed=700 + n) for n in (5, 9, 16, 17, 31, 48, 64, 77, 100, 130, 200, 250)]
    params = greedy(16)

    def outputs(kv_cache_dtype):
        e = engine(
            model,
            max_num_seqs=len(prompts),
            max_model_len=512,
            prefill_token_budget=256,
            l2="none",
            kv_cache_dtype=kv_cache_dtype,
        )
        want = FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
        assert e.cache.storage.mla.dtype == want
        done = run(e, [(i, p, params) for i, p in enumerate(prompts)])
        e.close()
        return [done[i].outputs[0] for i in range(len(prompts))]

    ref, got = outputs("auto"), outputs("fp8_e4m3")
    print("prompt | tokens | first difference | ref first-token margin | |logprob diff| token 0")
    diverged = {}
    for i, (p, w, g) in enumerate(zip(prompts, ref, got, strict=True)):
        diverged[i] = check_same_up_to_a_near_tie(w, g, BF16_TOL, f"prompt {i} ({len(p)} tokens)")
        print(
            f"{i} | {len(p)} | {diverged[i]} | {margin(w.top_logprobs[0]):.4f} | "
            f"{abs(w.logprobs[0] - g.logprobs[0]):.4f}"
        )
    # The first generated token (the prefill's, over the FP8 rows that prefill wrote) agrees on
    # every prompt whose two best first tokens under the bf16 cache are more than BF16_TOL.tie
    # apart (also what the check above asserts at k = 0). Not asserted for every prompt: the
    # tiny model's logits are flat (best logprob ~-3.8 over 512 tokens) and rounded to bf16, so a
    # prompt's two best first tokens can tie within the FP8 cache's perturbation, or exactly
    # (with the CPU's bf16 references prompt 0's did: margin 0), and then either pick is a
    # correct greedy token of its own logits.
    for i, w in enumerate(ref):
        if margin(w.top_logprobs[0]) > BF16_TOL.tie:
            assert got[i].token_ids[0] == w.token_ids[0], i
    agreeing = sum(
        w.token_ids[:AGREEMENT_TOKENS] == g.token_ids[:AGREEMENT_TOKENS]
        for w, g in zip(ref, got, strict=True)
    )
    print(f"{agreeing}/{len(prompts)} prompts agree on their first {AGREEMENT_TOKENS} tokens")
    assert agreeing > len(prompts) / 2, diverged


# ----------------------------------------------------------- (b) reuse within FP8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_prefix_hit_turn_matches_a_fresh_fp8_engine(dtype):
    """Turn 2 extends turn 1's prompt and output: it restores a KDA checkpoint and attends to
    turn 1's FP8 pages (written by prefill chunks and decode steps); a fresh FP8 engine
    prefills the whole prompt at once."""
    model = steady(dtype)
    params = greedy(12)
    e = engine(model)
    first = tokens(70, seed=1)
    out1 = run(e, [("t1", first, params)])["t1"]
    second = first + out1.token_ids + tokens(9, seed=2)
    out2 = run(e, [("t2", second, params)])["t2"]
    assert e.cache.storage.mla.dtype == FP8_DTYPE
    assert out2.metrics.cached_tokens >= 64  # a checkpoint restored and FP8 pages reused
    e.close()
    tol = TOL[dtype]
    check_same_up_to_a_near_tie(alone(model, first, params), out1.outputs[0], tol, "turn 1")
    check_same_up_to_a_near_tie(alone(model, second, params), out2.outputs[0], tol, "turn 2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_forced_preemption_matches_a_fresh_fp8_engine(dtype):
    """A budget of 14 pages for four requests growing to 90 tokens: requests are preempted
    (their FP8 pages dropped or kept, their KDA state checkpointed) and resumed."""
    model = steady(dtype)
    geometry = cache_geometry(model, 16, **EngineConfig(**FP8).cache_dtypes)
    budget = CacheConfig.budget_for(geometry, pages=14, live_requests=4, checkpoints=16)
    e = engine(
        model,
        max_model_len=14 * 16,
        cache_budget_bytes=budget,
        checkpoint_slots=16,
        max_preemptions=50,
    )
    prompts = [tokens(n, seed=100 + n) for n in (50, 40, 45, 30)]
    params = greedy(40)
    done = run(e, [(i, p, params) for i, p in enumerate(prompts)])
    e.close()
    assert sum(o.metrics.preemptions for o in done.values()) > 0
    tol = TOL[dtype]
    for i, p in enumerate(prompts):
        check_same_up_to_a_near_tie(alone(model, p, params), done[i].outputs[0], tol, str(i))


# --------------------------------------------------------- (c) bf16 KDA checkpoints


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_bf16_checkpoints_serve_prefix_hits_on_cuda(kv_cache_dtype):
    """Three turns of one conversation: turns 2 and 3 restore bf16 checkpoints (converted up
    into the fp32 live state); `run` checks the cache's integrity after every step. Each turn
    continues close to a fresh engine's (which never restores: the exact state)."""
    model = steady(torch.bfloat16)
    options = dict(kv_cache_dtype=kv_cache_dtype, kda_checkpoint_dtype="bfloat16")
    params = greedy(12)
    e = engine(model, **options)
    storage = e.cache.storage
    assert storage.ckpt_recurrent.dtype == torch.bfloat16
    assert storage.ckpt_conv.dtype == torch.bfloat16
    assert storage.recurrent.dtype == torch.float32  # the live state stays fp32
    history = tokens(70, seed=11)
    for turn in range(3):
        out = run(e, [(f"t{turn}", history, params)])[f"t{turn}"]
        if turn:
            assert out.metrics.cached_tokens >= 64, turn
        want = alone(model, history, params, **options)
        check_same_up_to_a_near_tie(want, out.outputs[0], BF16_TOL, f"turn {turn}")
        history = history + out.token_ids + tokens(7, seed=20 + turn)
    e.check_integrity()
    e.close()


def test_narrow_cache_l2_round_trip_on_cuda():
    """FP8 pages and bf16 checkpoints evicted to the host tier (L2) and loaded back: three
    sessions over a device tier of 9 pages and 3 checkpoint slots, three turns each."""
    model = steady(torch.bfloat16)
    geometry = cache_geometry(model, 16, **EngineConfig(**NARROW).cache_dtypes)
    budget = CacheConfig.budget_for(geometry, pages=9, live_requests=4, checkpoints=3)
    e = engine(model, max_model_len=9 * 16, cache_budget_bytes=budget, checkpoint_slots=3, **NARROW)
    params = greedy(12)
    sessions = {s: tokens(30 + 7 * s, seed=200 + s) for s in range(3)}
    for turn in range(3):
        for s, history in sessions.items():
            rid = f"s{s}t{turn}"
            out = run(e, [(rid, history, params)])[rid]
            want = alone(model, history, params, **NARROW)
            check_same_up_to_a_near_tie(want, out.outputs[0], BF16_TOL, rid)
            sessions[s] = history + out.token_ids + tokens(5, seed=300 + 10 * s + turn)
    assert e.metrics.hit_rate > 0.4  # hits that could only come from L2
    e.check_integrity()
    e.close()
