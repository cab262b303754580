"""On a GPU: P/D handoff between two engines gives the tokens of one aggregated engine (the
transport the engines pick there: Mooncake with GPU support, else sockets)."""

import pytest

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.llm import _keep_fp32
from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine

from ..conftest import tokens
from .common import no_request_holds_cache, run_engine, run_pd

pytestmark = pytest.mark.gpu

CONFIG = EngineConfig(
    device="cuda",
    page_size=16,
    max_num_seqs=8,
    max_model_len=512,
    prefill_token_budget=128,
)


def test_pd_on_a_gpu_gives_the_aggregated_tokens():
    # fp32: the two sides chunk prefills differently from one aggregated engine (whose budget
    # decode rows share), which half precision would round differently.
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=21).to("cuda")
    _keep_fp32(model)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(f"r{n}", tokens(n, seed=n), greedy) for n in (5, 40, 77, 130, 16)]
    agg = run_engine(Engine(model, None, CONFIG), requests)
    p, d = PrefillEngine(model, None, CONFIG), DecodeEngine(model, None, CONFIG)
    try:
        assert d.runner.graphs is not None and d.runner.graphs.captured
        done, _ = run_pd(p, d, requests, admit_early=True)
        for rid, _, _ in requests:
            assert done[rid].token_ids == agg[rid].token_ids, rid
        no_request_holds_cache(p)
        no_request_holds_cache(d)
    finally:
        p.close()
        d.close()
