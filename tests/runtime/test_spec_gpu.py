"""On a GPU: speculative verify steps captured in `VerifyGraphs` give the tokens of the same
padded steps run eagerly, and (fp32) the plain engine's greedy tokens; with an EAGLE3 drafter
too. Padded windows and padded rows are exercised by requests that end one after another."""

import tempfile

import attrs
import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.llm import _keep_fp32
from tokenspeed.runtime.spec import SpeculativeConfig

from .conftest import tokens
from .spec.helpers import drafter_config, write_drafter
from .test_engine_gpu import gpu_engine
from .test_spec_engine import Oracle

pytestmark = pytest.mark.gpu

PROMPTS = {i: tokens(n, seed=n) for i, n in enumerate((5, 40, 77, 130, 16, 9))}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _model(dtype):
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to("cuda", dtype)
    _keep_fp32(model)
    return model


def _generate(model, graphs: bool, spec=None, proposer=None):
    """Greedy outputs of PROMPTS (request i stops after 14 + 2 i tokens, so batches shrink
    step by step) and the engine, checked after every step."""
    engine = gpu_engine(model, graphs, speculative=spec)
    if proposer is not None:
        engine.proposer = proposer
    for i, prompt in PROMPTS.items():
        engine.add_request(i, prompt, attrs.evolve(GREEDY, max_tokens=14 + 2 * i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return done, engine


def _verify_graph_steps(engine) -> list[int]:
    """Count the steps `engine`'s verify graphs run from now on (list of batch sizes)."""
    graphs = engine.runner.verify_graphs
    sizes, real = [], graphs.run

    def counted(tokens, prefix_lens, handles):
        sizes.append(len(tokens))
        return real(tokens, prefix_lens, handles)

    graphs.run = counted
    return sizes


def test_verify_graphs_give_the_eager_and_the_plain_tokens_fp32():
    model = _model(torch.float32)
    plain, _ = _generate(model, graphs=True)
    for wrong in (False, True):
        spec = SpeculativeConfig(num_steps=3)
        runs = {}
        for graphs in (False, True):
            oracle = Oracle(PROMPTS, plain, wrong=wrong)
            runs[graphs], engine = _generate(model, graphs, spec, oracle)
            assert engine.runner.verify_graphs.captured == graphs
            assert engine.metrics.spec_verify_rows > 0
            mean = engine.metrics.mean_acceptance_length
            assert mean == 1.0 if wrong else mean > 2.5
            engine.close()
        assert runs[True] == runs[False] == plain


def test_verify_graph_replays_equal_eager_in_bf16_at_forced_acceptance():
    """bf16 (verify and decode round differently, so only graph == eager is exact) at forced
    acceptance 2 (BENCHMARK ONLY: outputs are not the model's, but both modes must agree)."""
    model = _model(torch.bfloat16)
    spec = SpeculativeConfig(num_steps=3, forced_acceptance=2)
    eager, _ = _generate(model, False, spec)
    graph, engine = _generate(model, True, spec)
    assert graph == eager
    assert engine.metrics.mean_acceptance_length > 2.5
    engine.close()


def test_eagle3_verify_graphs_fp32():
    model = _model(torch.float32)
    plain, _ = _generate(model, graphs=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-") as root:
        path = write_drafter(f"{root}/drafter", drafter_config(), model.model.embed_tokens)
        spec = SpeculativeConfig(method="eagle3", draft_model=path, num_steps=3)
        eager, _ = _generate(model, False, spec)
        graph, engine = _generate(model, True, spec)
    assert graph == eager == plain
    assert engine.runner.verify_graphs.captured and engine.metrics.spec_verify_rows > 0
    engine.close()


def test_a_replay_runs_each_verify_step():
    model = _model(torch.float32)
    plain, _ = _generate(model, graphs=True)
    spec = SpeculativeConfig(num_steps=2)
    config = EngineConfig(
        device="cuda", page_size=16, max_num_seqs=8, max_model_len=512, speculative=spec
    )
    engine = Engine(model, None, config)
    engine.proposer = Oracle(PROMPTS, plain)
    steps = _verify_graph_steps(engine)
    for i, prompt in PROMPTS.items():
        engine.add_request(i, prompt, attrs.evolve(GREEDY, max_tokens=14 + 2 * i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done == plain
    assert steps and len(set(steps)) > 1  # shrinking batches: several graph sizes
    engine.close()
