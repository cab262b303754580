"""Randomised scenarios through the engine: arrivals while others run, follow-up turns of earlier
conversations, stop tokens, seeded sampling, aborts at any point, tight caches that force
preemption, L2 on and off, single- and multi-step decoding, outputs cut at `max_model_len`, and
two engines sharing one host tier. Whatever happens, every request ends exactly once with the
tokens it gets when it runs alone (greedy: the model's own decoding; seeded sampling: a fresh
engine serving only it), a prefix of them when aborted; the cache checks out after every step,
and everything it held is back when the engine is idle.

The model is the tiny one with its routers' expert preferences spaced far apart (`steady`).
Batching a request differently (a prefill in 16-token pieces here, in one piece in the reference)
moves fp32 activations by ~1e-6, and in the plain tiny model that is enough, now and then, to swap
two experts whose router scores tie to 1e-7 (seen at seed 37: scores 0.7186442 / 0.7186441), after
which the continuations part for good. That is arithmetic, not a serving bug; the fixed routing
keeps such ties out of this test, whose subject is the engine, the cache and the scheduler (the
tests in test_engine.py use the plain model on prompts without such ties).
"""

import random

import pytest

from .scenarios import play, play_async, play_shared_l2


@pytest.mark.parametrize("seed", range(4))
def test_random_scenarios_end_every_request_exactly(steady, seed):
    play(steady, seed)


@pytest.mark.parametrize("seed", range(3))
def test_random_async_clients_all_end_and_leave_the_engine_idle(steady, seed):
    play_async(steady, seed)


def test_random_async_clients_with_the_step_on_a_worker_thread(steady):
    """Consumers arrive, leave, cancel and abort while steps run on the worker thread (and the
    engine's device work fails at random): every consumer ends, the others' tokens are exact."""
    assert play_async(steady, 0, num_requests=6, failures=0.1, step_thread=True) > 0


def test_two_engines_sharing_an_l2_hand_turns_to_each_other(steady):
    crossed = sum(play_shared_l2(steady, seed) for seed in range(3))
    assert crossed > 0  # some turns reused a history the other engine had published


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_many_pairs_of_engines_sharing_an_l2(steady, seed):
    play_shared_l2(steady, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 30))
def test_many_random_async_clients_all_end_and_leave_the_engine_idle(steady, seed):
    play_async(steady, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 12))
def test_many_random_async_clients_with_the_step_on_a_worker_thread(steady, seed):
    play_async(
        steady, seed, failures=random.Random(seed).choice([0.0, 0.03, 0.1]), step_thread=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 60))
def test_many_random_scenarios_end_every_request_exactly(steady, seed):
    play(steady, seed, num_requests=20)
