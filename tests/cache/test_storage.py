"""DeviceStorage: shapes, bit-exact host round trips, checkpoint save / restore."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.cache.config import PoolSizes
from tokenspeed.cache.copy_engine import InlineCopyEngine
from tokenspeed.cache.storage import DeviceStorage

from .helpers import tiny_geometry


def _storage(rows: int | None = None):
    """rows: MLA rows per device page (None: the page size, 4)."""
    g = tiny_geometry() if rows is None else tiny_geometry(mla_rows_per_page=rows)
    return g, DeviceStorage(
        g, PoolSizes(num_pages=6, num_live_slots=3, num_checkpoint_slots=2), torch.device("cpu")
    )


def test_shapes():
    g, s = _storage()
    assert s.mla.shape == (g.num_mla_layers, 6, g.page_size, g.mla_row_width)
    assert s.mla.shape[2] == g.mla_rows_per_page
    assert s.conv.shape == (g.num_kda_layers, 3, *g.kda_conv_shape)
    assert s.ckpt_recurrent.shape == (g.num_kda_layers, 2, *g.kda_recurrent_shape)
    assert s.mla_layer(1).shape == (6, g.page_size, g.mla_row_width)


def test_a_split_page_keeps_its_share_of_the_rows():
    """A DCP member of a pair: pages of 4 tokens hold 2 rows; a host object is that share."""
    g, s = _storage(rows=2)
    assert s.mla.shape == (g.num_mla_layers, 6, 2, g.mla_row_width)
    assert s.mla_layer(0).shape == (6, 2, g.mla_row_width)
    assert 2 * g.mla_page_bytes == tiny_geometry().mla_page_bytes


@pytest.mark.parametrize("rows", [None, 2], ids=["whole", "split"])
def test_pages_round_trip_through_host_bytes(rows):
    g, s = _storage(rows)
    s.mla.copy_(torch.randn(s.mla.shape).to(s.mla.dtype))
    payloads = s.read_pages([2, 4])
    assert all(p.dtype == torch.uint8 and p.numel() == g.mla_page_bytes for p in payloads)
    expected = s.mla[:, [2, 4]].clone()
    steps, _ = s.page_load_steps([1, 5], payloads)
    assert len(steps) == g.num_mla_layers
    InlineCopyEngine().submit(steps)
    assert torch.equal(s.mla[:, [1, 5]], expected)


def test_state_round_trip_is_bit_exact_including_nan_payloads():
    g, s = _storage()
    s.ckpt_conv[:, 1] = torch.randn(s.ckpt_conv[:, 1].shape).to(s.ckpt_conv.dtype)
    s.ckpt_recurrent[:, 1] = torch.randn(s.ckpt_recurrent[:, 1].shape)
    s.ckpt_recurrent[0, 1, 0, 0, 0] = float("nan")
    payload = s.read_checkpoint(1)
    assert payload.numel() == g.kda_state_bytes
    steps, _ = s.state_load_steps(payload, live_slot=2, ckpt_slot=0)
    InlineCopyEngine().submit(steps)
    for live, ckpt in ((s.conv, s.ckpt_conv), (s.recurrent, s.ckpt_recurrent)):
        want = ckpt[:, 1].contiguous().view(torch.uint8)
        assert torch.equal(live[:, 2].contiguous().view(torch.uint8), want)
        assert torch.equal(ckpt[:, 0].contiguous().view(torch.uint8), want)


def test_save_restore_and_zero():
    _, s = _storage()
    s.conv[:, 1].fill_(3)
    s.recurrent[:, 1].fill_(4)
    s.save_checkpoint(1, 0)
    s.zero_live(1)
    assert not s.conv[:, 1].any() and not s.recurrent[:, 1].any()
    s.restore_checkpoint(0, 2)
    assert (s.conv[:, 2] == 3).all() and (s.recurrent[:, 2] == 4).all()
