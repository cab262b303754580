"""`SamplingParams`' vLLM fields (n, penalties, min_tokens): their ranges, refused by name."""

import pytest

from tokenspeed.runtime import SamplingError, SamplingParams


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("n", [0, -1, 1.5, True, None]),
        ("presence_penalty", [-2.01, 2.5, float("nan"), float("inf"), True, "1"]),
        ("frequency_penalty", [-3, 2.0001, float("-inf"), False, None]),
        ("repetition_penalty", [0, -1.0, float("inf"), float("nan"), True, 10**400]),
        ("min_tokens", [-1, 1.5, True, None, 17]),  # 17 > max_tokens (16 by default)
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field, bad):
    for value in bad:
        with pytest.raises(SamplingError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})


def test_the_range_bounds_and_defaults_are_accepted():
    default = SamplingParams()
    assert (default.n, default.min_tokens) == (1, 0)
    assert (default.presence_penalty, default.frequency_penalty) == (0.0, 0.0)
    assert default.repetition_penalty == 1.0 and not default.penalized
    for value in (-2, 2, -2.0, 0.5):
        assert SamplingParams(presence_penalty=value).penalized
        assert SamplingParams(frequency_penalty=value).penalized
    assert SamplingParams(repetition_penalty=1e-3).penalized
    assert SamplingParams(repetition_penalty=50.0).penalized
    assert not SamplingParams(min_tokens=16).penalized  # min_tokens alone is no penalty
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(n=8).n == 8
    with pytest.raises(SamplingError, match="min_tokens.*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(SamplingError, match="n must"):
        SamplingParams().evolve(n=0)
