"""Geometry, policy and config: validation names the field; sizes come from the budget."""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.cache import (
    BudgetTooSmallError,
    CacheConfig,
    CacheConfigError,
    CacheGeometry,
    CheckpointKind,
    CheckpointPolicy,
)

from .helpers import tiny_geometry


def test_geometry_from_model_dims():
    # Kimi-K3-like dimensions, from the model config (the cache hard-codes none of them).
    g = CacheGeometry.from_model_dims(
        num_mla_layers=24,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_kda_layers=69,
        kda_num_heads=96,
        kda_head_dim=128,
        kda_conv_kernel=4,
    )
    assert g.mla_row_width == 576 and g.mla_row_bytes == 1152
    assert g.mla_page_bytes == 24 * 64 * 1152
    assert g.kda_conv_shape == (3 * 96 * 128, 3) and g.kda_recurrent_shape == (96, 128, 128)
    assert g.kda_recurrent_bytes == 96 * 128 * 128 * 4  # 6 MiB fp32 per layer
    assert g.kda_state_bytes == 69 * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4)


def test_geometry_is_frozen_keyword_only_and_validated():
    g = tiny_geometry()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        g.page_size = 8
    with pytest.raises(TypeError):
        CacheGeometry(64, 1, 1)  # keyword-only
    with pytest.raises(CacheConfigError, match="page_size"):
        tiny_geometry(page_size=0)
    with pytest.raises(CacheConfigError, match="kda_recurrent_shape"):
        tiny_geometry(kda_recurrent_shape=(2, 2))
    with pytest.raises(CacheConfigError, match="mla_dtype"):
        tiny_geometry(mla_dtype="bf16")
    with pytest.raises(CacheConfigError, match="layer_kinds"):
        tiny_geometry(layer_kinds=("kda", "mla"))


def test_copy_order_follows_the_model():
    g = tiny_geometry(layer_kinds=("kda", "mla", "kda", "kda", "mla"))
    assert g.copy_order == (("kda", 0), ("mla", 0), ("kda", 1), ("kda", 2), ("mla", 1))
    default = tiny_geometry().copy_order  # 3 KDA, 2 MLA spread out
    assert sorted(default) == [("kda", 0), ("kda", 1), ("kda", 2), ("mla", 0), ("mla", 1)]
    assert default[0][0] == "kda" and default[-1][0] == "mla"


def test_fingerprint_tracks_the_byte_layout():
    assert tiny_geometry().fingerprint == tiny_geometry().fingerprint
    assert tiny_geometry().fingerprint != tiny_geometry(mla_dtype=torch.bfloat16).fingerprint
    assert tiny_geometry().fingerprint != tiny_geometry(mla_rows_per_page=2).fingerprint


def test_whole_pages_keep_the_fingerprint_objects_already_carry():
    """The id of a whole-page layout is what it was before pages could be split (objects in a
    running store stay readable)."""
    import hashlib

    g = tiny_geometry()
    fields = (4, 2, 4, "torch.float16", 3, (6, 2), (2, 2, 2), "torch.bfloat16", "torch.float32")
    want = hashlib.blake2b(repr(fields).encode(), digest_size=6).hexdigest()
    assert g.fingerprint == want


def test_a_page_may_keep_a_share_of_its_mla_rows():
    """Decode context parallelism: C ranks each keep page_size / C rows of every page; the
    page is still page_size tokens, its bytes shrink C-fold."""
    whole, half = tiny_geometry(page_size=8), tiny_geometry(page_size=8, mla_rows_per_page=4)
    assert whole.mla_rows_per_page == 8 and whole.mla_share == 1
    assert half.page_size == 8 and half.mla_share == 2
    assert 2 * half.mla_page_bytes == whole.mla_page_bytes
    assert half.kda_state_bytes == whole.kda_state_bytes
    for rows in (3, 16, 0):
        with pytest.raises(CacheConfigError, match="mla_rows_per_page"):
            tiny_geometry(page_size=8, mla_rows_per_page=rows)
    dims = dict(
        num_mla_layers=2,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        num_kda_layers=3,
        kda_num_heads=4,
        kda_head_dim=16,
        kda_conv_kernel=4,
    )
    g = CacheGeometry.from_model_dims(**dims, mla_share=4)
    assert (g.page_size, g.mla_rows_per_page, g.mla_share) == (64, 16, 4)
    with pytest.raises(CacheConfigError, match="page_size=64 is not a multiple of mla_share=3"):
        CacheGeometry.from_model_dims(**dims, mla_share=3)
    # One budget: twice the pages (the same KDA slots first).
    budget = CacheConfig.budget_for(whole, pages=10, live_requests=2, checkpoints=1)
    config = CacheConfig(device_budget_bytes=budget, max_live_requests=2, num_checkpoint_slots=1)
    assert config.pool_sizes(whole).num_pages == 11
    assert config.pool_sizes(half).num_pages == 22


def test_pool_sizes_come_from_the_budget():
    g = tiny_geometry()
    budget = CacheConfig.budget_for(g, pages=10, live_requests=3, checkpoints=5)
    config = CacheConfig(device_budget_bytes=budget, max_live_requests=3, num_checkpoint_slots=5)
    sizes = config.pool_sizes(g)
    assert (sizes.num_pages, sizes.num_live_slots, sizes.num_checkpoint_slots) == (11, 4, 5)
    by_fraction = CacheConfig(
        device_budget_bytes=budget, max_live_requests=3, checkpoint_fraction=0.5
    ).pool_sizes(g)
    rest = budget - 4 * g.kda_state_bytes
    assert by_fraction.num_checkpoint_slots == int(rest * 0.5) // g.kda_state_bytes
    used = (
        by_fraction.num_pages * g.mla_page_bytes
        + (by_fraction.num_live_slots + by_fraction.num_checkpoint_slots) * g.kda_state_bytes
    )
    assert budget - g.mla_page_bytes < used <= budget


def test_budget_too_small_names_the_field():
    g = tiny_geometry()
    config = CacheConfig(device_budget_bytes=3 * g.kda_state_bytes, max_live_requests=2)
    with pytest.raises(BudgetTooSmallError, match="device_budget_bytes"):
        config.pool_sizes(g)
    config = CacheConfig(
        device_budget_bytes=CacheConfig.budget_for(g, pages=1, live_requests=1, checkpoints=0),
        max_live_requests=1,
        num_checkpoint_slots=4,
    )
    with pytest.raises(BudgetTooSmallError, match="num_checkpoint_slots"):
        config.pool_sizes(g)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device_budget_bytes", 0),
        ("max_live_requests", -1),
        ("checkpoint_fraction", 1.5),
        ("num_checkpoint_slots", -2),
        ("device", "not-a-device"),
        ("checkpoint_policy", 3),
        ("async_loads", "no"),  # truthy: must not switch async loads on
        ("prefix_caching", 1),
        ("metadata_only", 1),
    ],
)
def test_config_validation_names_the_field(field, value):
    kwargs = dict(device_budget_bytes=1 << 20, max_live_requests=2)
    kwargs[field] = value
    with pytest.raises(CacheConfigError, match=field):
        CacheConfig(**kwargs)


def test_policy_points():
    policy = CheckpointPolicy(interval_pages=2, max_per_path=4)
    assert policy.points(0, 20, page_size=4, turn_end=False) == [
        (8, CheckpointKind.INTERVAL),
        (16, CheckpointKind.INTERVAL),
    ]
    assert policy.points(0, 19, page_size=4, turn_end=True)[-1] == (16, CheckpointKind.TURN_END)
    assert policy.points(8, 11, page_size=4, turn_end=True) == []  # nothing new past 8
    assert policy.points(5, 14, page_size=4, turn_end=True) == [
        (8, CheckpointKind.INTERVAL),
        (12, CheckpointKind.TURN_END),
    ]
    with pytest.raises(CacheConfigError, match="interval_pages"):
        CheckpointPolicy(interval_pages=0)
    with pytest.raises(CacheConfigError):
        policy.points(5, 4, page_size=4, turn_end=False)
