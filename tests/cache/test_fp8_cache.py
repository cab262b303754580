"""The cache's two narrow dtypes: an FP8 MLA cache (e4m3 rows with per-row fp32 scales) and
bf16 KDA checkpoints. Bytes per token and per checkpoint, the fingerprint (a different cache
dtype is a different layout), and exact round trips of pages and checkpoints through L2
payloads and handoffs."""

import hashlib

import pytest
import torch

from tokenspeed.cache import CacheConfig, CacheGeometry, LocalHostCache
from tokenspeed.cache.config import PoolSizes
from tokenspeed.cache.errors import CacheConfigError
from tokenspeed.cache.handoff import CacheExtent, CacheLayout, device_regions, transfer_ranges
from tokenspeed.cache.l2.base import ObjectKind
from tokenspeed.cache.l2.codec import decode, encode_header
from tokenspeed.cache.storage import ROW_SCALES_ATTR, DeviceStorage
from tokenspeed.model import PagedMla
from tokenspeed.model.ops.mla import dequantize_rows, quantize_rows_e4m3
from tokenspeed.model.state import ROW_SCALES_ATTR as MODEL_ATTR

FP8 = torch.float8_e4m3fn


def geometry(**overrides) -> CacheGeometry:
    fields = dict(
        page_size=4,
        num_mla_layers=2,
        mla_row_width=24,
        mla_dtype=torch.bfloat16,
        num_kda_layers=3,
        kda_conv_shape=(6, 2),
        kda_recurrent_shape=(2, 4, 4),
        kda_conv_dtype=torch.bfloat16,
    )
    fields.update(overrides)
    return CacheGeometry(**fields)


def _old_fingerprint(g: CacheGeometry) -> str:
    """The fingerprint as it was before the cache dtypes: default layouts keep their ids."""
    fields = (
        g.page_size,
        g.num_mla_layers,
        g.mla_row_width,
        str(g.mla_dtype),
        g.num_kda_layers,
        g.kda_conv_shape,
        g.kda_recurrent_shape,
        str(g.kda_conv_dtype),
        str(g.kda_recurrent_dtype),
    )
    return hashlib.blake2b(repr(fields).encode(), digest_size=6).hexdigest()


def test_bytes_per_token_and_checkpoint():
    bf16 = geometry()
    fp8 = geometry(mla_dtype=FP8)
    assert bf16.mla_row_bytes == 48 and fp8.mla_row_bytes == 24 + 4  # e4m3 row + fp32 scale
    assert fp8.mla_page_bytes == 2 * 4 * 28
    assert fp8.mla_token_bytes == 2 * 28 and bf16.mla_token_bytes == 2 * 48
    ck = geometry(kda_checkpoint_dtype=torch.bfloat16)
    # conv already bf16 stays; the fp32 recurrent state halves.
    assert ck.kda_checkpoint_bytes == 3 * (6 * 2 * 2 + 32 * 2)
    assert ck.kda_state_bytes == bf16.kda_state_bytes == 3 * (6 * 2 * 2 + 32 * 4)
    assert bf16.kda_checkpoint_bytes == bf16.kda_state_bytes
    assert geometry(kda_checkpoint_dtype=torch.float32).kda_checkpoint_bytes == (
        bf16.kda_state_bytes
    )


def test_the_cache_dtypes_are_part_of_the_fingerprint():
    prints = {
        (mla, ck): geometry(mla_dtype=mla, kda_checkpoint_dtype=ck).fingerprint
        for mla in (torch.bfloat16, FP8)
        for ck in (None, torch.bfloat16)
    }
    assert len(set(prints.values())) == 4
    # Default layouts keep the ids their stored objects carry (and fp32 checkpoints of an fp32
    # state are the default layout).
    assert prints[(torch.bfloat16, None)] == _old_fingerprint(geometry())
    assert (
        geometry(kda_checkpoint_dtype=torch.float32).fingerprint == prints[(torch.bfloat16, None)]
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"mla_dtype": torch.float8_e5m2},
        {"mla_dtype": torch.int8},
        {"kda_checkpoint_dtype": torch.float16},
        {"kda_checkpoint_dtype": "bfloat16"},
    ],
)
def test_bad_cache_dtypes_are_refused(overrides):
    with pytest.raises(CacheConfigError, match="mla_dtype|kda_checkpoint_dtype"):
        geometry(**overrides)


def test_narrow_checkpoints_leave_room_for_more_pages():
    wide, narrow = geometry(), geometry(kda_checkpoint_dtype=torch.bfloat16)
    budget = CacheConfig.budget_for(wide, pages=20, live_requests=2, checkpoints=10)
    config = CacheConfig(device_budget_bytes=budget, max_live_requests=2, num_checkpoint_slots=10)
    assert config.pool_sizes(wide).num_pages == 21
    assert config.pool_sizes(narrow).num_pages > 21
    exact = CacheConfig.budget_for(narrow, pages=20, live_requests=2, checkpoints=10)
    assert CacheConfig(
        device_budget_bytes=exact, max_live_requests=2, num_checkpoint_slots=10
    ).pool_sizes(narrow) == PoolSizes(num_pages=21, num_live_slots=3, num_checkpoint_slots=10)


def _fill_fp8(storage: DeviceStorage, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(*storage.mla.shape, generator=gen) * torch.rand(
        *storage.mla.shape[:3], 1, generator=gen
    ).mul(10)
    q, s = quantize_rows_e4m3(rows)
    storage.mla.copy_(q)
    storage.mla_scales.copy_(s)


def test_fp8_pages_round_trip_exactly_through_l2_payloads():
    g = geometry(mla_dtype=FP8)
    storage = DeviceStorage(g, PoolSizes(10, 3, 2), torch.device("cpu"))
    assert storage.mla.dtype == FP8 and storage.mla_scales.shape == (2, 10, 4)
    _fill_fp8(storage)
    payloads = storage.read_pages([3, 7])
    assert all(p.numel() == g.mla_page_bytes for p in payloads)
    steps, _keep = storage.page_load_steps([5, 1], payloads)
    for step in steps:
        step()
    assert torch.equal(
        storage.mla[:, [5, 1]].view(torch.uint8), storage.mla[:, [3, 7]].view(torch.uint8)
    )
    assert torch.equal(storage.mla_scales[:, [5, 1]], storage.mla_scales[:, [3, 7]])


def test_the_model_finds_the_scales_of_an_fp8_pool():
    storage = DeviceStorage(geometry(mla_dtype=FP8), PoolSizes(6, 2, 1), torch.device("cpu"))
    assert ROW_SCALES_ATTR == MODEL_ATTR
    pool = storage.mla_layer(1)
    paged = PagedMla(pool, torch.zeros(1, 2, dtype=torch.long))
    assert paged.scales.data_ptr() == storage.mla_scales[1].data_ptr()
    with pytest.raises(ValueError, match="row scales"):
        PagedMla(storage.mla[0], torch.zeros(1, 2, dtype=torch.long))  # a bare e4m3 view
    plain = DeviceStorage(geometry(), PoolSizes(6, 2, 1), torch.device("cpu"))
    assert PagedMla(plain.mla_layer(0), torch.zeros(1, 2, dtype=torch.long)).scales is None


def test_quantised_rows_are_within_e4m3_precision():
    rows = torch.randn(64, 576, generator=torch.Generator().manual_seed(3))
    q, s = quantize_rows_e4m3(rows)
    back = dequantize_rows(q[None], s[None])[0]
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each row's largest value.
    err = (back - rows).abs() / rows.abs().amax(-1, keepdim=True)
    assert err.max() <= 2**-4
    # A row depends on itself only: quantising it alone gives the same bytes.
    q1, s1 = quantize_rows_e4m3(rows[17:18])
    assert torch.equal(q1.view(torch.uint8), q[17:18].view(torch.uint8)) and torch.equal(
        s1, s[17:18]
    )


def test_bf16_checkpoints_round_the_state_and_restore_it_converted_up():
    g = geometry(kda_conv_dtype=torch.float32, kda_checkpoint_dtype=torch.bfloat16)
    storage = DeviceStorage(g, PoolSizes(4, 3, 2), torch.device("cpu"))
    assert storage.ckpt_recurrent.dtype == torch.bfloat16
    assert storage.ckpt_conv.dtype == torch.bfloat16 and storage.recurrent.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    storage.conv[:, 1].copy_(torch.randn(storage.conv[:, 1].shape, generator=gen))
    storage.recurrent[:, 1].copy_(torch.randn(storage.recurrent[:, 1].shape, generator=gen))
    live = storage.recurrent[:, 1].clone(), storage.conv[:, 1].clone()
    storage.save_checkpoint(1, 0)
    payload = storage.read_checkpoint(0)
    assert payload.numel() == g.kda_checkpoint_bytes < g.kda_state_bytes
    # From a device checkpoint slot and from an L2 payload: the same fp32 state.
    storage.restore_checkpoint(0, 2)
    via_slot = storage.recurrent[:, 2].clone(), storage.conv[:, 2].clone()
    storage.zero_live(2)
    steps, _keep = storage.state_load_steps(payload, 2, 1)
    for step in steps:
        step()
    assert torch.equal(storage.recurrent[:, 2], via_slot[0])
    assert torch.equal(storage.conv[:, 2], via_slot[1])
    assert torch.equal(storage.ckpt_recurrent[:, 1], storage.ckpt_recurrent[:, 0])
    assert torch.equal(via_slot[0], live[0].to(torch.bfloat16).float())
    rel = (via_slot[0] - live[0]).abs().max() / live[0].abs().max()
    assert 0 < rel <= 2**-8


def test_an_l2_shared_by_different_cache_dtypes_is_refused():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    l2.bind(geometry(), metadata_only=False)
    for other in (geometry(mla_dtype=FP8), geometry(kda_checkpoint_dtype=torch.bfloat16)):
        with pytest.raises(CacheConfigError, match="geometry differs"):
            l2.bind(other, metadata_only=False)
    l2.close()


def test_an_object_written_under_another_cache_dtype_is_never_read():
    """A shared store (Mooncake) names and stamps objects with the fingerprint: an FP8 reader
    neither finds a bf16 writer's objects nor accepts their bytes."""
    bf16, fp8 = geometry(), geometry(mla_dtype=FP8)
    payload = memoryview(bytes(fp8.mla_page_bytes))
    blob = encode_header(ObjectKind.PAGE, 5, 4, payload, bf16.fingerprint, checksum=True)
    blob += bytes(payload)
    assert decode(blob, ObjectKind.PAGE, 5, 4, fp8.mla_page_bytes, bf16.fingerprint, checksum=True)
    assert (
        decode(blob, ObjectKind.PAGE, 5, 4, fp8.mla_page_bytes, fp8.fingerprint, checksum=True)
        is None
    )


def test_a_handoff_carries_the_row_scales():
    g = geometry(mla_dtype=FP8)
    src = DeviceStorage(g, PoolSizes(8, 3, 1), torch.device("cpu"))
    dst = DeviceStorage(g, PoolSizes(9, 3, 1), torch.device("cpu"))
    _fill_fp8(src, seed=4)
    lay_s, lay_d = CacheLayout.of(src), CacheLayout.of(dst)
    a = CacheExtent(num_tokens=7, first_page=0, page_ids=(2, 5), live_slot=1)
    b = CacheExtent(num_tokens=7, first_page=0, page_ids=(6, 3), live_slot=2)
    ranges = transfer_ranges(lay_s, a, lay_d, b)
    assert {r.region for r in ranges} == {"mla", "mla_scales", "conv", "recurrent"}
    s_regions, d_regions = device_regions(src), device_regions(dst)
    for r in ranges:
        d_regions[r.region][r.dst_offset : r.dst_offset + r.nbytes].copy_(
            s_regions[r.region][r.src_offset : r.src_offset + r.nbytes]
        )
    assert torch.equal(dst.mla[:, 6].view(torch.uint8), src.mla[:, 2].view(torch.uint8))
    assert torch.equal(dst.mla_scales[:, 6], src.mla_scales[:, 2])
    assert torch.equal(dst.mla_scales[:, 3, :3], src.mla_scales[:, 5, :3])  # tokens 4..6
    assert torch.equal(dst.mla[:, 3, :3].view(torch.uint8), src.mla[:, 5, :3].view(torch.uint8))
