"""`LLM`'s vLLM conventions: TextPrompt dicts, n completions, penalties and min_tokens through
the engine, get_tokenizer, and the progress bar."""

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.model.batch import ForwardBatch
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.state import DecoderState
from tokenspeed.runtime import RequestError
from tokenspeed.runtime.tokenizer import TokenizerError

from .conftest import reference


def _llm(**options) -> LLM:
    # fp32: the engine's batched kernels and the reference agree to the token on a GPU too
    options = {"max_num_seqs": 4, "max_model_len": 256, "page_size": 16, **options}
    return LLM(model="tiny", dtype="float32", **options)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def test_text_prompt_dicts_are_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain, as_dict = llm.generate(["Hello", {"prompt": "Hello"}], params, use_tqdm=False)
    assert as_dict.prompt == "Hello" and as_dict.prompt_token_ids == llm.tokenizer.encode("Hello")
    assert as_dict.token_ids == plain.token_ids
    (ids,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert ids.prompt is None and ids.token_ids == reference(llm.engine.model, [5, 6, 7], 5)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt_token_ids": None}, "prompt 1: prompt_token_ids must be a list of token ids"),
        ({"prompt_token_ids": [5, 1.5]}, "prompt 1: prompt_token_ids must be a list of token"),
        ({"prompt_token_ids": "abc"}, "prompt 1: prompt_token_ids must be a list of token ids"),
        ({"text": "hi"}, "prompt 1: unsupported keys \\['text'\\]"),
        ({}, "prompt 1: an empty dict"),
        ({"prompt": "hi", "prompt_token_ids": [5]}, "prompt 1: give either 'prompt'"),
        ({"prompt": "hi", "multi_modal_data": {}}, "prompt 1: unsupported keys"),
        ({"prompt": 5}, "prompt 1: 'prompt' must be a string, got int"),
        (None, "prompt 1: expected a string or a dict"),
    ],
)
def test_malformed_prompts_are_refused_naming_the_prompt(llm, bad, message):
    with pytest.raises(RequestError, match=message):
        llm.generate(["ok", bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()


@torch.no_grad()
def _penalized_reference(
    model, prompt, n, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
):
    """Greedy decoding of one request with the penalties written out token by token, through
    the model's own forward (as `greedy_generate` does)."""
    device = model.lm_head.weight.device
    batch = ForwardBatch.build([len(prompt)], device=device)
    tokens = torch.tensor(prompt, device=device)
    out = model(tokens, batch, model.empty_state(1), batch.last_token_indices)
    presence, frequency, repetition = presence_penalty, frequency_penalty, repetition_penalty
    output = []
    while True:
        logits = out.logits[0].float().clone()
        for t in range(logits.shape[0]):
            count = output.count(t)
            if count or t in prompt:
                value = logits[t]
                logits[t] = value / repetition if value > 0 else value * repetition
            logits[t] -= frequency * count + (presence if count else 0.0)
        output.append(int(logits.argmax()))
        if len(output) == n:
            return output
        state = DecoderState.concat(out.state.split())
        batch = ForwardBatch.build([1], state.num_tokens, device=device)
        out = model(torch.tensor(output[-1:], device=device), batch, state)


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_penalties_through_the_engine_follow_the_formulas(decode_steps):
    """Greedy outputs with penalties equal a reference that applies them by hand, with runs of
    8 decode steps too (whose tokens reach the host only at the end of the run); a request
    without penalties batched with them keeps its plain greedy output."""
    llm = _llm(decode_steps=decode_steps)
    model = llm.engine.model
    prompts = [[5, 6, 7, 8], [40, 41, 40, 41, 40], [9, 10, 11]]
    options = [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 3.0},
        {},
    ]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **o) for o in options]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, o in zip(outs, prompts, options, strict=True):
        assert out.token_ids == _penalized_reference(model, prompt, 20, **o), o
    assert outs[2].token_ids == reference(model, prompts[2], 20)


def test_a_strong_penalty_stops_greedy_repetition(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (plain,) = llm.generate(prompt, base, use_tqdm=False)
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # greedy repeats a token
    for strong in (
        base.evolve(frequency_penalty=2.0, presence_penalty=2.0),
        base.evolve(repetition_penalty=100.0),
    ):
        (out,) = llm.generate(prompt, strong, use_tqdm=False)
        assert len(set(out.token_ids)) == len(out.token_ids) == 24


def test_min_tokens_delays_a_stop_token_through_the_engine(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (plain,) = llm.generate(prompt, base, use_tqdm=False)
    first = plain.token_ids[0]
    (stopped,) = llm.generate(prompt, base.evolve(stop_token_ids=[first]), use_tqdm=False)
    assert stopped.token_ids == [first]
    (out,) = llm.generate(prompt, base.evolve(stop_token_ids=[first], min_tokens=3), use_tqdm=False)
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:3]
    if out.outputs[0].finish_reason == "stop":
        assert out.token_ids[-1] == first and out.outputs[0].stop_reason == first


def test_min_tokens_delays_a_stop_string_through_the_engine(llm):
    prompt = "stop test"
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (plain,) = llm.generate(prompt, base, use_tqdm=False)
    text = plain.text
    stop = next(c for c in text if c.isascii() and c.isprintable())
    (early,) = llm.generate(prompt, base.evolve(stop=[stop]), use_tqdm=False)
    at = text.index(stop)
    assert early.text == text[:at]
    later = base.evolve(stop=[stop], min_tokens=len(early.token_ids))
    (out,) = llm.generate(prompt, later, use_tqdm=False)
    assert len(out.token_ids) > len(early.token_ids)
    assert out.token_ids == plain.token_ids[: len(out.token_ids)]  # no token was masked
    assert out.text.startswith(text[: at + 1])  # the early occurrence stays in the text


def test_n_completions_per_prompt(llm):
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate(["abc", "xyz"], params, use_tqdm=False)
    again = llm.generate(["abc", "xyz"], params, use_tqdm=False)
    assert len(first) == 2
    for out, repeat in zip(first, again, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        completions = [tuple(c.token_ids) for c in out.outputs]
        assert len(set(completions)) == 3  # distinct
        assert completions == [tuple(c.token_ids) for c in repeat.outputs]  # reproducible
        assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    # Completion i is the request with seed + i.
    for i in range(3):
        (single,) = llm.generate("abc", params.evolve(n=1, seed=5 + i), use_tqdm=False)
        assert single.token_ids == first[0].outputs[i].token_ids
    greedy = SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert out.outputs[0].token_ids == reference(llm.engine.model, [5, 6, 7], 6)
    top = SamplingParams(temperature=1.0, n=2, seed=(1 << 64) - 1, max_tokens=2)
    assert len(llm.generate("abc", top, use_tqdm=False)[0].outputs) == 2  # seeds wrap around
    assert not llm.engine.has_unfinished()


def test_get_tokenizer(llm, tmp_path):
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer().encode("hi") == [ord("h") + 3, ord("i") + 3]
    save_checkpoint(llm.engine.model, tmp_path)  # weights only: no tokenizer files
    bare = LLM(model=str(tmp_path), dtype="float32", max_model_len=64, device="cpu")
    assert bare.tokenizer is None
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        bare.get_tokenizer()


def test_progress_shows_tokens_for_a_single_prompt(llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate("Hello", params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate("Hello", params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate" in err and "12/12" in err and "tok" in err and "1/1 requests" in err


def test_close_is_idempotent_and_with_closes(monkeypatch):
    closed = []
    with _llm() as llm:
        monkeypatch.setattr(llm.engine, "close", lambda: closed.append(1))
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        (out,) = llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
        assert len(out.token_ids) == 2
    assert closed == [1]
    llm.close()  # again: nothing more to do
    assert closed == [1]


def test_close_stops_the_workers_of_a_parallel_llm():
    """`LLM(..., parallel=...)` owns worker processes: close() (and leaving `with`) stops every
    one of them, by PID; closing again is harmless."""
    import os
    import signal

    from tokenspeed.runtime.parallel_config import ParallelConfig

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    def expire(signum, frame):
        raise TimeoutError("the parallel LLM still runs after 90 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(90)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with _llm(device="cpu", parallel=ParallelConfig(world_size=2)) as llm:
            pids = llm.engine.worker_pids
            assert len(pids) == 2 and not any(gone(pid) for pid in pids)
            (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
            assert len(out.token_ids) == 4
        assert all(gone(pid) for pid in pids)
        llm.close()  # idempotent
        llm2 = _llm(device="cpu", parallel=ParallelConfig(world_size=2))
        pids = llm2.engine.worker_pids
        llm2.close()
        assert all(gone(pid) for pid in pids)
        llm2.close()
        with pytest.raises(RuntimeError, match="closed"):
            llm2.generate({"prompt_token_ids": [5]}, params, use_tqdm=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
