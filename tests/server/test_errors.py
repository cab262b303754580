"""Bad input gets a 4xx with an OpenAI-style error body naming the problem; an exception inside
a request is a 500 (or an error event once a stream has started) and the server goes on."""

import asyncio

from .conftest import assert_idle, run, running_server, sse_events

OK = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (path, body: a dict sent as JSON, or bytes sent as they are, status, param, words in message)
BAD = [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe\x00", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {**OK, "model": 3}, 400, "model", "string"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", "required"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "must be"),
    ("/v1/completions", {**OK, "prompt": [1, "a"]}, 400, "prompt", "must be"),
    ("/v1/completions", {**OK, "prompt": [5, 512]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**OK, "prompt": [5, -1]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**OK, "prompt": "x" * 512}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {**OK, "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {**OK, "max_tokens": 10**30}, 400, "max_tokens", "lower max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 511}, 400, "max_tokens", "maximum context length"),
    ("/v1/completions", {**OK, "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("/v1/completions", {**OK, "max_tokens": True}, 400, "max_tokens", "integer"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "finite number"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**OK, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {**OK, "frequency_penalty": -9}, 400, "frequency_penalty", "[-2, 2]"),
    ("/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens", "max_tokens"),
    ("/v1/completions", {**OK, "seed": "x"}, 400, "seed", "int"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", "[1, 128]"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {**OK, "stop": 5}, 400, "stop", "non-empty"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", "true or false"),
    (
        "/v1/completions",
        {**OK, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed",
    ),
    ("/v1/completions", {**OK, "logprobs": 2}, 400, "logprobs", "not supported"),
    ("/v1/completions", {**OK, "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {**OK, "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "messages", "role"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        "only text",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "at least 1",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 10**9},
        400,
        "max_completion_tokens",
        "lower max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function"}]},
        400,
        "tools",
        "not supported",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "supported",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x" * 600}]},
        400,
        "messages",
        "maximum context length",
    ),
]


def test_every_bad_input_gets_a_4xx_naming_the_problem(tiny_served):
    async def main():
        async with running_server(tiny_served, max_body_bytes=4096) as (client, _, engine):
            answers = []
            for path, body, *_ in BAD:
                if isinstance(body, bytes):
                    resp = await client.post(path, data=body)
                else:
                    resp = await client.post(path, json=body)
                answers.append((resp.status, resp.headers["Content-Type"], await resp.json()))
            too_big = await client.post("/v1/completions", data=b"{" + b" " * 5000 + b"}")

            # No Content-Length (chunked): the limit holds while reading.
            async def chunks():
                for _ in range(10):
                    yield b" " * 1000

            chunked = await client.post("/v1/completions", data=chunks())
            routes = [await client.get("/v1/nothing"), await client.get("/v1/completions")]
            extra = [(r.status, await r.json()) for r in (too_big, chunked, *routes)]
            ok = await client.post("/v1/completions", json=OK)  # still serving
            assert ok.status == 200
            assert_idle(engine)
            return answers, extra

    answers, extra = run(main())
    for (path, body, status, param, words), (got, kind, answer) in zip(BAD, answers, strict=True):
        case = f"{path} {body!r:.80}"
        assert got == status, (case, answer)
        assert kind.startswith("application/json"), case
        error = answer["error"]
        assert answer["object"] == "error" and error["param"] == param, (case, error)
        assert words in error["message"], (case, error["message"])
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    for status, answer in extra[:2]:
        assert status == 413 and "larger than the limit of 4096 bytes" in answer["error"]["message"]
    assert [s for s, _ in extra[2:]] == [404, 405]
    assert all("error" in a for _, a in extra[2:])


def test_a_failure_inside_a_request_is_a_500_and_the_server_goes_on(tiny_served):
    async def main():
        async with running_server(tiny_served) as (client, state, engine):
            real = state.role.generate
            calls = []

            def failing(*args, **kwargs):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("boom before the request started")
                return broken(real(*args, **kwargs))

            async def broken(stream):
                async for out in stream:
                    yield out
                    raise RuntimeError("boom mid-stream")

            state.role.generate = failing
            before = await client.post("/v1/completions", json=OK)
            before = (before.status, await before.json())
            resp = await client.post("/v1/completions", json={**OK, "stream": True})
            events = await sse_events(resp)
            whole = await client.post("/v1/completions", json={**OK, "max_tokens": 4})
            whole = (whole.status, await whole.json())
            state.role.generate = real
            after = await client.post("/v1/completions", json=OK)
            await asyncio.sleep(0)
            assert_idle(engine)
            return before, events, whole, after.status

    before, events, whole, after = run(main())
    assert before[0] == 500 and "boom before" in before[1]["error"]["message"]
    assert before[1]["error"]["type"] == "internal_error"
    assert events[-1] == "[DONE]" and "boom mid-stream" in events[-2]["error"]["message"]
    assert whole[0] == 500 and "boom mid-stream" in whole[1]["error"]["message"]
    assert after == 200
