"""Running a worker: clients that disconnect, overload (503), the API key (401), the load and
health endpoints, /metrics, and a bounded load test after which the cache adds up."""

import asyncio
import random
import re

import aiohttp
import pytest

from .conftest import assert_idle, run, running_server, sse_events, wait_until

LONG = {"prompt": "Go on and on", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_cache(tiny_served):
    async def main():
        async with running_server(tiny_served) as (client, state, engine):
            resp = await client.post("/v1/completions", json={**LONG, "stream": True})
            assert resp.status == 200
            for _ in range(3):  # a few tokens have arrived
                assert (await resp.content.readline()).startswith(b"data: ")
                await resp.content.readline()
            running = state.role.load()
            assert running.running == 1 and running.used_pages > 0
            resp.close()  # the connection goes away
            await wait_until(lambda: engine.load().running == 0, "the request to be aborted")
            await wait_until(lambda: state.admission.pending == 0, "the handler to end")
            await wait_until(lambda: not engine.has_unfinished(), "the abort to be reported")
            assert_idle(engine)
            return engine.metrics.decode_tokens

    assert run(main()) < 300  # far from the 400 tokens asked for


def test_a_client_leaving_before_its_answer_aborts_it_too(tiny_served):
    """Non-streaming: aiohttp cancels the handler when the connection closes, which closes the
    engine stream and aborts the request (no write has to fail first)."""

    async def main():
        async with running_server(tiny_served) as (client, state, engine):
            task = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
            await wait_until(lambda: engine.load().running == 1, "the request to run")
            task.cancel()  # the client gives up: its connection is closed
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: not engine.has_unfinished(), "the request to be aborted")
            await wait_until(lambda: state.admission.pending == 0, "the handler to end")
            assert_idle(engine)
            return engine.metrics.decode_tokens

    assert run(main()) < 300


def test_past_max_pending_the_server_answers_503_then_serves_again(tiny_served):
    async def main():
        async with running_server(tiny_served, max_pending=2) as (client, state, engine):
            streams = [
                await client.post("/v1/completions", json={**LONG, "stream": True})
                for _ in range(2)
            ]
            over = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
            too_many = await client.post("/v1/completions", json={**LONG, "n": 3})
            answers = [
                (over.status, over.headers.get("Retry-After"), await over.json()),
                (too_many.status, None, await too_many.json()),
            ]
            loads = await (await client.get("/v1/loads")).json()
            for resp in streams:
                resp.close()
            await wait_until(lambda: state.admission.pending == 0, "the streams to end")
            again = await client.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert again.status == 200
            await wait_until(lambda: not engine.has_unfinished(), "the aborts to be reported")
            assert_idle(engine)
            return answers, loads

    (over, too_many), loads = run(main())
    assert over[0] == 503 and over[1] == "1"
    assert over[2]["error"]["code"] == "overloaded" and "at most 2" in over[2]["error"]["message"]
    assert too_many[0] == 400 and too_many[2]["error"]["param"] == "n"
    ours = loads["tokenspeed"]
    assert ours["pending"] == 2 and ours["max_pending"] == 2 and ours["running"] == 2
    assert loads["loads"][0]["num_running_reqs"] == 2


def test_the_api_key_guards_v1_and_leaves_probes_open(tiny_served):
    async def main():
        async with running_server(tiny_served, api_key="s3cret") as (client, _, _engine):
            out = {}
            for name, headers in {
                "none": {},
                "wrong": {"Authorization": "Bearer nope"},
                "basic": {"Authorization": "Basic s3cret"},
                "right": {"Authorization": "Bearer s3cret"},
            }.items():
                resp = await client.post(
                    "/v1/completions", json=LONG | {"max_tokens": 1}, headers=headers
                )
                out[name] = (resp.status, await resp.json())
            out["models"] = (await client.get("/v1/models")).status
            out["health"] = (await client.get("/health")).status
            out["metrics"] = (await client.get("/metrics")).status
            return out

    out = run(main())
    for name in ("none", "wrong", "basic"):
        status, body = out[name]
        assert status == 401 and body["error"]["type"] == "authentication_error", name
    assert out["right"][0] == 200
    assert (out["models"], out["health"], out["metrics"]) == (401, 200, 200)


def test_models_loads_health_and_metrics(tiny_served):
    async def main():
        async with running_server(tiny_served) as (client, state, engine):
            models = await (await client.get("/v1/models")).json()
            stream = await client.post("/v1/completions", json={**LONG, "stream": True})
            await stream.content.readline()
            busy = await (await client.get("/v1/loads")).json()
            busy_alias = await (await client.get("/loads?model=tiny")).json()
            stream.close()
            await wait_until(lambda: not engine.has_unfinished(), "the abort")
            for _ in range(2):  # two turns: the second hits the first's pages
                resp = await client.post(
                    "/v1/completions", json={**LONG, "max_tokens": 6, "prompt": "x" * 40}
                )
                assert resp.status == 200
            idle = await (await client.get("/v1/loads?include=core,queues")).json()
            health = await (await client.get("/health?integrity=1")).json()
            text = await (await client.get("/metrics")).text()
            content_type = (await client.get("/metrics")).headers["Content-Type"]
            state.admission.closed = True  # as during shutdown
            closing = await client.get("/health")
            refused = await client.post("/v1/completions", json=LONG)
            state.admission.closed = False
            return models, (busy, busy_alias), idle, health, text, content_type, closing, refused

    models, (busy, busy_alias), idle, health, text, content_type, closing, refused = run(main())
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    ours = busy["tokenspeed"]
    assert ours["model"] == "tiny" and ours["role"] == "aggregated"
    assert ours["running"] == 1 and ours["pending"] == 1 and ours["used_pages"] > 0
    assert ours["outstanding_decode_tokens"] > 300 and ours["accepting"] is True
    assert (ours["page_size"], ours["max_num_seqs"]) == (16, 8)
    # The same in SGLang's schema (what smg parses): one rank, tokens = pages x page_size.
    assert busy["dp_rank_count"] == 1 and isinstance(busy["timestamp"], str)
    (rank,) = busy["loads"]
    assert rank["dp_rank"] == 0
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (1, 0, 1)
    assert rank["num_used_tokens"] == 16 * ours["used_pages"]
    assert rank["max_total_num_tokens"] == 16 * ours["total_pages"]
    assert rank["token_usage"] == round(ours["used_pages"] / ours["total_pages"], 4) > 0
    assert rank["max_running_requests"] == 8 and rank["utilization"] == 1 / 8
    assert busy_alias["loads"][0]["num_running_reqs"] == 1
    assert busy_alias["tokenspeed"]["used_pages"] == ours["used_pages"]
    ours = idle["tokenspeed"]
    assert ours["running"] == ours["waiting"] == ours["used_pages"] == ours["pending"] == 0
    assert ours["free_pages"] + ours["cached_pages"] == ours["total_pages"] > 0
    (rank,) = idle["loads"]
    assert rank["num_running_reqs"] == rank["num_used_tokens"] == rank["token_usage"] == 0
    assert rank["num_waiting_uncached_tokens"] == 0
    assert 0 < rank["cache_hit_rate"] < 1  # the second turn hit the first's pages
    assert health == {"status": "ok", "integrity": "ok"}
    assert content_type.startswith("text/plain; version=0.0.4")
    metric = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metric[name] = float(value)
    assert metric["tokenspeed_time_to_first_token_seconds_count"] == 3
    assert metric['tokenspeed_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert metric["tokenspeed_inter_token_latency_seconds_count"] >= 10
    assert metric["tokenspeed_requests_running"] == metric["tokenspeed_requests_waiting"] == 0
    assert 0 < metric["tokenspeed_prefix_hit_rate"] < 1
    assert metric["tokenspeed_prefix_cached_tokens_total"] >= 32
    assert metric['tokenspeed_cache_pages{state="used"}'] == 0
    assert metric["tokenspeed_l2_objects_published_total"] > 0  # turn ends written to L2
    assert metric["tokenspeed_l2_puts_total"] > 0
    assert metric['tokenspeed_http_responses_total{status="200"}'] >= 4
    buckets = [
        v
        for k, v in metric.items()
        if k.startswith("tokenspeed_inter_token_latency_seconds_bucket")
    ]
    assert buckets == sorted(buckets)  # cumulative
    assert re.search(r"^# TYPE tokenspeed_l2_hit_tokens_total counter$", text, re.M)
    assert closing.status == 503 and refused.status == 503


@pytest.mark.parametrize("step_thread", [False, True], ids=["inline", "thread"])
def test_32_streaming_clients_for_seconds_without_an_error(tiny_served, step_thread):
    """A bounded load test: 32 clients stream one request after another for ~4 s (random
    prompts sharing prefixes, random lengths, some leaving early); no error, every answer
    complete, and afterwards nothing runs and the cache's bookkeeping adds up."""
    duration_s = 4.0

    async def main():
        async with running_server(tiny_served, step_thread=step_thread) as (client, _, engine):
            loop = asyncio.get_running_loop()
            end = loop.time() + duration_s
            stats = {"done": 0, "left": 0, "tokens": 0, "errors": []}
            prefixes = ["System: be brief. " * 3, "Tools: search, run. " * 2, ""]

            async def one_client(i: int) -> None:
                rng = random.Random(i)
                while loop.time() < end:
                    n = rng.randint(1, 24)
                    body = {
                        "prompt": rng.choice(prefixes) + f"client {i} asks {rng.random()}",
                        "max_tokens": n,
                        "temperature": rng.choice([0, 0.8]),
                        "ignore_eos": True,
                        "stream": True,
                        "return_token_ids": True,
                    }
                    try:
                        resp = await client.post("/v1/completions", json=body)
                        if rng.random() < 0.1:  # leaves after the first chunk
                            await resp.content.readline()
                            resp.close()
                            stats["left"] += 1
                            continue
                        events = await sse_events(resp)
                        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
                        if events[-1] != "[DONE]" or len(ids) != n:
                            stats["errors"].append((i, events[-2:]))
                        stats["tokens"] += len(ids)
                        stats["done"] += 1
                    except (aiohttp.ClientError, AssertionError) as exc:
                        stats["errors"].append((i, repr(exc)))

            await asyncio.gather(*(one_client(i) for i in range(32)))
            await wait_until(lambda: not engine.has_unfinished(), "every request to end")
            health = await (await client.get("/health?integrity=1")).json()
            assert_idle(engine)
            return stats, health

    stats, health = run(main(), timeout_s=90)
    assert stats["errors"] == []
    assert stats["done"] >= 32 and stats["tokens"] > 0
    assert health["integrity"] == "ok"
