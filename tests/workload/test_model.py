import math

import pytest

from tokenspeed.workload import Turn


@pytest.mark.parametrize(
    ("new", "out"), [(10.5, 4), (10, 4.0), (True, 4), (10, True), ("10", 4), (10, None)]
)
def test_turn_token_counts_must_be_integers(new, out):
    with pytest.raises(ValueError, match="new_tokens and output_tokens must be integers"):
        Turn(new_tokens=new, output_tokens=out)


@pytest.mark.parametrize(("new", "out"), [(0, 4), (10, 0), (-1, 4)])
def test_turn_token_counts_must_be_positive(new, out):
    with pytest.raises(ValueError, match="new_tokens > 0 and output_tokens > 0"):
        Turn(new_tokens=new, output_tokens=out)


@pytest.mark.parametrize("delay", [-0.5, math.nan, math.inf, True, "1"])
def test_turn_delay_must_be_finite_and_non_negative(delay):
    with pytest.raises(ValueError, match="delay_s must be finite and >= 0"):
        Turn(new_tokens=10, output_tokens=4, delay_s=delay)


def test_valid_turn():
    turn = Turn(new_tokens=10, output_tokens=4, delay_s=1)
    assert (turn.new_tokens, turn.output_tokens, turn.delay_s) == (10, 4, 1)
