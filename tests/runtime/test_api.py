"""The offline API and the asyncio engine, including the user guide's examples."""

import asyncio
import itertools
import random
import re
import time
from pathlib import Path

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.runtime import Engine, EngineConfig, RequestError, SamplingError, StepError
from tokenspeed.runtime.async_engine import AsyncEngine

from .conftest import reference, tokens

GUIDE = Path(__file__).parents[2] / "docs" / "guide.md"


def guide_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_generate_returns_one_output_per_prompt_in_order():
    # fp32: the engine's batched kernels and the reference agree to the token on a GPU too
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=4, max_model_len=256, page_size=16)
    prompts = ["Hello", {"prompt_token_ids": [5, 6, 7, 8]}, "A longer prompt about agents"]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt for o in outs] == ["Hello", None, "A longer prompt about agents"]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    model = llm.engine.model
    for out in outs:
        assert out.finished and len(out.token_ids) == 6
        assert out.token_ids == reference(model, out.prompt_token_ids, 6)
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_generate_waits_for_its_own_requests_not_others_on_the_engine():
    """A request added to `llm.engine` directly that finishes first is not taken for one of
    generate()'s: generate returns its own outputs, in order, and the other request still runs
    to its end."""
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=4, max_model_len=256, page_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.engine.add_request("direct", [9, 10, 11], SamplingParams(max_tokens=1, ignore_eos=True))
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)
    assert len(outs) == 1 and outs[0].request_id != "direct"
    assert outs[0].token_ids == reference(llm.engine.model, [5, 6, 7], 8)
    assert not llm.engine.has_unfinished()


def test_a_failed_generate_aborts_its_own_requests_and_leaves_others_running():
    """The cleanup after a refused prompt reports this call's aborts; it does not run a request
    added to the engine directly to its end (whose outputs nobody would then receive)."""
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=4, max_model_len=256, page_size=16)
    engine = llm.engine
    engine.add_request("direct", [9, 10, 11], SamplingParams(max_tokens=40, ignore_eos=True))
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 10**6]}]
    with pytest.raises(RequestError, match="prompt 1"):
        llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert engine.num_unfinished == 1  # "direct", and nothing of the failed call
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(outs) == {"direct"} and len(outs["direct"].token_ids) == 40


def test_a_failed_step_ends_generate_and_leaves_the_engine_clean():
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=2, max_model_len=256, page_size=16)
    engine = llm.engine
    idle = engine.cache.available_pages
    real, calls = engine.runner.decode, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third decode step: two requests mid-way, one waiting
            raise RuntimeError("injected: device error")
        return real(*args, **kwargs)

    engine.runner.decode = failing
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], [9, 10, 11], [12, 13])]
    with pytest.raises(StepError, match="injected") as failed:
        llm.generate(prompts, params, use_tqdm=False)
    assert len(failed.value.aborted) == 2 and isinstance(failed.value.__cause__, RuntimeError)
    # Nothing of the failed call keeps running, holds cache or waits to be reported.
    assert not engine.has_unfinished() and engine.cache.available_pages == idle
    engine.check_integrity()
    outs = llm.generate(prompts, params, use_tqdm=False)  # the device works again
    for out in outs:
        assert out.token_ids == reference(engine.model, out.prompt_token_ids, 8)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    # fp32: the engine's batched kernels and the reference agree to the token on a GPU too
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=4, max_model_len=256, page_size=16)
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["abc"], seeded, use_tqdm=False)[0].token_ids
    mixed = llm.generate(["xyz", "abc", "q"], [other, seeded, other], use_tqdm=False)
    assert mixed[1].token_ids == alone


def test_temperatures_too_small_to_divide_by_sample_greedily():
    """Logits divided by 1e-40 overflow fp32 into NaN probabilities, which failed the step and
    every request batched with it; below 1e-5 a request samples greedily instead."""
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=2, max_model_len=64, page_size=16)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    tiny = SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True)
    greedy = tiny.evolve(temperature=0)
    assert tiny.greedy and not SamplingParams(temperature=1e-4).greedy
    got = llm.generate(prompts, [tiny, SamplingParams(max_tokens=4, seed=1)], use_tqdm=False)
    want = llm.generate(prompts[:1], greedy, use_tqdm=False)
    assert got[0].token_ids == want[0].token_ids and len(got[1].token_ids) == 4


def test_stop_token_ids_and_strings():
    llm = LLM(model="tiny", dtype="float32", max_num_seqs=2, max_model_len=256, page_size=16)
    base = llm.generate(
        ["stop test"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    third = base.token_ids[2]
    out = llm.generate(
        ["stop test"],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[third], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.token_ids == base.token_ids[:3]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == third
    text = llm.tokenizer.decode(base.token_ids)
    stop = text[3:5] if len(text) >= 5 else None
    if stop:
        out = llm.generate(
            ["stop test"],
            SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert out.outputs[0].finish_reason == "stop" and stop not in out.text


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_random_stop_strings_end_and_cut_the_output_where_they_first_appear(decode_steps):
    """Each of several batched prompts stops at a random 1-3 character piece of its own greedy
    text: the output ends with the token that completed the first occurrence, and the text is
    cut before it. Runs of 8 decode steps end rows mid-run."""
    rng = random.Random(decode_steps)
    llm = LLM(
        model="tiny",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        page_size=16,
        decode_steps=decode_steps,
    )
    prompts = [f"prompt {i}: " + "xyz"[: i % 4] for i in range(6)]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    bases = [o.token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    decode = llm.tokenizer.decode
    params, expected = [], []
    for ids in bases:
        text = decode(ids)
        assert text, "a base output with no byte tokens: pick other prompts"
        at = rng.randrange(max(1, len(text) - 3))
        stop = text[at : at + rng.randint(1, 3)]
        k = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
        done = decode(ids[:k])
        expected.append((ids[:k], done[: done.find(stop)], stop))
        params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (ids, text, stop) in zip(outs, expected, strict=True):
        assert out.token_ids == ids, stop
        assert out.text == text
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_bad_input_fails_before_any_work():
    with pytest.raises(ValueError, match="neither a preset"):
        LLM(model="no-such-model")
    llm = LLM(model="tiny", max_num_seqs=2, max_model_len=64, page_size=16)
    with pytest.raises(RequestError, match="at least one prompt"):
        llm.generate([])
    with pytest.raises(RequestError, match="max_model_len=64"):
        llm.generate(["ok", {"prompt_token_ids": [5] * 64}])
    assert llm.engine.num_unfinished == 0  # the valid first prompt was not queued either
    for temperature in (-1, float("inf"), float("nan"), 10**400, True, "1"):
        with pytest.raises(SamplingError, match="temperature"):
            SamplingParams(temperature=temperature)
    for top_k in (1 << 63, -(1 << 63) - 1, 2.0):
        with pytest.raises(SamplingError, match="top_k"):
            SamplingParams(top_k=top_k)
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for seed in (1 << 64, -(1 << 63) - 1, 1.5):
        with pytest.raises(SamplingError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(seed=(1 << 64) - 1)
    SamplingParams(seed=-(1 << 63))
    with pytest.raises(RequestError, match="a string or"):
        llm.generate([42])
    # Refused by the engine itself, after the first prompt was queued: that one goes too.
    for bad in ([1.5, 2], [999]):
        with pytest.raises(RequestError, match="^prompt 1: "):  # its place, not our own id
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": bad}], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    with pytest.raises(RequestError, match="logprobs"):
        llm.generate(["ok", "ok"], [SamplingParams(), SamplingParams(logprobs=10**6)])
    assert not llm.engine.has_unfinished()
    out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=3))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_async_engine_streams_and_aborts(tiny, decode_steps):
    async def main():
        engine = AsyncEngine(
            Engine(
                tiny,
                None,
                EngineConfig(
                    max_num_seqs=4,
                    max_model_len=256,
                    page_size=16,
                    decode_steps=decode_steps,
                ),
            )
        )
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        seen = []

        async def consume(rid, prompt):
            async for out in engine.generate(rid, prompt, greedy):
                seen.append((rid, len(out.token_ids)))
            return out

        async def abandon(rid, prompt):
            async for _ in engine.generate(rid, prompt, SamplingParams(max_tokens=50)):
                break  # the client went away

        a, b = tokens(20, seed=1), tokens(9, seed=2)
        outs = await asyncio.gather(consume("a", a), consume("b", b), abandon("c", tokens(5, 3)))
        await engine.wait_idle()
        engine.engine.check_integrity()
        return outs, seen, engine

    (out_a, out_b, _), seen, engine = asyncio.run(main())
    assert out_a.token_ids == reference(tiny, tokens(20, seed=1), 6)
    assert out_b.token_ids == reference(tiny, tokens(9, seed=2), 6)
    streamed = [n for rid, n in seen if rid == "a"]
    if decode_steps == 1:
        assert streamed == [1, 2, 3, 4, 5, 6]  # streamed per token
    else:  # in bursts of up to 3 once prefills are done
        assert streamed[-1] == 6 and len(streamed) < 6
        assert all(0 < b - a <= 3 for a, b in itertools.pairwise(streamed))
    assert not engine.engine.has_unfinished()  # "c" was aborted when its consumer left


def test_async_engine_steps_off_the_event_loop(tiny):
    """With `step_thread`, the event loop keeps running other tasks (a server's I/O) while a step
    computes, and a request added or abandoned meanwhile waits for the step's end, never
    overlapping it."""

    async def main():
        engine = Engine(tiny, None, EngineConfig(max_num_seqs=4, max_model_len=256, page_size=16))
        # Warm up first: one-time set-up in the first steps (loading compiled loops, say) holds
        # the GIL for a while, which no thread can help.
        engine.add_request("warm-up", tokens(30, seed=30), SamplingParams(max_tokens=3))
        while engine.has_unfinished():
            engine.step()
        real_step, in_step, overlaps = engine.step, [0], []

        def slow_step():
            in_step[0] += 1
            time.sleep(0.2)  # a step that takes a while (the GIL is free meanwhile)
            try:
                return real_step()
            finally:
                in_step[0] -= 1

        for name in ("add_request", "abort"):
            real = getattr(engine, name)

            def guarded(*args, _real=real, **kwargs):
                overlaps.append(in_step[0])
                return _real(*args, **kwargs)

            setattr(engine, name, guarded)
        engine.step = slow_step
        server = AsyncEngine(engine, step_thread=True)
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.001)

        async def consume(rid, n):
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            return [out async for out in server.generate(rid, tokens(n, seed=n), params)][-1]

        async def abandon(rid):
            async for _ in server.generate(rid, tokens(7, seed=7), SamplingParams(max_tokens=50)):
                break

        tick = asyncio.ensure_future(ticker())
        first = asyncio.ensure_future(consume("a", 20))
        await asyncio.sleep(0.05)  # the first step is running now
        outs = await asyncio.gather(first, consume("b", 9), abandon("c"))
        await server.wait_idle()
        tick.cancel()
        return outs, ticks, overlaps, engine

    (out_a, out_b, _), ticks, overlaps, engine = asyncio.run(main())
    assert out_a.token_ids == reference(tiny, tokens(20, seed=20), 4)
    assert out_b.token_ids == reference(tiny, tokens(9, seed=9), 4)
    # Steps of 200 ms and more, yet the ticker never waited half as long.
    assert max(b - a for a, b in itertools.pairwise(ticks)) < 0.1
    assert overlaps and not any(overlaps)  # every add and abort ran between steps
    assert not engine.has_unfinished() and engine.cache.get("c") is None


@pytest.mark.parametrize("index", range(len(guide_examples())))
def test_user_guide_examples_run(index, capsys):
    code = guide_examples()[index]
    exec(compile(code, str(GUIDE), "exec"), {"__name__": "guide"})
    printed = capsys.readouterr().out
    assert printed.strip()


README = Path(__file__).parents[2] / "README.md"


@pytest.mark.parametrize("index", range(2))
def test_readme_examples_run(index):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[index]
    namespace = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), namespace)
    assert "outs" in namespace or "out" in namespace
