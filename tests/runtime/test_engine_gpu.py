"""On a GPU: captured decode graphs give the same tokens as eager steps."""

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.llm import _keep_fp32

from .conftest import tokens

pytestmark = pytest.mark.gpu


def _generate(model, graphs: bool):
    engine = Engine(model, None, EngineConfig(
        device="cuda", page_size=16, max_num_seqs=8, max_model_len=512,
        prefill_token_budget=128, enable_cuda_graph=graphs,
    ))
    assert engine.runner.graphs.captured == graphs
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [tokens(n, seed=n) for n in (5, 40, 77, 130, 16, 9)]
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return [done[i] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_and_eager_give_identical_greedy_tokens(dtype):
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to("cuda", dtype)
    _keep_fp32(model)
    eager = _generate(model, graphs=False)
    graph = _generate(model, graphs=True)
    assert graph == eager
