"""On a GPU: captured decode graphs give the same tokens as eager steps, and failing steps under
graphs cost only their batch."""

import gc
import weakref

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.graphs import DecodeGraphs
from tokenspeed.runtime.llm import _keep_fp32

from .conftest import tokens

pytestmark = pytest.mark.gpu


def gpu_engine(model, graphs: bool, decode_steps: int = 1, **options) -> Engine:
    """Up to eight sequences of 512 tokens, prefill chunks of 128 tokens (`options`: other
    `EngineConfig` fields; the FP8 and speculative GPU tests use it too)."""
    return Engine(
        model,
        None,
        EngineConfig(
            device="cuda",
            page_size=16,
            max_num_seqs=8,
            max_model_len=512,
            prefill_token_budget=128,
            enable_cuda_graph=graphs,
            decode_steps=decode_steps,
            **options,
        ),
    )


def _generate(model, graphs: bool, decode_steps: int = 1, stops=None):
    """Greedy outputs of six mixed-length prompts; stops: per prompt, stop token ids."""
    engine = gpu_engine(model, graphs, decode_steps)
    assert engine.runner.graphs.captured == graphs
    prompts = [tokens(n, seed=n) for n in (5, 40, 77, 130, 16, 9)]
    for i, p in enumerate(prompts):
        stop = (stops or {}).get(i, [])
        engine.add_request(
            i,
            p,
            SamplingParams(
                temperature=0,
                max_tokens=24,
                ignore_eos=True,
                stop_token_ids=stop,
            ),
        )
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


def test_no_garbage_collection_runs_inside_a_graph_capture(monkeypatch):
    """A collection during capture runs the finalizers of whatever it frees, such as a dropped
    engine's copy stream synchronising, which a capturing stream refuses: the capture failed
    (seen when tests built engines one after another). Here every forward under capture leaves
    such garbage behind, and collections run at every allocation."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to("cuda")
    _keep_fp32(model)
    stream, real = torch.cuda.Stream(), DecodeGraphs._forward

    class Junk:
        pass

    def forward(self, size):
        if torch.cuda.is_current_stream_capturing():
            junk = Junk()
            junk.cycle = junk  # only the cyclic collector frees it
            weakref.finalize(junk, stream.synchronize)
        return real(self, size)

    monkeypatch.setattr(DecodeGraphs, "_forward", forward)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        engine = Engine(
            model,
            None,
            EngineConfig(device="cuda", page_size=16, max_num_seqs=4, max_model_len=128),
        )
    finally:
        gc.set_threshold(*thresholds)
    assert engine.runner.graphs.captured
    gc.collect()  # the junk goes now, outside any capture


def test_multi_step_decoding_gives_the_single_step_tokens():
    """decode_steps=5 (graphs replayed back to back, each fed the previous step's samples on the
    device) against one step at a time, with stop tokens that end rows inside a run."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to(
        "cuda", torch.bfloat16
    )
    _keep_fp32(model)
    single = _generate(model, graphs=True)
    stops = {
        i: [out[k]]
        for i, k in ((0, 7), (2, 11), (3, 18))
        for out in [single[i]]
        if out[k] not in out[:k]
    }
    assert stops  # at least one row stops early
    single = _generate(model, graphs=True, stops=stops)
    multi = _generate(model, graphs=True, decode_steps=5, stops=stops)
    assert multi == single
    for i, (stop,) in stops.items():
        assert multi[i][-1] == stop and len(multi[i]) < 24


@pytest.mark.parametrize("decode_steps", [1, 5])
def test_failing_steps_under_graphs_cost_only_their_batch(decode_steps):
    """Forward passes, state copies and the device work of admissions fail at random while
    captured graphs run (single and multi-step): every request ends exactly once, the failed
    ones aborted with the error, the cache checks out after every step and is whole when the
    engine is idle, and the engine goes on serving with its graphs."""
    import random

    from tokenspeed.runtime import StepError

    from .scenarios import ADMISSION_CALLS, STATE_COPY_CALLS, STEP_CALLS, inject_failures

    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).to(
        "cuda", torch.float32
    )
    engine = gpu_engine(model, graphs=True, decode_steps=decode_steps)
    idle = engine.cache.available_pages
    injected = inject_failures(engine, random.Random(decode_steps), 0.1)
    prompts = [tokens(n, seed=n) for n in (5, 40, 77, 130, 16, 9, 50, 33)]
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done, failed, admissions = {}, set(), set()
    while engine.has_unfinished():
        try:
            outputs = engine.step()
        except StepError as err:
            assert err.aborted
            failed.update(err.aborted)
            outputs = []
        for out in outputs:
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
                if (out.abort_reason or "").startswith("admission failed"):
                    admissions.add(out.request_id)
        engine.check_integrity()
    assert injected["failures"] > 0 and failed
    assert set(done) == set(range(len(prompts)))
    for i, out in done.items():
        if i in failed:
            assert out.outputs[0].finish_reason == "abort" and "step failed" in out.abort_reason
        elif i in admissions:
            assert out.outputs[0].finish_reason == "abort" and out.token_ids == []
        else:
            assert len(out.token_ids) == 24
    assert engine.cache.available_pages == idle
    # The same engine, failures off, serves a request to its end with its graphs.
    for name in STEP_CALLS:
        del vars(engine.runner)[name]  # the runner's own methods again
    for name in STATE_COPY_CALLS:
        del vars(engine.port)[name]
    for name in ADMISSION_CALLS:
        del vars(engine.cache.storage)[name]
    engine.add_request(
        "after", prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    while engine.has_unfinished():
        outputs = engine.step()
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 24
    assert engine.cache.available_pages == idle
    engine.check_integrity()
