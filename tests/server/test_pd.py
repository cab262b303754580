"""A prefill/decode split over HTTP (`--role prefill` / `--role decode`, server/pd_roles.py),
driven as smg's P/D mode drives it: the same request, with bootstrap_host / bootstrap_port /
bootstrap_room added, to the prefill worker and the decode worker at once.

In-process first: both roles in this process (two engines, two apps on loopback ports chosen
at run time), the request sent to both in either order; greedy outputs equal the offline API's
with the same engine options (prompts off and on the page grid, longer than the prefill budget:
chunked). Then through a real smg with one prefill and one decode worker process, and faults:
the decode worker killed mid-flight, a client leaving mid-stream. Every process is stopped by
PID whatever happens; every wait has a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket

import aiohttp
import pytest
import torch
from aiohttp import test_utils

from tokenspeed import LLM, SamplingParams
from tokenspeed.cli import main
from tokenspeed.runtime import EngineConfig
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.server import ServedModel, ServerConfig, ServerState, build_app
from tokenspeed.server.admission import Admission
from tokenspeed.server.role import make_engine, make_role

from . import processes
from .conftest import (
    ENGINE,
    TEMPLATE,
    check_gateway_outputs,
    gateway_outputs,
    joined,
    run,
    sse_events,
    wait_until,
)
from .processes import (
    WORKER_OPTIONS,
    Gateway,
    Worker,
    http_json,
    launch_smg,
    smg_missing,
    spawn_worker,
    stopping,
)

# The workers' engine options (and the offline reference's): a prefill budget of 48 tokens, so
# that the longer prompts are prefilled in chunks.
PD_ENGINE = {**ENGINE, "prefill_token_budget": 48}
MAX_TOKENS = 10
LENGTHS = (37, 5, 120, 16, 64, 1, 100)  # off and on the page grid (16), some chunked (> 48)
TIMEOUT_S = 4.0  # how long each half waits for the other, in these tests


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


PROMPTS = [prompt_ids(n, seed=n) for n in LENGTHS]


def greedy(n: int = MAX_TOKENS, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **options)


@pytest.fixture(scope="module")
def offline():
    with LLM("tiny", decode_steps=1, **PD_ENGINE) as llm:
        yield llm


# ------------------------------------------------------------------ both roles in-process
class Pair:
    """A prefill worker and a decode worker in this process, each an app on a loopback port."""

    def __init__(self, tiny_served, timeout_s: float = TIMEOUT_S, step_thread: bool = False):
        model, tokenizer = tiny_served
        config = EngineConfig(**PD_ENGINE)
        self.p_engine = make_engine("prefill", model, tokenizer, config)
        self.d_engine = make_engine("decode", model, tokenizer, config, timeout_s=timeout_s)
        self.idle_pages = (self.p_engine.cache.available_pages, self.d_engine.cache.available_pages)
        self.p_role = make_role(
            "prefill",
            AsyncEngine(self.p_engine, step_thread=step_thread),
            bootstrap_port=0,
            timeout_s=timeout_s,
        )
        self.d_role = make_role(
            "decode", AsyncEngine(self.d_engine, step_thread=step_thread), timeout_s=timeout_s
        )
        self.rooms = random.Random(7)

    def _client(self, role) -> test_utils.TestClient:
        served = ServedModel(
            name="tiny",
            tokenizer=self.p_engine.tokenizer,
            vocab_size=self.p_engine.model.config.vocab_size,
            max_model_len=PD_ENGINE["max_model_len"],
            chat_template=TEMPLATE,
        )
        config = ServerConfig(model_name="tiny", role=role.name)
        state = ServerState(role, served, config, Admission(config.max_pending))
        return test_utils.TestClient(test_utils.TestServer(build_app(state)))

    async def __aenter__(self) -> Pair:
        self.p = self._client(self.p_role)
        self.d = self._client(self.d_role)
        await self.p.start_server()
        await self.d.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.p.close()
            await self.d.close()
            await self.p_role.close()
            await self.d_role.close()
        finally:
            self.p_engine.close()
            self.d_engine.close()

    def with_room(self, body: dict, prompts: int = 1) -> dict:
        """The body as smg sends it to both workers (one room per prompt for a batch)."""
        rooms = [self.rooms.getrandbits(63) for _ in range(prompts)]
        port = self.p_role.bootstrap.port
        if prompts == 1:
            fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
            return {**body, **fields, "bootstrap_room": rooms[0]}
        return {
            **body,
            "bootstrap_host": ["127.0.0.1"] * prompts,
            "bootstrap_port": [port] * prompts,
            "bootstrap_room": rooms,
        }

    async def send(self, path: str, body: dict, order: str = "together", delay_s: float = 0.2):
        """POST `body` to both workers as smg does: "together", or one side `delay_s` after
        the other ("p_first" / "d_first"). Returns (prefill's (status, payload), decode's)."""

        async def post(client, wait: float):
            await asyncio.sleep(wait)
            async with client.post(path, json=body) as resp:
                if body.get("stream") and resp.status == 200:
                    return resp.status, await sse_events(resp)
                return resp.status, await resp.json()

        p_wait = delay_s if order == "d_first" else 0.0
        d_wait = delay_s if order == "p_first" else 0.0
        return await asyncio.gather(post(self.p, p_wait), post(self.d, d_wait))

    async def wait_idle(self) -> None:
        """Both engines idle and consistent: nothing running, held or awaited, every page free
        or cached, no rendezvous room open."""

        def idle() -> bool:
            p, d = self.p_engine, self.d_engine
            return (
                not p.has_unfinished()
                and not p.held()
                and p.transfers_in_flight == 0
                and not d.has_unfinished()
                and d.destinations_held == 0
                and (p.cache.available_pages, d.cache.available_pages) == self.idle_pages
                and self.p_role.bootstrap.rooms_open == 0
            )

        await wait_until(idle, "both P/D engines to be idle", timeout_s=30)
        for engine in (self.p_engine, self.d_engine):
            engine.check_integrity()
            load = engine.load()
            assert (load.running, load.waiting, load.used_pages) == (0, 0, 0), load


def as_prompt(p):
    return p if isinstance(p, str) else {"prompt_token_ids": p}


@pytest.mark.parametrize(
    ("order", "step_thread"),
    [("together", False), ("p_first", False), ("d_first", False), ("together", True)],
)
def test_both_roles_in_process_give_the_offline_greedy_tokens(
    tiny_served, offline, order, step_thread
):
    want = offline.generate([as_prompt(p) for p in PROMPTS], greedy(), use_tqdm=False)
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

    async def main():
        async with Pair(tiny_served, step_thread=step_thread) as pair:
            whole = await asyncio.gather(
                *(
                    pair.send("/v1/completions", pair.with_room({**body, "prompt": p}), order)
                    for p in PROMPTS
                )
            )
            stream = {**body, "stream": True}
            streamed = await asyncio.gather(
                *(
                    pair.send("/v1/completions", pair.with_room({**stream, "prompt": p}), order)
                    for p in PROMPTS[:3]
                )
            )
            await pair.wait_idle()
            return whole, streamed

    whole, streamed = run(main(), timeout_s=120)
    for out, ((p_status, p_body), (d_status, d_body)) in zip(want, whole, strict=True):
        assert p_status == 200, p_body
        assert d_status == 200, d_body
        choice = d_body["choices"][0]
        assert choice["token_ids"] == out.token_ids
        assert choice["text"] == out.text
        assert choice["finish_reason"] == "length"
        # The prefill worker answers with the first token (what smg reads for its status).
        assert p_body["choices"][0]["token_ids"] == out.token_ids[:1]
        assert d_body["usage"]["completion_tokens"] == MAX_TOKENS
    for out, ((p_status, _), (d_status, events)) in zip(want, streamed, strict=False):
        assert (p_status, d_status) == (200, 200)
        assert events[-1] == "[DONE]"
        got = joined(events)[0]
        assert got["token_ids"] == out.token_ids and got["text"] == out.text
        assert got["finish_reason"] == "length"


def test_chat_n_and_batches_each_meet_their_half(tiny_served, offline):
    """Chat; n = 2 (one room, completions k = 0, 1); a batch of prompts (a room per prompt)."""
    messages = [{"role": "user", "content": "Name three caches."}]
    chat_want = offline.chat([messages], greedy(), use_tqdm=False, chat_template=TEMPLATE)[0]
    batch = PROMPTS[:3]
    batch_want = offline.generate([as_prompt(p) for p in batch], greedy(), use_tqdm=False)
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

    async def main():
        async with Pair(tiny_served) as pair:
            chat = await pair.send(
                "/v1/chat/completions", pair.with_room({**body, "messages": messages})
            )
            chat_streamed = await pair.send(
                "/v1/chat/completions",
                pair.with_room({**body, "messages": messages, "stream": True}),
                "d_first",
            )
            two = await pair.send(
                "/v1/completions", pair.with_room({**body, "prompt": batch[1], "n": 2})
            )
            many = await pair.send(
                "/v1/completions", pair.with_room({**body, "prompt": batch}, prompts=3), "p_first"
            )
            await pair.wait_idle()
            return chat, chat_streamed, two, many

    chat, chat_streamed, two, many = run(main(), timeout_s=120)
    (p_status, _), (d_status, d_body) = chat
    assert (p_status, d_status) == (200, 200), d_body
    assert d_body["choices"][0]["message"]["content"] == chat_want.text
    assert d_body["choices"][0]["token_ids"] == chat_want.token_ids
    (_, _), (d_status, events) = chat_streamed
    assert joined(events, key="delta")[0]["text"] == chat_want.text
    (p_status, _), (d_status, d_body) = two
    assert (p_status, d_status) == (200, 200), d_body
    assert [c["token_ids"] for c in d_body["choices"]] == [batch_want[1].token_ids] * 2
    (p_status, _), (d_status, d_body) = many
    assert (p_status, d_status) == (200, 200), d_body
    got = sorted(d_body["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in got] == [o.token_ids for o in batch_want]


def test_requests_that_end_at_their_first_token(tiny_served, offline):
    """max_tokens 1 (the decode worker computes it itself) and a stop at the first token (only
    the prefill side sees it: it answers "finished", and the decode worker computes it)."""
    prompt = PROMPTS[0]
    first = offline.generate([as_prompt(prompt)], greedy(), use_tqdm=False)[0].token_ids[0]
    body = {"model": "tiny", "temperature": 0, "return_token_ids": True, "prompt": prompt}

    async def main():
        # Rooms of these requests stay open on the prefill side until the timeout, which
        # wait_idle waits for: 2 s here, not 4 (the late half comes 0.2 s after the other).
        async with Pair(tiny_served, timeout_s=2.0) as pair:
            local = []  # the requests the decode worker computed itself
            computed_here = pair.d_role._local

            def counted(rid, *args):
                local.append(rid)
                return computed_here(rid, *args)

            pair.d_role._local = counted
            one = await pair.send("/v1/completions", pair.with_room({**body, "max_tokens": 1}))
            stop = {**body, "max_tokens": 5, "stop_token_ids": [first]}
            stopped = await pair.send("/v1/completions", pair.with_room(stop), "p_first")
            stopped_late = await pair.send("/v1/completions", pair.with_room(stop), "d_first")
            await pair.wait_idle()
            assert len(local) == 3, local
            return one, stopped, stopped_late

    one, *stops = run(main(), timeout_s=120)
    (p_status, p_body), (d_status, d_body) = one
    assert (p_status, d_status) == (200, 200), (p_body, d_body)
    assert d_body["choices"][0]["token_ids"] == [first]
    assert d_body["choices"][0]["finish_reason"] == "length"
    for (p_status, p_body), (d_status, d_body) in stops:
        assert (p_status, d_status) == (200, 200), (p_body, d_body)
        assert d_body["choices"][0]["token_ids"] == [first]
        assert d_body["choices"][0]["finish_reason"] == "stop"


def test_a_request_without_bootstrap_fields_is_refused(tiny_served):
    async def main():
        async with Pair(tiny_served) as pair:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
            answers = []
            for client in (pair.p, pair.d):
                async with client.post("/v1/completions", json=body) as resp:
                    answers.append((resp.status, await resp.json()))
            bad = {**body, "bootstrap_room": 5}
            async with pair.d.post("/v1/completions", json=bad) as resp:
                answers.append((resp.status, await resp.json()))
            async with pair.d.post("/v1/completions", data=b"{not json") as resp:
                not_json = resp.status, await resp.json()
            await pair.wait_idle()
            return answers, not_json

    answers, not_json = run(main())
    for status, body in answers:
        assert status == 400 and "bootstrap" in body["error"]["message"], body
    assert not_json[0] == 400 and "not valid JSON" in not_json[1]["error"]["message"]


def test_a_half_without_its_partner_expires_and_frees_everything(tiny_served):
    """Sent to one worker only: each side gives up after its timeout, answers with an error,
    and holds nothing afterwards; a registration for a room whose request already ended here is
    answered at once."""
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "prompt": PROMPTS[2]}

    async def main():
        async with Pair(tiny_served, timeout_s=1.5) as pair:
            loop = asyncio.get_running_loop()
            start = loop.time()
            async with pair.p.post("/v1/completions", json=pair.with_room(body)) as resp:
                p_only = resp.status, await resp.json()
            p_took = loop.time() - start
            start = loop.time()
            async with pair.d.post("/v1/completions", json=pair.with_room(body)) as resp:
                d_only = resp.status, await resp.json()
            d_took = loop.time() - start
            await pair.wait_idle()
            return p_only, p_took, d_only, d_took

    p_only, p_took, d_only, d_took = run(main())
    assert p_only[0] == 500 and "no decode worker registered" in p_only[1]["error"]["message"]
    assert d_only[0] == 500 and "came in time" in d_only[1]["error"]["message"]
    assert p_took < 10 and d_took < 10


def test_a_client_leaving_mid_stream_aborts_on_decode_and_frees_its_cache(tiny_served):
    body = {
        "model": "tiny",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "prompt": PROMPTS[2],
    }

    async def main():
        async with Pair(tiny_served) as pair:
            sent = pair.with_room(body)
            prefill = asyncio.ensure_future(pair.p.post("/v1/completions", json=sent))
            resp = await pair.d.post("/v1/completions", json=sent)
            assert resp.status == 200
            chunks = 0
            async for line in resp.content:
                chunks += line.startswith(b"data: ")
                if chunks >= 3:
                    break
            assert pair.d_engine.has_unfinished()  # decoding, far from its 200 tokens
            resp.close()  # the client goes away mid-stream
            p_resp = await prefill
            assert p_resp.status == 200
            p_resp.release()
            await pair.wait_idle()
            return pair.d_engine.metrics

    run(main())


def test_a_client_leaving_before_the_handoff_frees_the_destination_at_once(tiny_served):
    """The decode client leaves while its request waits for the prefill side (which has not
    got it yet): the room is cancelled, the destination freed without waiting for its
    deadline, and the prefill request that comes later for the room is refused."""
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "prompt": PROMPTS[0]}

    async def main():
        async with Pair(tiny_served, timeout_s=3) as pair:
            sent = pair.with_room(body)
            decode = asyncio.ensure_future(pair.d.post("/v1/completions", json=sent))
            await wait_until(lambda: pair.p_role.bootstrap.rooms_open == 1, "the registration")
            assert pair.d_engine.destinations_held == 1
            decode.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decode
            # At once: not at its deadline plus grace (3 + 35 s).
            await wait_until(lambda: pair.d_engine.destinations_held == 0, "its release", 2.0)
            async with pair.p.post("/v1/completions", json=sent) as resp:
                late = resp.status, await resp.json()
            assert late[0] == 400 and "gave up" in late[1]["error"]["message"], late
            await pair.wait_idle()  # the cancelled room is forgotten after its 3 s

    run(main())


# ------------------------------------------------------------------ worker processes behind smg
needs_smg = pytest.mark.skipif(smg_missing() is not None, reason=str(smg_missing()))

# Text prompts: smg refuses token-id prompts. The second one is 120 tokens (the byte tokenizer).
TEXT_PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, "x" * 40]
MESSAGES = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Name three caches."}],
]
BOOTSTRAP_LINE = r"P/D bootstrap \(prefill side\) listening on 127\.0\.0\.1:(\d+)"
PD_TIMEOUT_S = 10  # the workers' --pd-timeout: how long a held prefill waits for its decode side


def start_pd(procs, *options: str) -> tuple[Gateway, Worker, Worker]:
    """A prefill worker and a decode worker (started at once), smg in P/D mode in front."""
    common = (*WORKER_OPTIONS, "--chat-template", TEMPLATE, "--pd-timeout", str(PD_TIMEOUT_S))
    prefill = procs.add(
        spawn_worker("--role", "prefill", "--bootstrap-port", "0", *common, name="prefill")
    )
    decode = procs.add(spawn_worker("--role", "decode", *common, *options, name="decode"))
    prefill.wait_listening()
    decode.wait_listening()
    bootstrap_port = int(prefill.wait_for_line(BOOTSTRAP_LINE, 10).group(1))
    routing = (
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        str(bootstrap_port),
        "--decode",
        decode.url,
    )
    gateway = launch_smg(routing, [prefill.url, decode.url], procs=procs)
    return gateway, prefill, decode


@pytest.fixture(scope="module")
def pd_gateway():
    """(smg, prefill worker, decode worker), shared by the module's smg tests (the last one
    kills the decode worker); every process stopped by PID at the end, whatever happened."""
    if smg_missing() is not None:
        pytest.skip(smg_missing())
    with stopping() as procs:
        yield start_pd(procs)


def engine_load(worker: Worker) -> dict:
    """The worker's own load snapshot (GET /v1/loads, under "tokenspeed")."""
    status, body = http_json("GET", worker.url + "/v1/loads", timeout_s=10)
    assert status == 200, body
    return body.get("tokenspeed", body)


def holds_nothing(worker: Worker) -> bool:
    load = engine_load(worker)
    return (load["running"], load["waiting"], load["used_pages"]) == (0, 0, 0)


def settled(worker: Worker, timeout_s: float) -> None:
    """Wait until the worker holds nothing (no request running, queued or held, no page used);
    then its integrity check passes."""
    what = f"{worker.name} to hold nothing"
    processes.wait_until(lambda: holds_nothing(worker), what, timeout_s, worker)
    status, body = http_json("GET", worker.url + "/health?integrity=1", timeout_s=10)
    assert (status, body.get("integrity")) == (200, "ok"), body


@pytest.fixture(scope="module")
def text_reference():
    with LLM("tiny", decode_steps=1, **ENGINE) as llm:
        completions = llm.generate(TEXT_PROMPTS, greedy(), use_tqdm=False)
        chats = llm.chat(MESSAGES, greedy(), use_tqdm=False, chat_template=TEMPLATE)
    return completions, chats


@needs_smg
def test_greedy_outputs_through_smg_equal_the_offline_api(pd_gateway, text_reference):
    smg, prefill, decode = pd_gateway
    completions, chats = text_reference
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

    out = run(gateway_outputs(smg.url, body, TEXT_PROMPTS, MESSAGES))
    check_gateway_outputs(out, completions, chats)
    for worker in (prefill, decode):
        settled(worker, 10)


@needs_smg
def test_a_client_leaving_mid_stream_through_smg_frees_the_decode_cache(pd_gateway):
    smg, prefill, decode = pd_gateway
    body = {
        "model": "tiny",
        "prompt": TEXT_PROMPTS[1],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            resp = await http.post(smg.url + "/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data: ")
                if events >= 3:
                    break
            resp.close()  # the client goes away mid-stream
            return events

    assert run(main()) == 3
    settled(decode, 10)  # the request aborted there, its cache freed
    settled(prefill, 10)


@needs_smg
def test_a_killed_decode_worker_fails_its_requests_fast_and_the_prefill_worker_frees_them(
    pd_gateway,
):
    """Streams decoding on the decode worker; the decode worker stopped (SIGSTOP: it neither
    answers nor registers) while more requests come, which the prefill worker prefills and
    holds; then SIGKILL. Every client gets its error within seconds; the prefill worker frees
    what it held by its --pd-timeout, and its integrity check passes. The module's last test."""
    smg, prefill, decode = pd_gateway
    body = {"model": "tiny", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def one(http, prompt: str, stream: bool, started: asyncio.Event | None) -> tuple:
        loop = asyncio.get_running_loop()
        try:
            async with http.post(
                smg.url + "/v1/completions", json={**body, "prompt": prompt, "stream": stream}
            ) as r:
                if started is not None:
                    await r.content.readline()  # the first event: decoding on the decode side
                    started.set()
                text = await r.text()
                return r.status, text, loop.time()
        except aiohttp.ClientError as exc:
            return None, repr(exc), loop.time()

    async def main():
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            decoding = [asyncio.Event() for _ in range(3)]
            tasks = [
                asyncio.ensure_future(one(http, f"stream {i} " * 8, True, decoding[i]))
                for i in range(3)
            ]
            for started in decoding:
                await asyncio.wait_for(started.wait(), 30)
            os.kill(decode.pid, signal.SIGSTOP)
            tasks += [
                asyncio.ensure_future(one(http, f"held {i} " * 6, i % 2 == 0, None))
                for i in range(4)
            ]

            def held() -> bool:
                load = engine_load(prefill)
                return load["used_pages"] > 0 and load["running"] == load["waiting"] == 0

            await asyncio.to_thread(
                processes.wait_until, held, "the prefill worker to hold requests", 10, prefill
            )
            os.kill(decode.pid, signal.SIGKILL)
            killed = loop.time()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return killed, results

    killed, results = run(main())
    decode.proc.wait(timeout=30)
    for status, text, ended in results:
        assert ended - killed < 15, (status, text)  # fast: no hang until a timeout
        # Never a whole answer (400 tokens, ignore_eos: it would end with "length").
        assert status != 200 or '"finish_reason":"length"' not in text, (status, text[-300:])
    # The held requests are freed once they waited --pd-timeout for their decode side.
    settled(prefill, PD_TIMEOUT_S + 15)


def test_a_bootstrap_port_in_use_is_an_error_not_a_traceback(capsys):
    before = torch.get_num_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = ["--role", "prefill", "--bootstrap-port", str(port), "--port", "0"]
        try:
            code = main(["serve", "tiny", *args, "--device", "cpu", "--max-model-len", "256"])
        finally:
            torch.set_num_threads(before)  # the command sets torch's (process-wide) threads
    assert code == 2
    assert f"cannot listen for P/D bootstrap on 127.0.0.1:{port}" in capsys.readouterr().err
