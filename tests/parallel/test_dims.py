"""`ParallelDims`: degrees validated against the world and the model, naming the numbers."""

from __future__ import annotations

import attrs
import pytest

from tokenspeed.model import get_preset
from tokenspeed.parallel.dims import ParallelDims, ParallelError


def test_degrees_must_divide_the_world():
    with pytest.raises(ParallelError, match=r"ParallelDims.tp=3 does not divide world_size=4"):
        ParallelDims(world_size=4, tp=3)
    with pytest.raises(ParallelError, match=r"ParallelDims.ep must be an int >= 1, got 0"):
        ParallelDims(world_size=4, ep=0)


def test_groups_are_runs_of_consecutive_ranks():
    dims = ParallelDims(world_size=8, tp=2, ep=4)
    assert dims.group_of("tp", 5) == (4, 5)
    assert dims.group_of("ep", 5) == (4, 5, 6, 7)
    assert dims.attention_dp == 8


def test_degrees_must_divide_the_model():
    tiny = get_preset("tiny")  # 4 KDA heads, 4 MLA heads, 16 experts, intermediate 32
    ParallelDims(world_size=4, tp=4, ep=4).check_model(tiny)
    twelve = attrs.evolve(tiny, moe=attrs.evolve(tiny.moe, num_experts=12))
    with pytest.raises(ParallelError, match=r"ep=8 does not divide the routed experts \(12\)"):
        ParallelDims(world_size=8, ep=8).check_model(twelve)
    with pytest.raises(ParallelError, match=r"tp=8 does not divide the KDA heads \(4\)"):
        ParallelDims(world_size=8, tp=8).check_model(tiny)


def test_incompatible_strategies_are_refused():
    with pytest.raises(ParallelError, match="tep=2 .* does not combine with tp=2"):
        ParallelDims(world_size=4, tep=2, tp=2)
    with pytest.raises(ParallelError, match="dwdp=2 .* ep=2"):
        ParallelDims(world_size=2, dwdp=2, ep=2)
