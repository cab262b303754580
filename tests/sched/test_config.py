import pytest

from tokenspeed.sched.config import (
    MAX_DECODE_BATCH_SIZE,
    AdmissionPolicy,
    RouterConfig,
    RoutingPolicy,
    SchedulerConfig,
)


def test_defaults_are_consistent():
    cfg = SchedulerConfig()
    assert cfg.checkpoint_interval_tokens == cfg.page_size * cfg.checkpoint_interval_pages
    assert cfg.max_decode_batch == cfg.decode_batch_sizes[-1]


def test_budget_smaller_than_a_page_is_rejected():
    with pytest.raises(ValueError, match=r"prefill_token_budget \(32\) is smaller than one page"):
        SchedulerConfig(page_size=64, prefill_token_budget=32)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 0),
        ("prefill_token_budget", -5),
        ("max_prefill_requests", 0),
        ("checkpoint_interval_pages", 0),
        ("decode_reserve_pages", -1),
        ("max_preemptions", -1),
        ("page_size", True),
    ],
)
def test_bad_integers_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


_INT_FIELDS = (
    "page_size",
    "prefill_token_budget",
    "max_prefill_requests",
    "checkpoint_interval_pages",
    "decode_reserve_pages",
    "max_preemptions",
)


@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("value", [True, False, 64.0, "64", None])
def test_every_integer_field_rejects_bools_and_non_integers(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a"):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize("sizes", [(), (4, 2), (1, 1), (0, 8)])
def test_decode_batch_sizes_must_be_increasing_positive(sizes):
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        SchedulerConfig(decode_batch_sizes=sizes)


@pytest.mark.parametrize("sizes", [(True, 2, 4), (1, True), (1, 2.0), (1, "2"), (1, None)])
def test_decode_batch_sizes_reject_bools_and_non_integers(sizes):
    with pytest.raises(ValueError, match="decode_batch_sizes must hold positive integers"):
        SchedulerConfig(decode_batch_sizes=sizes)


@pytest.mark.parametrize("sizes", [(1, 2, 2**40), (MAX_DECODE_BATCH_SIZE + 1,)])
def test_decode_batch_sizes_beyond_the_cap_are_rejected(sizes):
    # One CUDA graph (and buffers as long as the largest size) is built per size.
    with pytest.raises(ValueError, match=f"above the largest decode batch {MAX_DECODE_BATCH_SIZE}"):
        SchedulerConfig(decode_batch_sizes=sizes)


def test_decode_batch_sizes_up_to_the_cap_are_accepted():
    cfg = SchedulerConfig(decode_batch_sizes=[1, 256, MAX_DECODE_BATCH_SIZE])
    assert cfg.decode_batch_sizes == (1, 256, MAX_DECODE_BATCH_SIZE)
    assert cfg.max_decode_batch == MAX_DECODE_BATCH_SIZE


@pytest.mark.parametrize("sizes", [8, "1248", None])
def test_decode_batch_sizes_must_be_a_sequence(sizes):
    with pytest.raises(ValueError, match="decode_batch_sizes must be a sequence of integers"):
        SchedulerConfig(decode_batch_sizes=sizes)


def test_configs_are_frozen_and_keyword_only():
    cfg = SchedulerConfig()
    with pytest.raises(AttributeError):
        cfg.page_size = 128
    with pytest.raises(TypeError):
        SchedulerConfig(64)


def test_zero_ranks_rejected():
    with pytest.raises(ValueError, match="num_prefill_ranks must be a positive integer"):
        RouterConfig(num_prefill_ranks=0)
    with pytest.raises(ValueError, match="num_decode_ranks"):
        RouterConfig(num_prefill_ranks=2, num_decode_ranks=-1)


def test_policies_convert_from_strings():
    assert RouterConfig(num_prefill_ranks=1, policy="affinity").policy is RoutingPolicy.AFFINITY
    assert AdmissionPolicy("coupled") is AdmissionPolicy.COUPLED
    with pytest.raises(ValueError):
        RouterConfig(num_prefill_ranks=1, policy="random")
