"""How many forwards a plan takes, and multi-step ITLs shared out (pure functions)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenspeed.runtime.metrics import EngineMetrics
from tokenspeed.runtime.step_plan import forwards_in, is_multi_step, prefill_pieces


def _chunk(start, end, checkpoints=()):
    return SimpleNamespace(start=start, end=end, checkpoints=tuple(checkpoints))


def _plan(chunks=None, decode_steps=None):
    prefill = SimpleNamespace(chunks=chunks) if chunks is not None else None
    decode = SimpleNamespace(steps=decode_steps) if decode_steps is not None else None
    return SimpleNamespace(prefill=prefill, decode=decode)


def test_prefill_chunks_are_cut_at_interior_checkpoints_only():
    batch = SimpleNamespace(chunks=[_chunk(0, 100, [0, 32, 64, 100]), _chunk(16, 40)])
    assert prefill_pieces(batch) == [[(0, 32), (32, 64), (64, 100)], [(16, 40)]]


@pytest.mark.parametrize(
    ("plan", "forwards", "multi"),
    [
        (_plan(), 0, False),
        (_plan([_chunk(0, 100, [32, 64])]), 3, False),  # three rounds of pieces
        (_plan([_chunk(0, 100, [32])], decode_steps=4), 2 + 1, False),  # prefill pending: 1
        (_plan(decode_steps=1), 1, False),
        (_plan(decode_steps=4), 4, True),
    ],
)
def test_forwards_of_a_plan(plan, forwards, multi):
    assert forwards_in(plan) == forwards and is_multi_step(plan) == multi


def test_a_multi_step_runs_tokens_share_the_time_since_the_previous_one():
    m = EngineMetrics()
    m.record_run_itls(prev=1.0, first_token_time=0.5, last_token_time=2.0, new=4)
    assert m.itls == [0.25] * 4
    m = EngineMetrics()  # the run's first token was the request's first: a TTFT, not an ITL
    m.record_run_itls(prev=None, first_token_time=1.0, last_token_time=2.5, new=4)
    assert m.itls == [0.5] * 3
