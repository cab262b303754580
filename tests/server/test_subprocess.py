"""`tokenspeed serve` as a process: real TCP on loopback, a port picked at run time (--port 0,
printed), the API key, greedy tokens equal to the offline API's, and a graceful SIGTERM while
a stream is in flight. The process is stopped by PID whatever happens."""

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

from tokenspeed import LLM, SamplingParams

from ..processes import alarm, pid_gone

OPTIONS = ["--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8"]
KEY = "test-key"


def start_server() -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TOKENSPEED_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenspeed.cli",
            "serve",
            "tiny",
            "--port",
            "0",
            "--api-key",
            KEY,
            *OPTIONS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(r"serving tiny on http://127\.0\.0\.1:(\d+) ", line)
        if found:
            return proc, int(found.group(1))
    stop(proc)
    raise AssertionError(f"the server did not announce its port: {''.join(seen)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def post(port: int, path: str, body: dict, key: str | None = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, json.dumps(body), headers)
    return conn, conn.getresponse()


def test_serve_answers_over_tcp_and_stops_gracefully_on_sigterm():
    prompt = "Hello over TCP"
    with LLM("tiny", device="cpu", max_model_len=512, max_num_seqs=8, decode_steps=1) as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
            0
        ]
    with alarm(120):
        proc, port = start_server()
        try:
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "return_token_ids": True,
            }
            conn, resp = post(port, "/v1/completions", body, key=None)
            assert resp.status == 401
            conn.close()
            conn, resp = post(port, "/v1/completions", body)
            assert resp.status == 200
            answer = json.loads(resp.read())
            conn.close()
            assert answer["choices"][0]["token_ids"] == want.token_ids
            assert answer["choices"][0]["text"] == want.text

            # A long stream in flight when SIGTERM comes: it ends with an error event and
            # [DONE], and the process exits by itself.
            long = {**body, "max_tokens": 450, "ignore_eos": True, "stream": True}
            conn, resp = post(port, "/v1/completions", long)
            assert resp.status == 200
            first = resp.readline()
            assert first.startswith(b"data: ")
            os.kill(proc.pid, signal.SIGTERM)
            rest = resp.read().decode()  # to the end of the stream
            conn.close()
            assert rest.rstrip().endswith("data: [DONE]")
            assert "shutting down" in rest
            assert proc.wait(timeout=30) == 0
            assert pid_gone(proc.pid)
        finally:
            stop(proc)
