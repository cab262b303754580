"""The AgentX replay (`tokenspeed bench agentx`) refuses arguments it cannot run with."""

import math
from types import SimpleNamespace

import pytest

from tokenspeed.runtime.agentx_replay import ReplayError, agentx_sessions, replay


class _IdleEngine:
    """Just enough of an Engine for `replay` to start; stepping it means the replay submitted
    nothing and would step an idle engine forever."""

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=512))
    config = SimpleNamespace(max_model_len=4096)

    def add_request(self, *args, **kwargs):
        raise AssertionError("replay submitted a request")

    def step(self):
        raise AssertionError("replay stepped an engine with nothing submitted")


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
def test_replay_refuses_a_concurrency_that_runs_nothing(concurrency):
    sessions, block = agentx_sessions(1, 0, 1 / 128, 1)
    # A ValueError (ReplayError) for library callers, not only for the command.
    message = f"concurrency must be a positive integer, got {concurrency}"
    with pytest.raises(ValueError, match=message):
        replay(_IdleEngine(), sessions, concurrency, block)


def test_replay_refuses_a_block_size_below_one():
    sessions, _ = agentx_sessions(1, 0, 1 / 128, 1)
    with pytest.raises(ReplayError, match="block_size must be a positive integer, got 0"):
        replay(_IdleEngine(), sessions, 2, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_sessions": 0}, "num_sessions must be a positive integer, got 0"),
        ({"max_turns": 0}, "max_turns must be a positive integer, got 0"),
        ({"max_turns": -2}, "max_turns must be a positive integer, got -2"),
        ({"scale": 0.0}, "scale must be a finite number > 0, got 0.0"),
        ({"scale": -1.0}, "scale must be a finite number > 0, got -1.0"),
        ({"scale": math.inf}, "scale must be a finite number > 0, got inf"),
        ({"scale": 1e-6}, "scale 1e-06 leaves no usable AgentX workload"),
    ],
)
def test_agentx_sessions_refuses_counts_and_scales_that_make_no_workload(kwargs, message):
    args = {"num_sessions": 2, "seed": 0, "scale": 1 / 128, "max_turns": 2} | kwargs
    with pytest.raises(ReplayError, match=message):
        agentx_sessions(**args)
