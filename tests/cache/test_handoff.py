"""Handing a request's cache from one manager to another: extents, byte ranges, copies."""

import attrs
import numpy as np
import pytest
import torch

from tokenspeed.cache import CacheConfigError, InvalidRequestError, page_keys_for_tokens
from tokenspeed.cache.handoff import (
    ByteRange,
    CacheExtent,
    copy_ranges,
    device_regions,
    transfer_ranges,
)

from .helpers import make_manager, tiny_geometry, token_stream

P = 4


def _fill_random(cache, seed: int) -> None:
    """Every byte of the device tier random (so a byte in the wrong place shows)."""
    g = torch.Generator().manual_seed(seed)
    for region in device_regions(cache.storage).values():
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, generator=g))


def _request(cache, rid, tokens, *, prompt_tokens=None):
    keys = page_keys_for_tokens(tokens, P)
    n = len(tokens)
    return cache.allocate(rid, keys, prompt_tokens or n, reserve_tokens=n)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()  # bytes compare exactly (random: NaNs)


def _rows(cache, handle, n):
    """The bytes of the request's MLA rows [0, n) of every layer, and of its live state."""
    mla = cache.storage.mla[:, handle.page_ids.tolist()]
    rows = mla.reshape(mla.shape[0], -1, mla.shape[-1])[:, :n]
    s = handle.live_slot
    return [_bytes(t) for t in (rows, cache.storage.conv[:, s], cache.storage.recurrent[:, s])]


@pytest.mark.parametrize("n", [1, 3, 4, 9, 16])
def test_a_request_moves_bit_exact_with_a_partial_last_page(n):
    src, dst = make_manager(), make_manager(pages=40, live=6)
    _fill_random(src, 1)
    _fill_random(dst, 2)
    tokens = token_stream(0, n)
    # Different page ids on the two sides: the destination has taken some pages already.
    dst.allocate("other", page_keys_for_tokens(token_stream(9, 12), P), 12)
    hs, hd = _request(src, "r", tokens), _request(dst, "r", tokens)
    sink_before = _bytes(dst.storage.mla[:, dst.sink_page]).clone()
    other_before = _rows(dst, dst.get("other"), 12)
    ranges = transfer_ranges(
        src.handoff_layout(),
        src.export_extent(hs, n),
        dst.handoff_layout(),
        dst.import_extent(hd, n),
    )
    copy_ranges(device_regions(src.storage), device_regions(dst.storage), ranges)
    for a, b in zip(_rows(src, hs, n), _rows(dst, hd, n), strict=True):
        assert torch.equal(a, b)
    # Nothing outside the request's rows changed: the sink, another request's pages.
    assert torch.equal(_bytes(dst.storage.mla[:, dst.sink_page]), sink_before)
    for a, b in zip(other_before, _rows(dst, dst.get("other"), 12), strict=True):
        assert torch.equal(a, b)
    # Only the rows of [0, n) moved: the partial page's tail is the destination's own.
    moved = sum(r.nbytes for r in ranges if r.region == "mla")
    layout = src.handoff_layout()
    assert moved == layout.num_mla_layers * n * layout.mla_row_bytes
    src.check_integrity()
    dst.check_integrity()


def test_consecutive_pages_move_as_one_range_per_layer():
    src, dst = make_manager(), make_manager()
    tokens = token_stream(0, 4 * P)
    hs, hd = _request(src, "r", tokens), _request(dst, "r", tokens)
    assert np.all(np.diff(hs.page_ids) == 1) and np.all(np.diff(hd.page_ids) == 1)
    ranges = transfer_ranges(
        src.handoff_layout(),
        src.export_extent(hs, 4 * P),
        dst.handoff_layout(),
        dst.import_extent(hd, 4 * P),
    )
    layout = src.handoff_layout()
    mla = [r for r in ranges if r.region == "mla"]
    assert len(mla) == layout.num_mla_layers
    assert all(r.nbytes == 4 * layout.page_bytes for r in mla)
    # One conv and one recurrent range per KDA layer (the slots of a layer are not adjacent).
    assert len(ranges) - len(mla) == 2 * layout.num_kda_layers


def test_the_destinations_own_prefix_hit_is_not_written():
    src, dst = make_manager(), make_manager()
    first = token_stream(0, 10)
    # The destination computed [0, 8) of this prefix before: a checkpoint at 8 covers it.
    h0 = _request(dst, "turn1", first)
    dst.checkpoint(h0, 8)
    dst.release(h0)
    second = first + token_stream(1, 5)
    hs = _request(src, "r", second)
    hd = dst.allocate("r", page_keys_for_tokens(second, P), len(second), reserve_tokens=15)
    assert hd.num_cached_tokens == 8
    out = dst.import_extent(hd, len(second))
    assert out.first_page == 2 and len(out.page_ids) == 2
    ranges = transfer_ranges(
        src.handoff_layout(), src.export_extent(hs, 15), dst.handoff_layout(), out
    )
    hit_pages = set(hd.page_ids[:2].tolist())
    page_bytes = dst.handoff_layout().page_bytes
    num_pages = dst.handoff_layout().num_pages
    for r in ranges:
        if r.region == "mla":
            page = (r.dst_offset // page_bytes) % num_pages
            assert page not in hit_pages


def test_layouts_and_extents_must_agree():
    src = make_manager()
    other = make_manager(tiny_geometry(page_size=8))
    h = _request(src, "r", token_stream(0, 6))
    e = src.export_extent(h, 6)
    with pytest.raises(CacheConfigError, match="layouts differ"):
        transfer_ranges(src.handoff_layout(), e, other.handoff_layout(), e)
    with pytest.raises(InvalidRequestError):
        transfer_ranges(
            src.handoff_layout(), e, src.handoff_layout(), attrs.evolve(e, num_tokens=5)
        )
    with pytest.raises(InvalidRequestError):
        transfer_ranges(
            src.handoff_layout(),
            e,
            src.handoff_layout(),
            CacheExtent(num_tokens=6, first_page=0, page_ids=(5,), live_slot=1),
        )
    with pytest.raises(InvalidRequestError):
        src.export_extent(h, 7)  # past the pages it holds
    with pytest.raises(InvalidRequestError):
        src.export_extent(h, 0)


def test_copies_refuse_ranges_outside_a_region():
    cache = make_manager()
    regions = device_regions(cache.storage)
    size = regions["conv"].numel()
    with pytest.raises(InvalidRequestError):
        copy_ranges(regions, regions, [ByteRange("conv", 0, size - 1, 2)])
    with pytest.raises(InvalidRequestError):
        copy_ranges(regions, regions, [ByteRange("nope", 0, 0, 1)])


def test_layout_and_extent_survive_json():
    import json

    cache = make_manager()
    h = _request(cache, "r", token_stream(0, 7))
    layout, e = cache.handoff_layout(), cache.export_extent(h, 7)
    assert type(layout).from_dict(json.loads(json.dumps(layout.as_dict()))) == layout
    assert CacheExtent.from_dict(json.loads(json.dumps(e.as_dict()))) == e
