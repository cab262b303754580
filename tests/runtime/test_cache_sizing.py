"""The engine's device cache: a budget that cannot hold one request of max_model_len tokens is
refused when the engine is built, not found out when requests are aborted one by one."""

import re

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.runtime import Engine, EngineConfig, EngineConfigError
from tokenspeed.runtime.cache_sizing import cache_geometry, smallest_budget

from .conftest import tokens


def test_the_issues_budget_is_refused_naming_the_numbers():
    # 300_000 bytes held 5 live KDA slots of 38400 bytes and 2 pages of 64 tokens (the sink
    # and one usable page): every request past 64 tokens was aborted as it outgrew the cache.
    with pytest.raises(EngineConfigError) as info:
        LLM("tiny", max_model_len=512, max_num_seqs=4, cache_budget_bytes=300_000)
    message = str(info.value)
    assert "cache_budget_bytes=300000" in message
    assert "max_model_len=512" in message and "8 pages" in message
    need = int(re.search(r"at least (\d+) bytes", message).group(1))
    assert need > 300_000
    assert "raise cache_budget_bytes" in message and "lower max_model_len" in message


def _config(budget, **options):
    return EngineConfig(
        device="cpu",
        max_model_len=128,
        max_num_seqs=3,
        page_size=16,
        cache_budget_bytes=budget,
        **options,
    )


@pytest.mark.parametrize(
    "checkpoint_slots, checkpoint_dtype",
    [(None, "float32"), (2, "float32"), (None, "bfloat16"), (2, "bfloat16")],
)
def test_the_smallest_budget_serves_requests_of_max_model_len_and_one_byte_less_is_refused(
    tiny, checkpoint_slots, checkpoint_dtype
):
    # bf16 checkpoints take half the bytes of a live slot: priced as such, not as live slots.
    config = _config(None, checkpoint_slots=checkpoint_slots, kda_checkpoint_dtype=checkpoint_dtype)
    need = smallest_budget(cache_geometry(tiny, 16, **config.cache_dtypes), config)
    with pytest.raises(EngineConfigError, match=f"at least {need} bytes"):
        Engine(tiny, None, config.evolve(cache_budget_bytes=need - 1))
    engine = Engine(tiny, None, config.evolve(cache_budget_bytes=need))
    assert engine.cache.sizes.num_pages - 1 == config.max_pages_per_request
    # Requests that together need several times the cache: each runs to its full length (the
    # scheduler preempts the others), none is aborted as too long for the cache.
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(5):
        engine.add_request(i, tokens(20 + 10 * i, seed=i), params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_integrity()
    assert {rid: out.outputs[0].finish_reason for rid, out in done.items()} == dict.fromkeys(
        range(5), "length"
    )
    assert [len(out.prompt_token_ids) + len(out.token_ids) for out in done.values()] == [128] * 5


def test_checkpoint_slots_that_leave_no_room_for_one_request_are_refused(tiny):
    config = _config(None)
    need = smallest_budget(cache_geometry(tiny, 16), config)
    with pytest.raises(EngineConfigError, match="checkpoint_slots=40"):
        Engine(tiny, None, config.evolve(cache_budget_bytes=need, checkpoint_slots=40))


def test_a_budget_below_the_live_slots_is_an_engine_config_error(tiny):
    # CacheConfig refuses it too (BudgetTooSmallError), but without the engine's fields.
    with pytest.raises(EngineConfigError, match="cache_budget_bytes=1000 "):
        Engine(tiny, None, _config(1000))


# ------------------------------------------------------------------ decode context parallelism


def _dcp_member(size: int):
    """A fresh tiny model whose MLA layers are those of a member of a DCP group of `size`
    (the class swap `apply_dcp` makes; no process group: nothing here runs a forward)."""
    from tokenspeed.model.layers.mla import GatedMla
    from tokenspeed.parallel.dcp import DcpGatedMla
    from tokenspeed.parallel.groups import Group

    from .conftest import tiny_model

    model = tiny_model()
    for module in model.modules():
        if type(module) is GatedMla:
            module.__class__ = DcpGatedMla
            module.dcp_group = Group(None, tuple(range(size)), 0)
            module.dcp_log = None
    return model


def test_a_dcp_member_keeps_its_share_of_every_page_and_twice_the_pages(tiny):
    """The engine reads the DCP group from the model: pages of 16 tokens hold 8 MLA rows, half
    the bytes, so the budget that gives one rank N pages gives a member about 2N."""
    from tokenspeed.runtime.cache_sizing import mla_share

    member = _dcp_member(2)
    assert mla_share(member) == 2 and mla_share(tiny) == 1
    config = _config(400_000)
    whole = Engine(tiny, None, config)
    half = Engine(member, None, config)
    try:
        g1, g2 = whole.cache.geometry, half.cache.geometry
        assert (g2.page_size, g2.mla_rows_per_page) == (16, 8)
        assert 2 * g2.mla_page_bytes == g1.mla_page_bytes
        assert half.cache.mla_layer(0).shape[1:] == (8, g1.mla_row_width)
        pages1, pages2 = whole.cache.sizes.num_pages - 1, half.cache.sizes.num_pages - 1
        assert 2 * pages1 <= pages2 <= 2 * pages1 + 3
    finally:
        whole.close()
        half.close()


def test_a_page_that_does_not_split_over_the_dcp_group_is_refused(tiny):
    with pytest.raises(EngineConfigError, match="page_size=15 is not a multiple of the DCP"):
        cache_geometry(tiny, 15, dcp=2)
    with pytest.raises(EngineConfigError, match="page_size=15 is not a multiple of the DCP"):
        Engine(_dcp_member(2), None, _config(None).evolve(page_size=15))
