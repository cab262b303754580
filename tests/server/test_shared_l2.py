"""Two `tokenspeed serve` workers sharing one host tier (L2) through a Mooncake store: a session's
first turn runs on worker A, its second turn goes straight to worker B, which has never seen it
and still finds the first turn's prefix (loaded from the shared tier, with the offline API's
greedy continuation). Then the Mooncake master dies and both workers go on serving, every L2
lookup a miss. Also the --l2 flags refused before any model loads.

The master and segment owner are started by the test (`mooncake_services`, loopback, free
ports); they and the workers are stopped by PID whatever happens."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.cache.l2.mooncake_services import (
    environment_ready,
    free_port,
    start_master,
    start_segment_owner,
)
from tokenspeed.cli import main

from ..processes import prompt_ids
from .conftest import ENGINE
from .processes import WORKER_OPTIONS, http_json, http_text, prometheus, start_workers, stopping

needs_mooncake = pytest.mark.skipif(
    environment_ready() is not None, reason=str(environment_ready())
)

PAGE = ENGINE["page_size"]
# Two sessions: a first turn (prompt ids), then the prompt + the reply + a new user message.
FIRST, OTHER = prompt_ids(2, seed=7, low=90, high=120)
MORE = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
REPLY_TOKENS, NEXT_TOKENS = 24, 8


@pytest.fixture(scope="module")
def reference():
    """Per session, the offline API's greedy turns on one engine: (reply ids, second prompt, its
    reply, the second prompt's tokens found cached)."""
    out = {}
    with LLM("tiny", decode_steps=1, **ENGINE) as llm:
        for name, prompt in (("first", FIRST), ("other", OTHER)):
            params = SamplingParams(temperature=0, max_tokens=REPLY_TOKENS, ignore_eos=True)
            reply = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            second = prompt + reply.token_ids + MORE
            params = SamplingParams(temperature=0, max_tokens=NEXT_TOKENS)
            again = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
            out[name] = (reply.token_ids, second, again.token_ids, again.metrics.cached_tokens)
    return out


def complete(worker, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }
    status, answer = http_json("POST", worker.url + "/v1/completions", body, timeout_s=60)
    assert status == 200, answer
    return answer


def metric(worker, name: str) -> float:
    return prometheus(http_text(worker.url + "/metrics")).get(name, 0.0)


@needs_mooncake
def test_a_second_turn_on_another_worker_hits_the_shared_tier_and_a_dead_master_costs_hits(
    reference,
):
    with stopping() as procs:
        master = procs.add(start_master())
        procs.add(start_segment_owner(master_address=master.address, segment_bytes=64 << 20))
        namespace = f"test-{uuid.uuid4().hex[:12]}"  # objects of no earlier run
        a, b = start_workers(
            2,
            *WORKER_OPTIONS,
            "--l2",
            "mooncake",
            "--l2-master",
            master.address,
            "--l2-namespace",
            namespace,
            procs=procs,
        )

        reply, second, want, one_engine_hit = reference["first"]
        first = complete(a, FIRST, REPLY_TOKENS, ignore_eos=True)
        assert first["choices"][0]["token_ids"] == reply
        assert metric(a, "tokenspeed_l2_objects_published_total") > 0  # the turn end, in L2
        hits_before = metric(b, "tokenspeed_l2_hit_tokens_total")
        turn2 = complete(b, second, NEXT_TOKENS)
        cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(FIRST) // PAGE * PAGE > 0
        assert cached == one_engine_hit  # as much as the turn's own engine would have found
        # B never saw the session: every cached token came from the shared tier.
        assert metric(b, "tokenspeed_l2_hit_tokens_total") - hits_before == cached
        assert metric(b, 'tokenspeed_l2_gets_total{result="hit"}') > 0
        assert turn2["choices"][0]["token_ids"] == want

        # The master dies: both workers keep serving, their L2 lookups all misses.
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait(timeout=30)
        errors_before = metric(a, "tokenspeed_l2_errors_total") + metric(
            b, "tokenspeed_l2_errors_total"
        )
        reply, second, want, _ = reference["other"]
        started = time.monotonic()
        first = complete(a, OTHER, REPLY_TOKENS, ignore_eos=True)
        turn2 = complete(b, second, NEXT_TOKENS)
        assert time.monotonic() - started < 30
        assert first["choices"][0]["token_ids"] == reply
        assert turn2["choices"][0]["token_ids"] == want  # computed afresh: the same tokens
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        errors = metric(a, "tokenspeed_l2_errors_total") + metric(b, "tokenspeed_l2_errors_total")
        assert errors > errors_before  # the failed store calls, counted
        for w in (a, b):
            status, health = http_json("GET", w.url + "/health?integrity=1")
            assert (status, health) == (200, {"status": "ok", "integrity": "ok"})


# ------------------------------------------------------------------ the flags, refused early
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--l2", "mooncake"], "--l2 mooncake needs --l2-master HOST:PORT"),
        (["--l2", "local", "--l2-master", "127.0.0.1:5000"], "give --l2 mooncake"),
        (["--l2", "none", "--l2-master", "127.0.0.1:5000"], "give --l2 mooncake"),
    ],
)
def test_l2_flags_that_do_not_go_together_exit_with_status_2(capsys, args, words):
    assert main(["serve", "tiny", *args]) == 2
    assert words in capsys.readouterr().err


def test_a_bad_l2_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "tiny", "--l2", "redis"])
    assert exc.value.code == 2
    assert "invalid choice: 'redis'" in capsys.readouterr().err


@needs_mooncake
def test_a_master_nobody_answers_at_is_refused_before_the_model_loads(capsys):
    port = free_port()  # free a moment ago: nothing listens there
    started = time.monotonic()
    assert main(["serve", "tiny", "--l2-master", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"--l2-master='127.0.0.1:{port}': no Mooncake master answers there" in err
    assert time.monotonic() - started < 10
