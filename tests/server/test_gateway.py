"""Two `tokenspeed serve` workers behind smg (the Shepherd Model Gateway, power_of_two: a
load-aware policy reading our GET /v1/loads): greedy outputs through it equal the offline API's,
a bounded streaming load has no error and leaves both workers idle and consistent, smg shows
the loads it read from us, and a worker killed by SIGKILL drops out of routing within seconds.

The gateway tests share one pair of workers and one smg (started once for the module, stopped
by PID whatever happens); the last one kills a worker. In-process tests of what smg reads
(/v1/loads in SGLang's schema, /server_info, /model_info) come first."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import aiohttp
import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.server.state import DecodeRate

from .conftest import (
    ENGINE,
    TEMPLATE,
    check_gateway_outputs,
    gateway_outputs,
    run,
    running_server,
    sse_events,
)
from .processes import (
    WORKER_OPTIONS,
    http_json,
    http_text,
    prometheus,
    smg_missing,
    start_smg,
    start_workers,
    stopping,
    wait_until,
)

# Text prompts: smg 1.13 refuses token-id prompts (its `prompt` is a string or strings).
PROMPTS = ["Hello there", "The quick brown fox jumps", "x" * 40]
MESSAGES = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Name three caches."}],
]
MAX_TOKENS = 12


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


# ------------------------------------------------------------------ what smg reads, in-process
def test_server_and_model_info_describe_the_worker(tiny_served):
    async def main():
        async with running_server(tiny_served, max_pending=32) as (client, _, _engine):
            info = await client.get("/server_info")
            model = await client.get("/model_info")
            version = await client.get("/version")
            return (info.status, await info.json()), await model.json(), version.status

    (status, info), model, version = run(main())
    assert status == 200
    assert info["served_model_name"] == info["model_path"] == "tiny"
    assert info["max_model_len"] == info["context_length"] == ENGINE["max_model_len"]
    assert info["max_num_seqs"] == info["max_running_requests"] == ENGINE["max_num_seqs"]
    assert info["page_size"] == ENGINE["page_size"]
    assert info["role"] == "aggregated" and info["disaggregation_mode"] == "null"
    assert info["max_pending"] == 32 and info["active_requests"] == 0
    assert info["engine"] == "tokenspeed" and info["max_total_num_tokens"] > 0
    assert model["is_generation"] is True and model["max_context_length"] == 512
    assert model["max_req_input_len"] == 511 and model["vocab_size"] > 0
    # No /version: smg would take a worker answering it and /server_info for vLLM, and then
    # read none of /server_info's labels.
    assert version == 404


def test_gen_throughput_is_the_decode_rate_between_reads():
    now = [100.0]
    rate = DecodeRate(window_s=1.0, clock=lambda: now[0])
    assert rate.read(0) == 0.0  # the first read only starts the window
    now[0] += 0.5
    assert rate.read(40) == 0.0  # under a second: the last rate still holds
    now[0] += 0.5
    assert rate.read(100) == 100.0  # 100 tokens over 1 s
    now[0] += 2.0
    assert rate.read(100) == 0.0  # idle
    assert rate.read(5) == 0.0  # the engine's counters were reset: a new window


# ------------------------------------------------------------------ two workers behind smg
needs_smg = pytest.mark.skipif(smg_missing() is not None, reason=str(smg_missing()))


@pytest.fixture(scope="module")
def reference():
    """The offline API's greedy outputs, with the workers' engine options."""
    with LLM("tiny", decode_steps=1, **ENGINE) as llm:
        completions = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        chats = llm.chat(MESSAGES, greedy(MAX_TOKENS), use_tqdm=False, chat_template=TEMPLATE)
    return completions, chats


@pytest.fixture(scope="module")
def gateway():
    """(smg, [worker A, worker B]): two workers started at once, smg in front of them."""
    if smg_missing() is not None:
        pytest.skip(smg_missing())
    with stopping() as procs:
        workers = start_workers(2, *WORKER_OPTIONS, "--chat-template", TEMPLATE, procs=procs)
        smg = start_smg([w.url for w in workers], policy="power_of_two", procs=procs)
        yield smg, workers


def series(metric: dict[str, float], name: str, **labels: str) -> list[float]:
    """The values of the samples of `name` whose labels include `labels`."""
    out = []
    for key, value in metric.items():
        base, _, rest = key.partition("{")
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(have.get(k) == v for k, v in labels.items()):
            out.append(value)
    return out


def served_counts(worker) -> float:
    """How many 200 answers the worker has given (its /metrics)."""
    metric = prometheus(http_text(worker.url + "/metrics"))
    return metric.get('tokenspeed_http_responses_total{status="200"}', 0.0)


@needs_smg
def test_greedy_outputs_through_smg_equal_the_offline_api(gateway, reference):
    smg, _ = gateway
    completions, chats = reference

    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    out = run(gateway_outputs(smg.url, body, PROMPTS, MESSAGES))
    check_gateway_outputs(out, completions, chats)  # token_ids: the extension passes smg
    for want, whole in zip(completions + chats, out["whole"] + out["chat"], strict=True):
        assert whole["choices"][0]["prompt_token_ids"] == want.prompt_token_ids
    assert all(events[-1] == "[DONE]" for events in out["chat_streamed"])


@needs_smg
def test_a_bounded_streaming_load_through_smg_has_no_error_and_leaves_workers_idle(gateway):
    """24 clients stream one request after another for ~5 s through smg (half the prompts
    repeated, half new, random lengths and temperatures); meanwhile smg's GET /get_loads (what
    it read from our /v1/loads) is sampled. No error, every answer whole;
    smg sent work to both workers and saw requests running on both; afterwards each worker's
    integrity check passes, its loads show nothing running, and smg shows the same numbers (in
    GET /get_loads and in its Prometheus gauges)."""
    smg, workers = gateway
    duration_s, clients = 5.0, 24
    before = [served_counts(w) for w in workers]

    async def main():
        loop = asyncio.get_running_loop()
        end = loop.time() + duration_s
        stats = {"done": 0, "tokens": 0, "errors": []}
        seen_running = {w.url: 0 for w in workers}
        # Half the prompts repeat (a pool of 8, so both workers see repeats: prefix hits),
        # half are new.
        pool = [f"Tools: search, run. Task {k}: " * (1 + k % 3) for k in range(8)]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def one_client(i: int) -> None:
                rng = random.Random(i)
                while loop.time() < end:
                    n = rng.randint(1, 16)
                    body = {
                        "model": "tiny",
                        "prompt": rng.choice(pool)
                        if rng.random() < 0.5
                        else f"client {i} asks {rng.random()}",
                        "max_tokens": n,
                        "temperature": rng.choice([0, 0.8]),
                        "ignore_eos": True,
                        "stream": True,
                        "return_token_ids": True,
                    }
                    try:
                        async with http.post(smg.url + "/v1/completions", json=body) as r:
                            events = await sse_events(r)
                        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
                        if events[-1] != "[DONE]" or len(ids) != n:
                            stats["errors"].append((i, events[-2:]))
                        stats["tokens"] += len(ids)
                        stats["done"] += 1
                    except (aiohttp.ClientError, AssertionError, TimeoutError) as exc:
                        stats["errors"].append((i, repr(exc)))

            async def sample_smg() -> None:
                while loop.time() < end:
                    async with http.get(smg.url + "/get_loads") as r:
                        for entry in (await r.json())["loads"]:
                            url = entry["worker"]
                            running = entry["num_running_reqs"]
                            seen_running[url] = max(seen_running.get(url, 0), running)
                    await asyncio.sleep(0.25)

            await asyncio.gather(sample_smg(), *(one_client(i) for i in range(clients)))
        return stats, seen_running

    stats, seen_running = run(main(), timeout_s=120)
    assert stats["errors"] == []
    assert stats["done"] >= clients and stats["tokens"] > 0
    after = [served_counts(w) for w in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    # smg read our loads while they ran: requests running on each worker.
    assert all(seen_running[w.url] > 0 for w in workers), seen_running

    for w in workers:
        status, health = http_json("GET", w.url + "/health?integrity=1")
        assert (status, health) == (200, {"status": "ok", "integrity": "ok"})

        def idle(w=w) -> bool:
            _, loads = http_json("GET", w.url + "/v1/loads")
            running, ours = loads["loads"][0]["num_running_reqs"], loads["tokenspeed"]
            return running == ours["pending"] == ours["used_pages"] == 0

        wait_until(idle, f"{w.name} to have nothing running", 30)

    # smg's view after the load: exactly our numbers (read within a poll interval or two).
    def smg_agrees() -> bool:
        _, view = http_json("GET", smg.url + "/get_loads")
        by_url = {e["worker"]: e for e in view["loads"]}
        for w in workers:
            _, ours = http_json("GET", w.url + "/v1/loads")
            mine, theirs = ours["loads"][0], by_url.get(w.url)
            if theirs is None or theirs["num_running_reqs"] != 0:
                return False
            for key in ("max_total_num_tokens", "max_running_requests", "cache_hit_rate"):
                if theirs[key] != mine[key]:
                    return False
        return True

    wait_until(smg_agrees, "smg's /get_loads to show the workers' idle loads", 15, smg)
    _, view = http_json("GET", smg.url + "/get_loads")
    assert all(e["cache_hit_rate"] > 0 for e in view["loads"])  # repeated prompts hit
    workers_view = smg.workers()
    for w in workers:
        labels = workers_view[w.url]["labels"]
        assert labels["max_running_requests"] == str(ENGINE["max_num_seqs"])  # /server_info
        assert workers_view[w.url]["runtime_type"] == "sglang"  # its load schema, not vLLM's

    # ... and its Prometheus exposition (--prometheus-port) carries them, per worker.
    def exported_agrees() -> bool:
        metric = prometheus(http_text(smg.metrics_url))
        for w in workers:
            _, ours = http_json("GET", w.url + "/v1/loads")
            polls = series(metric, "smg_engine_load_polls_total", worker=w.url)
            hit_rate = series(metric, "smg_engine_cache_hit_rate", worker=w.url)
            running = series(metric, "smg_engine_running_requests", worker=w.url)
            if not polls or polls[0] <= 0 or running != [0]:
                return False
            if hit_rate != [ours["loads"][0]["cache_hit_rate"]]:
                return False
        return True

    wait_until(exported_agrees, "smg's Prometheus gauges to show the workers' loads", 15, smg)


@needs_smg
def test_a_killed_worker_drops_out_of_routing_within_seconds(gateway):
    """SIGKILL worker B: smg's 1 s health check (threshold 1) marks it unhealthy, and from then
    on every request through smg succeeds, on worker A. The module's last test."""
    smg, (a, b) = gateway
    body = {"model": "tiny", "prompt": "still there?", "max_tokens": 4, "temperature": 0}
    status, _ = http_json("POST", smg.url + "/v1/completions", body)
    assert status == 200
    os.kill(b.pid, signal.SIGKILL)
    b.proc.wait(timeout=30)
    killed = time.monotonic()

    def b_unhealthy() -> bool:
        return not smg.workers()[b.url]["is_healthy"]

    wait_until(b_unhealthy, "smg to mark the killed worker unhealthy", 20, smg)
    marked_s = time.monotonic() - killed
    served_before = served_counts(a)
    for _ in range(10):
        status, answer = http_json("POST", smg.url + "/v1/completions", body, timeout_s=30)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 4
    assert served_counts(a) >= served_before + 10  # all of them on A
    assert marked_s < 20
