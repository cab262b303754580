"""Speculative decoding in the simulator: `SpeculativeCostModel` advances each decode row by
the acceptance length A per verify step, a verify step of k + 1 positions costs the base model's
decode step of k + 1 tokens per row, and A = 1 without drafts is the plain simulation."""

import pytest

from tests.sim.cluster.helpers import TOY_COST, assert_nothing_lost, toy_config, toy_workload
from tokenspeed.sim import cli
from tokenspeed.sim.cluster import simulate
from tokenspeed.sim.cost import (
    LinearCostModel,
    SpeculativeCostModel,
    VerifyEnds,
    decode_run_ends,
    verify_step_time,
)


def test_verify_step_costs_a_decode_step_of_k_plus_1_tokens_per_row():
    base = LinearCostModel()
    spec = SpeculativeCostModel(base=base, acceptance_length=2, num_steps=2)
    assert spec.decode_step_time(8, 8, 1000) == base.decode_step_time(24, 24, 3000)
    assert verify_step_time(base, 8, 8, 1000, 1) == base.decode_step_time(8, 8, 1000)
    assert spec.prefill_time([(0, 100)]) == base.prefill_time([(0, 100)])


def test_tokens_of_a_verify_step_share_its_end():
    spec = SpeculativeCostModel(base=LinearCostModel(), acceptance_length=2, num_steps=1)
    ends = decode_run_ends(spec, 4, 4, 100, 5)
    assert isinstance(ends, VerifyEnds) and len(ends) == 5
    first = spec.decode_step_time(4, 4, 100)
    second = spec.decode_step_time(4, 4, 100 + 4 * 2)  # 2 tokens per row emitted before it
    assert list(ends) == [first, first, first + second, first + second, ends[4]]
    assert ends.verify_steps(5) == 3 and ends.verify_steps(4) == 2 and ends.verify_steps(0) == 0
    assert ends.last_of_step(2) == 3 and ends.last_of_step(4) == 4
    # A fractional A is a mean rate: 5 tokens in 2 steps at A = 2.5.
    frac = SpeculativeCostModel(base=LinearCostModel(), acceptance_length=2.5, num_steps=2)
    assert decode_run_ends(frac, 1, 1, 0, 5).verify_steps(5) == 2


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="acceptance_length"):
        SpeculativeCostModel(base=LinearCostModel(), acceptance_length=0.5, num_steps=1)
    with pytest.raises(ValueError, match="exceeds num_steps"):
        SpeculativeCostModel(base=LinearCostModel(), acceptance_length=3, num_steps=1)
    with pytest.raises(ValueError, match="num_steps"):
        SpeculativeCostModel(base=LinearCostModel(), acceptance_length=1, num_steps=4)


def test_default_is_the_plain_cost_model():
    args = cli.build_parser().parse_args([])
    cost = LinearCostModel()
    assert cli.speculative_cost(args, cost) is cost
    args = cli.build_parser().parse_args(["--acceptance-length", "2.5"])
    wrapped = cli.speculative_cost(args, cost)
    assert wrapped.num_steps == 2 and wrapped.acceptance_length == 2.5
    args = cli.build_parser().parse_args(
        ["--acceptance-length", "3", "--num-speculative-steps", "1"]
    )
    with pytest.raises(ValueError, match="--acceptance-length"):
        cli.speculative_cost(args, cost)


@pytest.mark.parametrize("mode", ["pd", "aggregated"])
def test_acceptance_length_2_halves_decode_steps_and_raises_throughput(mode):
    kw = dict(mode=mode, decode_ranks=0) if mode == "aggregated" else {}
    config = toy_config(**kw)
    plain = simulate(config, toy_workload(seed=1), TOY_COST)
    spec = simulate(
        config,
        toy_workload(seed=1),
        SpeculativeCostModel(base=TOY_COST, acceptance_length=2, num_steps=1),
    )
    assert_nothing_lost(plain)
    assert_nothing_lost(spec)

    def steps_per_token(res):
        tokens = sum(r.generated for r in res.records)
        return res.decode_row_steps / tokens

    ratio = steps_per_token(spec) / steps_per_token(plain)
    if mode == "pd":
        assert 0.45 < ratio < 0.6, ratio
    else:
        # Mixed prefill + decode forwards decode one token each: fewer are halved.
        assert 0.45 < ratio < 0.85, ratio
    assert spec.summary.throughput_per_gpu > plain.summary.throughput_per_gpu
    assert spec.summary.p90_interactivity > plain.summary.p90_interactivity
