"""EngineConfig and SamplingParams refuse what the engine could only misread."""

import pytest

from tokenspeed.runtime import EngineConfig, EngineConfigError, SamplingError, SamplingParams
from tokenspeed.sched.config import MAX_DECODE_BATCH_SIZE, SchedulerConfig


def test_decode_batch_sizes_must_end_at_max_num_seqs():
    """Sizes past max_num_seqs would be dropped, leaving 4 as the decode cap for 32 requests."""
    with pytest.raises(EngineConfigError, match=r"must end at max_num_seqs \(32\).*ends at 64"):
        EngineConfig(max_num_seqs=32, decode_batch_sizes=(1, 2, 4, 64))
    with pytest.raises(EngineConfigError, match=r"must end at max_num_seqs \(32\).*ends at 16"):
        EngineConfig(max_num_seqs=32, decode_batch_sizes=(1, 2, 4, 16))
    config = EngineConfig(max_num_seqs=32, decode_batch_sizes=[1, 2, 4, 32])
    assert config.decode_batch_sizes == config.graph_sizes == (1, 2, 4, 32)


@pytest.mark.parametrize("sizes", [(), (2, 1, 4), (1, 1, 4), (0, 4), (1, 2.0, 4), (True, 4)])
def test_decode_batch_sizes_must_be_increasing_positive_ints(sizes):
    with pytest.raises(EngineConfigError, match="strictly increasing positive ints"):
        EngineConfig(max_num_seqs=4, decode_batch_sizes=sizes)


@pytest.mark.parametrize("sizes", [4, "124"])
def test_decode_batch_sizes_must_be_a_sequence(sizes):
    with pytest.raises(EngineConfigError, match="decode_batch_sizes must be a sequence"):
        EngineConfig(max_num_seqs=4, decode_batch_sizes=sizes)


def test_max_num_seqs_is_bounded_by_the_largest_decode_batch():
    with pytest.raises(
        EngineConfigError,
        match=rf"max_num_seqs is {MAX_DECODE_BATCH_SIZE + 1}, "
        rf"above the largest decode batch",
    ):
        EngineConfig(max_num_seqs=MAX_DECODE_BATCH_SIZE + 1)
    config = EngineConfig(max_num_seqs=MAX_DECODE_BATCH_SIZE)
    assert config.graph_sizes[-1] == MAX_DECODE_BATCH_SIZE


@pytest.mark.parametrize("seqs", [1, 3, 32, 100, MAX_DECODE_BATCH_SIZE])
def test_default_graph_sizes_end_at_max_num_seqs_and_suit_the_scheduler(seqs):
    sizes = EngineConfig(max_num_seqs=seqs).graph_sizes
    assert sizes[-1] == seqs
    assert SchedulerConfig(decode_batch_sizes=sizes).max_decode_batch == seqs


@pytest.mark.parametrize("value", [-1, 1.0, True, None])
def test_max_preemptions_must_be_a_non_negative_int(value):
    with pytest.raises(EngineConfigError, match="max_preemptions must be a non-negative integer"):
        EngineConfig(max_preemptions=value)


@pytest.mark.parametrize("field", ["max_num_seqs", "page_size", "decode_steps"])
def test_bools_are_not_counts(field):
    with pytest.raises(EngineConfigError, match=f"{field} must be a positive integer"):
        EngineConfig(**{field: True})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seed", True, "seed must be an integer"),
        ("seed", 1.5, "seed must be an integer"),
        ("enable_cuda_graph", "no", "enable_cuda_graph must be True or False"),
        ("enable_cuda_graph", 0, "enable_cuda_graph must be True or False"),
    ],
)
def test_seed_and_switches_take_their_own_types(field, value, message):
    # "no" would read as true; a bool or float seed would seed something else than asked.
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**{field: value})
    assert EngineConfig(seed=7, enable_cuda_graph=False).seed == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("logprobs", True),
        ("logprobs", False),
        ("seed", True),
        ("top_k", True),
        ("stop_token_ids", True),
        ("stop_token_ids", [5, False]),
        ("top_p", True),
        ("temperature", False),
    ],
)
def test_sampling_params_refuse_bools_for_numbers(field, value):
    with pytest.raises(SamplingError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_take_ints():
    params = SamplingParams(max_tokens=3, logprobs=0, seed=7, top_k=5, stop_token_ids=[0, 5])
    assert (params.max_tokens, params.logprobs, params.stop_token_ids) == (3, 0, (0, 5))
