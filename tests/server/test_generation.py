"""/v1/completions and /v1/chat/completions, whole and streamed, give what the offline API gives
with the same engine options: greedy token ids (the `return_token_ids` extension) and text (the
same byte tokenizer); usage, cached tokens on a second turn, stop strings held back in streams."""

import pytest

from tokenspeed import LLM, SamplingParams

from .conftest import ENGINE, TEMPLATE, assert_idle, joined, run, running_server, sse_events

PROMPTS = ["Hello there", "The quick brown fox jumps", [5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def offline():
    with LLM("tiny", decode_steps=1, **ENGINE) as llm:
        yield llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def as_prompt(p):
    return p if isinstance(p, str) else {"prompt_token_ids": p}


def test_completions_whole_and_streamed_match_the_offline_api(tiny_served, offline):
    want = offline.generate([as_prompt(p) for p in PROMPTS], greedy(12), use_tqdm=False)

    async def main():
        async with running_server(tiny_served) as (client, _, engine):
            body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
            whole = []
            for p in PROMPTS:
                resp = await client.post("/v1/completions", json={**body, "prompt": p})
                assert resp.status == 200, await resp.text()
                whole.append(await resp.json())
            streamed = []
            for p in PROMPTS:
                resp = await client.post(
                    "/v1/completions",
                    json={
                        **body,
                        "prompt": p,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
                streamed.append(await sse_events(resp))
            batch = await client.post("/v1/completions", json={**body, "prompt": PROMPTS})
            batch = await batch.json()
            assert_idle(engine)
            return whole, streamed, batch

    whole, streamed, batch = run(main())
    for out, w, events in zip(want, whole, streamed, strict=True):
        choice = w["choices"][0]
        assert choice["token_ids"] == out.token_ids
        assert choice["prompt_token_ids"] == out.prompt_token_ids
        assert choice["text"] == out.text
        assert choice["finish_reason"] == out.outputs[0].finish_reason
        assert w["object"] == "text_completion" and w["model"] == "tiny"
        usage = w["usage"]
        assert usage["prompt_tokens"] == len(out.prompt_token_ids)
        assert usage["completion_tokens"] == len(out.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
        # Streamed: the same tokens and text in pieces, then the usage chunk, then [DONE].
        assert events[-1] == "[DONE]"
        streamed_usage = events[-2]["usage"]
        assert events[-2]["choices"] == []
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert streamed_usage[key] == usage[key]
        # The same prompt again: its full pages come from the prefix cache this time.
        assert streamed_usage["prompt_tokens_details"]["cached_tokens"] == (
            (len(out.prompt_token_ids) - 1) // ENGINE["page_size"] * ENGINE["page_size"]
        )
        assert all(e["usage"] is None for e in events[:-2])
        got = joined(events)[0]
        assert got["token_ids"] == out.token_ids and got["text"] == out.text
        assert got["finish_reason"] == out.outputs[0].finish_reason
        assert events[0]["choices"][0]["prompt_token_ids"] == out.prompt_token_ids
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in batch["choices"]] == [o.token_ids for o in want]
    assert batch["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)


def test_chat_whole_and_streamed_match_llm_chat(tiny_served, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name three caches."}]},
    ]
    plain = [messages[0], {"role": "user", "content": "Name three caches."}]
    want = offline.chat(plain, greedy(10), use_tqdm=False, chat_template=TEMPLATE)[0]

    async def main():
        async with running_server(tiny_served) as (client, _, engine):
            body = {
                "messages": messages,
                "max_completion_tokens": 10,
                "temperature": 0,
                "return_token_ids": True,
            }
            whole = await (await client.post("/v1/chat/completions", json=body)).json()
            resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
            events = await sse_events(resp)
            assert_idle(engine)
            return whole, events

    whole, events = run(main())
    choice = whole["choices"][0]
    assert whole["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["token_ids"] == want.token_ids
    assert choice["prompt_token_ids"] == want.prompt_token_ids
    assert whole["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert events[-1] == "[DONE]" and all(
        e["object"] == "chat.completion.chunk" for e in events[:-1]
    )
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    got = joined(events, key="delta")[0]
    assert got["text"] == want.text and got["token_ids"] == want.token_ids
    assert got["finish_reason"] == want.outputs[0].finish_reason


def test_n_seeded_samples_match_the_offline_api(tiny_served, offline):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=7, n=2, ignore_eos=True)
    want = offline.generate(["Sampling"], params, use_tqdm=False)[0]

    async def main():
        async with running_server(tiny_served) as (client, _, engine):
            body = {
                "prompt": "Sampling",
                "max_tokens": 8,
                "temperature": 0.9,
                "top_p": 0.9,
                "seed": 7,
                "n": 2,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            whole = await (await client.post("/v1/completions", json=body)).json()
            resp = await client.post("/v1/completions", json={**body, "stream": True})
            events = await sse_events(resp)
            assert_idle(engine)
            return whole, events

    whole, events = run(main())
    assert [c["token_ids"] for c in whole["choices"]] == [o.token_ids for o in want.outputs]
    streamed = joined(events)
    assert [streamed[i]["token_ids"] for i in (0, 1)] == [o.token_ids for o in want.outputs]
    assert whole["usage"]["completion_tokens"] == 16
    assert whole["usage"]["prompt_tokens"] == len(want.prompt_token_ids)  # counted once


def test_a_second_turn_reports_cached_prompt_tokens(tiny_served):
    first = "Turn one of a conversation that is long enough to fill a few pages of the cache."

    async def main():
        async with running_server(tiny_served) as (client, _, engine):
            body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
            one = await (
                await client.post("/v1/completions", json={**body, "prompt": first})
            ).json()
            second = first + one["choices"][0]["text"] + " And turn two."
            resp = await client.post(
                "/v1/completions",
                json={
                    **body,
                    "prompt": second,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            events = await sse_events(resp)
            assert_idle(engine)
            return one, events[-2]["usage"]

    one, usage = run(main())
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"] and cached % ENGINE["page_size"] == 0


def _stop_string(text: str) -> tuple[int, str] | None:
    """A 2-character piece of the text past its first few characters, without U+FFFD, that does
    not occur earlier (random weights make mostly invalid UTF-8), and where it starts."""
    for i in range(4, len(text) - 2):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and piece not in text[: i + 1]:
            return i, piece
    return None


def test_streamed_text_never_shows_what_a_stop_string_later_cuts(tiny_served, offline):
    """A stop string taken from the middle of an unstopped output: streamed and whole answers
    both end just before it, as LLM.generate does, and no streamed piece ever showed it."""
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in ("Hello there", "def f(x):", "The quick brown fox jumps", "Stop here"):
        found = _stop_string(offline.generate([prompt], free, use_tqdm=False)[0].text)
        if found is not None:
            break
    assert found is not None
    at, stop = found
    want = offline.generate([prompt], free.evolve(stop=[stop]), use_tqdm=False)[0]
    assert want.outputs[0].finish_reason == "stop" and len(want.text) == at

    async def main():
        async with running_server(tiny_served) as (client, _, engine):
            body = {
                "prompt": prompt,
                "max_tokens": 40,
                "temperature": 0,
                "stop": stop,
                "ignore_eos": True,
            }
            whole = await (await client.post("/v1/completions", json=body)).json()
            resp = await client.post("/v1/completions", json={**body, "stream": True})
            events = await sse_events(resp)
            assert_idle(engine)
            return whole, events

    whole, events = run(main())
    assert whole["choices"][0]["text"] == want.text
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["choices"][0]["stop_reason"] == stop
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == want.text
    assert len(pieces) > 2  # streamed in several pieces, not held to the end
    assert all(stop not in "".join(pieces[: k + 1]) for k in range(len(pieces)))
