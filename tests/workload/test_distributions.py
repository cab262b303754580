import math

import numpy as np
import pytest

from tokenspeed.workload import LogNormal


def test_sample_int_never_goes_below_ceil_low():
    dist = LogNormal(3, 1, low=1)  # about a third of raw draws are below 0.5
    rng = np.random.default_rng(0)
    draws = [dist.sample_int(rng) for _ in range(2000)]
    assert min(draws) == 1 and all(isinstance(d, int) for d in draws)


def test_clip_bounds_are_applied():
    dist = LogNormal(100, 50, low=20, high=80)
    rng = np.random.default_rng(1)
    draws = [dist.sample(rng) for _ in range(2000)]
    assert min(draws) == 20 and max(draws) == 80


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (-1, math.inf),
        (5, 4),
        (math.inf, math.inf),
        (math.nan, math.inf),
        (1, math.nan),
        (True, math.inf),
        ("1", math.inf),
    ],
)
def test_impossible_clip_bounds_are_rejected(low, high):
    with pytest.raises(ValueError, match="0 <= low <= high with a finite low"):
        LogNormal(100, 50, low=low, high=high)


def test_zero_low_is_a_valid_distribution():
    # Delays may be clipped at 0; token counts are held to low >= 1 by their configs.
    assert LogNormal(2.5, 1.8, low=0).low == 0
