"""What serving over HTTP costs: the web framework alone, then the whole `tokenspeed serve` worker.

Two sections:

`frameworks`: the per-request overhead of the candidate HTTP stacks with no engine behind them.
Each server runs in a subprocess on a loopback port and answers two endpoints: POST /echo (parse
a small JSON body, answer a small JSON object: an OpenAI non-streaming call without the model)
and POST /stream (an SSE response of `--events` small `data:` chunks, then `data: [DONE]`: a
streaming call). One aiohttp client process drives them; per stack it reports the mean latency
of one request at concurrency 1 (the per-request overhead), requests/s at concurrency 32, and SSE
events/s at concurrency 32. Stacks: aiohttp (installed with the project), and FastAPI on uvicorn
(with uvloop and httptools, uvicorn's "standard" set) when importable:

    pip install fastapi 'uvicorn[standard]'   # only for this comparison
    python benchmarks/serve_overhead.py frameworks

`worker`: streamed tokens/s through a `tokenspeed serve` subprocess (HTTP, SSE, real TCP on
loopback, the client in this process) against the in-process `AsyncEngine` on the same prompts
and engine options, at each concurrency of `--concurrency` (tiny preset on the CPU by default),
and the ratio worker / in-process; with `--gateway`, also through `smg` (the gateway, started
in front of the worker with round-robin routing) on the same prompts:

    python benchmarks/serve_overhead.py worker [--concurrency 1,32,128] [--new 64] [--gateway]

Prompts are text (random lowercase letters, one byte token each under the tiny preset's byte
tokenizer), as an OpenAI client sends them: smg refuses token-id prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time

# ---------------------------------------------------------------------------------- frameworks

SMALL_BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 16, "temperature": 0}
EVENT = {
    "id": "cmpl-0",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
}


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def _serve_aiohttp(sock: socket.socket, events: int) -> None:
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": "x", "object": "echo", "prompt": body["prompt"]})

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b"data: " + json.dumps(EVENT).encode() + b"\n\n"
        for _ in range(events):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    web.run_app(app, sock=sock, print=None, access_log=None)


def _serve_fastapi(sock: socket.socket, events: int) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    async def echo(request):
        body = await request.json()
        return JSONResponse({"id": "x", "object": "echo", "prompt": body["prompt"]})

    async def stream(request):
        await request.json()
        chunk = b"data: " + json.dumps(EVENT).encode() + b"\n\n"

        async def gen():
            for _ in range(events):
                yield chunk
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    # Annotations as objects (this module's are strings, which FastAPI would resolve against
    # the module's globals, where Request is not): FastAPI then injects the request.
    for handler, path in ((echo, "/echo"), (stream, "/stream")):
        handler.__annotations__ = {"request": Request}
        app.post(path)(handler)

    config = uvicorn.Config(
        app, loop="uvloop", http="httptools", log_level="warning", access_log=False
    )
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


STACKS = {"aiohttp": _serve_aiohttp, "fastapi": _serve_fastapi}


def _stack_version(name: str) -> str | None:
    try:
        if name == "aiohttp":
            import aiohttp

            return f"aiohttp {aiohttp.__version__}"
        import fastapi
        import uvicorn
        import uvloop  # noqa: F401  (the stack measured runs on it)

        return f"fastapi {fastapi.__version__} + uvicorn {uvicorn.__version__} (uvloop, httptools)"
    except ImportError:
        return None


def _start(argv: list[str], timeout_s: float = 120.0) -> tuple[subprocess.Popen, int]:
    """A server subprocess that prints its port on its first stdout line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("port "):
            return proc, int(line.split()[1])
        found = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
        if found:  # tokenspeed serve
            return proc, int(found.group(1))
    _stop(proc)
    raise RuntimeError(f"{argv} did not report its port")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


async def _drive(url: str, body: dict, requests: int, concurrency: int, sse: bool) -> dict:
    import aiohttp

    latencies: list[float] = []
    events = 0
    todo = iter(range(requests))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal events
        for _ in todo:
            start = time.perf_counter()
            async with session.post(url, json=body) as resp:
                resp.raise_for_status()
                if sse:
                    async for line in resp.content:
                        if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                            events += 1
                else:
                    await resp.read()
            latencies.append(time.perf_counter() - start)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, 8))))  # warm
        latencies.clear()
        events = 0
        todo = iter(range(requests))
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "req_s": requests / wall,
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "events_s": events / wall,
    }


def frameworks(args: argparse.Namespace) -> int:
    rows = []
    for name in STACKS:
        version = _stack_version(name)
        if version is None:
            print(f"{name}: not installed, skipped", flush=True)
            continue
        proc, port = _start(
            [sys.executable, __file__, "_stack", name, "--events", str(args.events)]
        )
        try:
            base = f"http://127.0.0.1:{port}"
            one = asyncio.run(_drive(f"{base}/echo", SMALL_BODY, args.requests // 4, 1, False))
            cpu = _cpu_seconds(proc.pid)
            many = asyncio.run(_drive(f"{base}/echo", SMALL_BODY, args.requests, 32, False))
            cpu_request = (_cpu_seconds(proc.pid) - cpu) / args.requests
            cpu = _cpu_seconds(proc.pid)
            sse = asyncio.run(_drive(f"{base}/stream", SMALL_BODY, args.requests // 8, 32, True))
            cpu_event = (_cpu_seconds(proc.pid) - cpu) / (args.requests // 8 * args.events)
        finally:
            _stop(proc)
        row = (
            version,
            one["mean_ms"] * 1e3,
            many["req_s"],
            cpu_request * 1e6,
            sse["events_s"],
            cpu_event * 1e6,
        )
        rows.append(row)
        print(
            f"{version}: {row[1]:.0f} us per request at concurrency 1; at 32: {row[2]:.0f} "
            f"req/s, server CPU {row[3]:.0f} us per request, {row[4]:.0f} SSE events/s, "
            f"server CPU {row[5]:.1f} us per event",
            flush=True,
        )
    _print_machine()
    print(
        "| stack | latency c=1 (us) | req/s c=32 | server CPU us / request | SSE events/s c=32 "
        "| server CPU us / event |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for version, us, req_s, cpu_req, events_s, cpu_ev in rows:
        print(
            f"| {version} | {us:.0f} | {req_s:.0f} | {cpu_req:.0f} | {events_s:.0f} "
            f"| {cpu_ev:.1f} |"
        )
    return 0


# ---------------------------------------------------------------------------------- worker


def _engine_config(args: argparse.Namespace):
    from tokenspeed.runtime import EngineConfig

    return EngineConfig(
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.prompt_len + args.new + 64,
        cpu_threads=1,
    )


def _prompts(count: int, length: int, seed: int) -> list[str]:
    """Random text prompts of `length` lowercase letters (one token each for the byte tokenizer)."""
    import random
    import string

    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=length)) for _ in range(count)]


async def _in_process(engine, prompts: list[str], new: int) -> float:
    """Streamed tokens/s of the prompts, all at once, through an in-process AsyncEngine."""
    from tokenspeed.runtime import SamplingParams
    from tokenspeed.runtime.async_engine import AsyncEngine

    server = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    async def one(i: int, prompt: str) -> int:
        count = 0
        ids = engine.tokenizer.encode(prompt)
        async for out in server.generate(f"r{i}-{time.monotonic_ns()}", ids, params):
            count = len(out.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    await server.wait_idle()
    assert sum(counts) == len(prompts) * new, counts
    return sum(counts) / wall


async def _through_worker(port: int, prompts: list[str], new: int) -> float:
    """Streamed tokens/s of the prompts, all at once, through the worker (or the gateway in
    front of it) at `port` (SSE over TCP); the tokens are counted from the `token_ids` of the
    chunks."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(session: aiohttp.ClientSession, prompt: str) -> int:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        count = 0
        async with session.post(url, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    count += len(json.loads(line[6:])["choices"][0]["token_ids"])
        return count

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, p) for p in prompts))
        wall = time.perf_counter() - start
    assert sum(counts) == len(prompts) * new, counts
    return sum(counts) / wall


def worker(args: argparse.Namespace) -> int:
    import torch

    from tokenspeed.runtime import Engine
    from tokenspeed.runtime.llm import load_model

    torch.set_num_threads(1)
    levels = [int(c) for c in args.concurrency.split(",")]
    config = _engine_config(args)
    model, tokenizer = load_model("tiny", device="cpu")
    engine = Engine(model, tokenizer, config)
    command = [
        sys.executable, "-m", "tokenspeed.cli", "serve", "tiny", "--port", "0",
        "--device", "cpu", "--threads", "1", "--max-num-seqs", str(config.max_num_seqs),
        "--max-model-len", str(config.max_model_len), "--max-pending", "100000",
    ]  # fmt: skip
    proc, port = _start(command)
    gateway = None
    rows = []
    try:
        if args.gateway:
            gateway, gateway_port = _start_smg(port)
        warm = _prompts(8, args.prompt_len, seed=10**6)  # first steps, compilation: not timed
        asyncio.run(_in_process(engine, warm, args.new))
        asyncio.run(_through_worker(port, warm, args.new))
        sides = {
            "in-process": lambda p: asyncio.run(_in_process(engine, p, args.new)),
            "worker": lambda p: asyncio.run(_through_worker(port, p, args.new)),
        }
        if gateway is not None:
            asyncio.run(_through_worker(gateway_port, warm, args.new))
            sides["smg"] = lambda p: asyncio.run(_through_worker(gateway_port, p, args.new))
        for c in levels:
            figures: dict[str, list[float]] = {name: [] for name in sides}
            for rep in range(args.repeats):
                prompts = _prompts(c, args.prompt_len, seed=1000 * c + rep)  # fresh: no hits
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                got = {name: sides[name](prompts) for name in order}
                for name, value in got.items():
                    figures[name].append(
                        value / got["in-process"] if name != "in-process" else value
                    )
                print(
                    f"concurrency {c}, repeat {rep}: "
                    + ", ".join(f"{name} {value:.0f} tok/s" for name, value in got.items()),
                    flush=True,
                )
            rows.append((c, {name: statistics.median(v) for name, v in figures.items()}))
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(proc)
        engine.close()
    import aiohttp

    _print_machine()
    print(
        f"tiny preset on the CPU (torch {torch.__version__}, aiohttp {aiohttp.__version__}), "
        f"prompts of {args.prompt_len} random tokens, {args.new} new tokens each (greedy, EOS "
        f"ignored), max_num_seqs {config.max_num_seqs}, median of {args.repeats} runs"
    )
    through = [name for name in rows[0][1] if name != "in-process"]
    print(
        "| concurrency | in-process AsyncEngine tok/s | "
        + " | ".join(f"{name} / in-process" for name in through)
        + " |"
    )
    print("|---:|---:|" + "---:|" * len(through))
    for c, medians in rows:
        ratios = " | ".join(f"{medians[name]:.3f}" for name in through)
        print(f"| {c} | {medians['in-process']:.0f} | {ratios} |")
    return 0


def _start_smg(worker_port: int, timeout_s: float = 60.0) -> tuple[subprocess.Popen, int]:
    """smg in front of the worker (round-robin over its one worker), once it serves the model."""
    import shutil
    import urllib.request

    binary = shutil.which("smg")
    if binary is None:
        raise SystemExit("--gateway needs smg (pip install smg)")
    with _listening_socket() as sock:  # a free port, released for smg to bind
        port = sock.getsockname()[1]
    command = [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--worker-urls", f"http://127.0.0.1:{worker_port}",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if b'"tiny"' in r.read():
                    return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"smg did not serve the worker's model within {timeout_s:.0f} s")


def _print_machine() -> None:
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="section", required=True)
    fw = sub.add_parser("frameworks", help="the HTTP stacks alone")
    fw.add_argument("--requests", type=int, default=4000)
    fw.add_argument("--events", type=int, default=32)
    wk = sub.add_parser("worker", help="tokenspeed serve against the in-process AsyncEngine")
    wk.add_argument("--concurrency", default="1,32,128", help="comma-separated client counts")
    wk.add_argument("--prompt-len", type=int, default=32)
    wk.add_argument("--new", type=int, default=64)
    wk.add_argument("--max-num-seqs", type=int, default=128)
    wk.add_argument("--repeats", type=int, default=3)
    wk.add_argument("--gateway", action="store_true", help="also through smg in front")
    stack = sub.add_parser("_stack")  # internal: one framework's server (a subprocess)
    stack.add_argument("name", choices=sorted(STACKS))
    stack.add_argument("--events", type=int, default=32)
    args = parser.parse_args(argv)
    if args.section == "_stack":
        sock = _listening_socket()
        print(f"port {sock.getsockname()[1]}", flush=True)
        STACKS[args.name](sock, args.events)
        return 0
    return frameworks(args) if args.section == "frameworks" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
