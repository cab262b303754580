"""The HTTP worker in-process: the app on an aiohttp test server (real TCP on 127.0.0.1, a port
chosen at run time) inside the test's own event loop, so that a test can read the engine (its
load, `check_integrity()`) beside the HTTP traffic. One subprocess test (test_subprocess.py)
runs `tokenspeed serve` itself.

The model is the one `LLM("tiny")` builds (`load_model("tiny")`: seed 0, the byte tokenizer),
so that offline outputs are the reference for the server's."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import test_utils

from tokenspeed.runtime import Engine, EngineConfig
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.llm import load_model
from tokenspeed.server import AggregatedRole, ServedModel, ServerConfig, ServerState, build_app
from tokenspeed.server.admission import Admission

# The engine options of every in-process server, and of the offline references.
ENGINE = dict(device="cpu", max_model_len=512, max_num_seqs=8, page_size=16)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
DEADLINE_S = 60  # no wait of a test is longer


@pytest.fixture(scope="session")
def tiny_served():
    """(model, tokenizer) of LLM("tiny"), shared: engines on one device may share a model."""
    return load_model("tiny")


@contextlib.asynccontextmanager
async def running_server(tiny_served, step_thread: bool = False, **server_options):
    """Yields (client, state, engine): an aiohttp TestClient on the app, its shared state and
    the engine behind it. On exit the role is closed (in-flight requests aborted) and the engine
    checked and closed."""
    model, tokenizer = tiny_served
    engine = Engine(model, tokenizer, EngineConfig(**ENGINE))
    engine.idle_pages = engine.cache.available_pages
    role = AggregatedRole(AsyncEngine(engine, step_thread=step_thread))
    config = ServerConfig(model_name="tiny", **server_options)
    served = ServedModel(
        name="tiny",
        tokenizer=tokenizer,
        vocab_size=model.config.vocab_size,
        max_model_len=engine.config.max_model_len,
        chat_template=TEMPLATE,
    )
    state = ServerState(role, served, config, Admission(config.max_pending))
    client = test_utils.TestClient(test_utils.TestServer(build_app(state)))
    await client.start_server()
    try:
        yield client, state, engine
    finally:
        await client.close()
        await role.close()
        engine.close()


async def sse_events(resp) -> list[dict | str]:
    """Every `data:` payload of an SSE response, parsed ("[DONE]" as the string)."""
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for line in resp.content:
        line = line.decode().rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def gateway_outputs(url: str, body: dict, prompts, messages) -> dict[str, list]:
    """Each prompt as a completion (whole and streamed), then each conversation as a chat
    completion (whole and streamed), through the gateway at `url`, `body` sent with each. The
    answers ("whole", "chat") and the SSE events ("streamed", "chat_streamed"), in order."""
    out = {"whole": [], "streamed": [], "chat": [], "chat_streamed": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for p in prompts:
            async with http.post(url + "/v1/completions", json={**body, "prompt": p}) as r:
                assert r.status == 200, await r.text()
                out["whole"].append(await r.json())
            stream = {**body, "prompt": p, "stream": True}
            async with http.post(url + "/v1/completions", json=stream) as r:
                out["streamed"].append(await sse_events(r))
        for conversation in messages:
            chat = {**body, "messages": conversation}
            async with http.post(url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200, await r.text()
                out["chat"].append(await r.json())
            async with http.post(url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
                out["chat_streamed"].append(await sse_events(r))
    return out


def check_gateway_outputs(out: dict, completions, chats) -> None:
    """`gateway_outputs`' answers against the offline API's outputs (`LLM.generate`, one per
    prompt, and `LLM.chat`, one per conversation): the same token ids and text, whole and
    streamed, usage and finish reasons."""
    for want, whole, events in zip(completions, out["whole"], out["streamed"], strict=True):
        choice = whole["choices"][0]
        assert choice["token_ids"] == want.token_ids
        assert choice["text"] == want.text
        assert whole["usage"]["completion_tokens"] == len(want.token_ids)
        assert events[-1] == "[DONE]"
        got = joined(events)[0]
        assert got["token_ids"] == want.token_ids and got["text"] == want.text
        assert got["finish_reason"] == want.outputs[0].finish_reason
    for want, whole, events in zip(chats, out["chat"], out["chat_streamed"], strict=True):
        choice = whole["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want.text}
        assert choice["token_ids"] == want.token_ids
        got = joined(events, key="delta")[0]
        assert got["text"] == want.text and got["token_ids"] == want.token_ids


def joined(events: list, key: str = "text") -> dict[int, dict]:
    """Per choice index: the streamed text and token ids joined, and the finish reason."""
    choices: dict[int, dict] = {}
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            c = choices.setdefault(
                choice["index"], {"text": "", "token_ids": [], "finish_reason": None}
            )
            text = choice["delta"].get("content") if key == "delta" else choice["text"]
            c["text"] += text or ""
            c["token_ids"] += choice.get("token_ids") or []
            if choice["finish_reason"] is not None:
                c["finish_reason"] = choice["finish_reason"]
    return choices


async def wait_until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll `condition()` (every 10 ms) until it holds; fail naming `what` past the timeout."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def assert_idle(engine: Engine) -> None:
    """No request left, the cache's bookkeeping adds up, every page free or cached again."""
    assert not engine.has_unfinished()
    engine.check_integrity()
    load = engine.load()
    assert (load.running, load.waiting, load.used_pages) == (0, 0, 0), load
    assert engine.cache.available_pages == engine.idle_pages


def run(coro, timeout_s: float = DEADLINE_S):
    """asyncio.run with a deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))
