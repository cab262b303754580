"""The Hopper Gluon split kernel of the MLA decode (`gluon_decode`) against the torch
reference and the Triton kernel, and where `mla_decode_paged_split` picks it.

Gluon kernels do not run under the interpreter, so every kernel case is GPU-only (marked
`gpu`, and skipped off Hopper: its MMAs are wgmma). On the CPU: the shape rules.
"""

from __future__ import annotations

import pytest
import torch

from tokenspeed.model.ops.mla.decode import (
    MlaDecodeTuning,
    dequantize_pages,
    gluon_applies,
    quantize_fp8_pages,
    quantize_fp8_rows,
)

from .test_mla_decode import (
    K3,
    TOL,
    _assert_close,
    _gpu_case,
    make_inputs,
    plan,
    reference,
    run,
)

gluon_decode = pytest.importorskip("tokenspeed.model.ops.mla.gluon_decode")
gluon_ring = pytest.importorskip("tokenspeed.model.ops.mla.gluon_ring")
gluon_transposed = pytest.importorskip("tokenspeed.model.ops.mla.gluon_transposed")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is Hopper-only (wgmma)")


def test_fits_k3_and_kimi_linear_shapes_only_where_tiles_fit():
    assert gluon_decode.fits(512, 64, 64)  # K3 / Kimi Linear: R 512, Dr 64, 64-row pages
    assert gluon_decode.fits(256, 64, 128)
    assert not gluon_decode.fits(512, 64, 32)  # a 64-row tile would cross pages
    assert not gluon_decode.fits(1024, 64, 64)  # each warpgroup's MMA is at most 256 wide
    assert not gluon_decode.fits(384, 64, 64)  # not a power of two
    assert not gluon_decode.fits(32, 16, 64)  # R below 64
    # e4m3 caches take 32-row tiles (three converted tiles beside the queries and the ring)
    assert gluon_decode.fits(512, 64, 32, fp8=True)
    assert not gluon_decode.fits(512, 64, 16, fp8=True)
    # The tuning's Gluon tiles: 32-row tiles fit 32-row pages; four 64-row stages of K3's
    # 576-wide rows do not fit beside the queries (shared memory), three do.
    assert gluon_decode.fits(512, 64, 32, tuning=MlaDecodeTuning(gluon_block_n=32))
    assert gluon_decode.fits(512, 64, 64, tuning=MlaDecodeTuning(gluon_stages=2))
    assert not gluon_decode.fits(512, 64, 64, tuning=MlaDecodeTuning(gluon_stages=3))
    assert gluon_decode.fits(512, 64, 64, tuning=MlaDecodeTuning(gluon_block_n=32, gluon_stages=3))


def test_transposed_kernel_takes_whole_32_row_bf16_calls_only():
    assert gluon_transposed.takes_remainder(32, fp8=False)  # Kimi Linear, one query
    # K3's 96 heads: the remainder stays with the 64-row programs (measured faster)
    for rows in (96, 288, 64, 128, 192, 384, 16, 48):
        assert not gluon_transposed.takes_remainder(rows, fp8=False)
    assert not gluon_transposed.takes_remainder(32, fp8=True)  # e4m3 caches: padded


class _Recorder:
    """Stands in for a kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))


@pytest.mark.parametrize("heads", [6, 32])
def test_gluon_tuning_reaches_the_launch(heads, monkeypatch):
    """On the CPU with the launches recorded (the Gluon kernels run on Hopper only): the
    defaults (64-row tiles, two stages, 512-column conversions; Kimi Linear's 32 rows in the
    transposed kernel alone) and a given tuning's Gluon knobs reach the launch arguments."""
    from tokenspeed.model.ops.mla import decode

    monkeypatch.setattr(decode, "gluon_applies", lambda *args, **kw: True)
    monkeypatch.setattr(decode, "_tail_kernel", _Recorder())
    padded, transposed, boxes = _Recorder(), _Recorder(), []
    monkeypatch.setattr(gluon_decode, "_split_kernel_gluon", padded)
    monkeypatch.setattr(gluon_transposed, "_split_kernel_transposed", transposed)
    monkeypatch.setattr(
        gluon_ring, "descriptors", lambda pages, rank, block_n: boxes.append(block_n) or (0, 0)
    )
    inp = make_inputs([10, 4], 1, heads=heads)
    run(inp, uniform_splits=2)  # kernel None: Gluon where it applies
    if heads == 32:
        assert not padded.launches and transposed.launches[0][0] == (1, 4)
        assert transposed.launches[0][1]["STAGES"] == 2
    else:
        assert padded.launches[0][0] == (1, 4) and not transposed.launches
        kw = padded.launches[0][1]
        assert (kw["STAGES"], kw["CONVERT_COLS"], kw["num_warps"]) == (2, 512, 8)
    assert boxes == [64]
    padded.launches.clear()
    tuning = {"gluon_block_n": 32, "gluon_stages": 3, "fp8_convert_cols": 128}
    run(inp, uniform_splits=2, kernel="gluon", **tuning)
    kw = padded.launches[0][1]  # 32-row tiles: the padded kernel, also for 32 rows
    assert (kw["STAGES"], kw["CONVERT_COLS"]) == (3, 128) and boxes == [64, 32]


def test_never_applies_on_the_cpu():
    q = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    pages = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    assert not gluon_applies(q, pages, None, 512, 64, 64)


@pytest.mark.gpu
def test_gpu_gluon_is_the_default_for_bf16_on_hopper_only():
    inp, _ = _gpu_case(1, lens=[300])
    assert gluon_applies(inp["q"], inp["pages"], None, 512, 64, 64) == HOPPER
    fp8, scales = quantize_fp8_rows(inp["pages"])
    assert gluon_applies(inp["q"], fp8, scales, 512, 64, 64) == HOPPER  # e4m3 + scales
    assert not gluon_applies(inp["q"], fp8, None, 512, 64, 64)  # e4m3 without scales
    assert not gluon_applies(inp["q"], inp["pages"], None, 512, 64, 48)  # page not whole tiles
    assert not gluon_applies(inp["q"].half(), inp["pages"], None, 512, 64, 64)  # dtypes differ


@pytest.mark.gpu
@hopper
# Granularity 16 puts split starts mid-tile (the kernel's tiles are 64 rows): the rows before a
# split's start must be masked; lengths leave ragged last tiles; 32 heads is Kimi Linear.
@pytest.mark.parametrize(
    ("n", "granularity", "heads"), [(1, 16, 96), (4, 16, 96), (2, 64, 96), (1, 16, 32)]
)
def test_gpu_gluon_matches_reference_and_triton(n, granularity, heads):
    lens = [4, 5, 33, 64, 65, 700, 4097, 30000]
    inp = make_inputs(
        lens, n, pad_rows=2, dtype=torch.bfloat16, device="cuda", seed=3, **dict(K3, heads=heads)
    )
    splits = plan(lens, len(lens) + 2, 96, granularity, device="cuda")
    out = run(inp, splits, gate=inp["gate"], kernel="gluon")
    ref = reference(inp) * torch.sigmoid(inp["gate"].float().view(-1, heads, 128))
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])
    assert out[inp["real"] :].eq(0).all()
    tri = run(inp, splits, gate=inp["gate"], kernel="triton")
    _assert_close(tri, ref, inp["real"], TOL[torch.bfloat16])


# The latent part of a tile can come in several TMA boxes, one barrier each, with Q K^T
# starting on the first boxes (`descriptors(chunk=)`); the library loads one box, so only this
# test reaches the narrower chunks.
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_gpu_gluon_latent_chunks_match_reference(chunk, monkeypatch):
    whole = gluon_ring.descriptors
    made = []

    def chunked(pages, rank, block_n):
        made.append(chunk)
        return whole(pages, rank, block_n, chunk=chunk)

    monkeypatch.setattr(gluon_ring, "descriptors", chunked)
    lens = [4, 33, 65, 700, 4097]
    inp = make_inputs(lens, 1, pad_rows=1, dtype=torch.bfloat16, device="cuda", seed=5, **K3)
    splits = plan(lens, len(lens) + 1, 64, 16, device="cuda")
    out = run(inp, splits, kernel="gluon")
    assert made == [chunk]
    _assert_close(out, reference(inp), inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
def test_gpu_gluon_int64_page_table_and_uniform_mode():
    inp, _ = _gpu_case(2, pad_rows=0)
    inp["page_table"] = inp["page_table"].long()
    out = run(inp, uniform_splits=5, kernel="gluon")
    _assert_close(out, reference(inp), inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    ("per_row", "n", "granularity"), [(True, 1, 16), (True, 4, 64), (False, 2, 16)]
)
def test_gpu_gluon_fp8_matches_dequantized_reference_and_triton(per_row, n, granularity):
    lens = [4, 5, 33, 64, 65, 700, 4097, 30000]
    inp = make_inputs(lens, n, pad_rows=2, dtype=torch.bfloat16, device="cuda", seed=4, **K3)
    inp["pages"][0] = 0.0  # the sink page must quantize (its 1e4 would set the page scale)
    pages, scales = (quantize_fp8_rows if per_row else quantize_fp8_pages)(inp["pages"])
    splits = plan(lens, len(lens) + 2, 96, granularity, device="cuda")
    ref = reference(inp, dequantize_pages(pages, scales))
    fp8 = dict(inp, pages=pages)
    out = run(fp8, splits, page_scales=scales, kernel="gluon")
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])
    tri = run(fp8, splits, page_scales=scales, kernel="triton")
    _assert_close(tri, ref, inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(("per_row", "n"), [(True, 1), (True, 4), (False, 2)])
def test_gpu_gluon_fp8_p_buffers_match_reference(per_row, n):
    """e4m3 P goes through two shared-memory buffers (tile t into t % 2): histories of 1 to 937
    tiles use both buffers at every parity of the tile count."""
    lens = [4, 5, 33, 64, 65, 700, 4097, 30000]
    inp = make_inputs(lens, n, pad_rows=2, dtype=torch.bfloat16, device="cuda", seed=9, **K3)
    inp["pages"][0] = 0.0  # the sink page must quantize
    pages, scales = (quantize_fp8_rows if per_row else quantize_fp8_pages)(inp["pages"])
    splits = plan(lens, len(lens) + 2, 96, 16, device="cuda")
    out = run(dict(inp, pages=pages), splits, page_scales=scales, kernel="gluon")
    ref = reference(inp, dequantize_pages(pages, scales))
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("per_row", [True, False])
def test_gpu_gluon_fp8_on_32_row_pages(per_row):
    """e4m3 tiles are 32 rows, so 32-row pages take the Gluon kernel too (bf16 ones do not):
    every tile is a whole page, and splits start mid-page."""
    lens = [4, 31, 32, 33, 97, 2000, 9000]
    inp = make_inputs(
        lens, 1, pad_rows=1, dtype=torch.bfloat16, device="cuda", seed=6, **dict(K3, page_size=32)
    )
    inp["pages"][0] = 0.0
    pages, scales = (quantize_fp8_rows if per_row else quantize_fp8_pages)(inp["pages"])
    assert gluon_applies(inp["q"], pages, scales, 512, 64, 32)
    assert not gluon_applies(inp["q"], inp["pages"], None, 512, 64, 32)
    splits = plan(lens, len(lens) + 1, 64, 16, device="cuda")
    ref = reference(inp, dequantize_pages(pages, scales))
    out = run(dict(inp, pages=pages), splits, page_scales=scales, kernel="gluon")
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
def test_gpu_default_call_runs_the_gluon_kernel():
    """kernel=None takes the Gluon kernel for bf16 on Hopper: same bits as kernel="gluon"."""
    inp, splits = _gpu_case(1, lens=[300, 5000, 64])
    default = run(inp, splits, gate=inp["gate"])
    assert torch.equal(default, run(inp, splits, gate=inp["gate"], kernel="gluon"))
    # (and not by accident: the Triton kernel sums in another order)
    assert not torch.equal(default, run(inp, splits, gate=inp["gate"], kernel="triton"))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("cache", ["fp16", "e4m3"])
def test_gpu_gluon_uniform_splits_past_the_history_and_a_tight_table(cache):
    """One short request, many uniform splits (most start past its end) and a page table
    exactly as wide as the request needs: empty splits must not read past the table."""
    dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    inp = make_inputs([100], 1, dtype=dtype, device="cuda", seed=5, **K3)
    inp["page_table"] = inp["page_table"][:, :2].contiguous()  # ceil(100 / 64) pages
    pages, scales = inp["pages"], None
    if cache == "e4m3":
        inp["pages"][0] = 0.0
        pages, scales = quantize_fp8_rows(inp["pages"])
    ref = reference(inp, dequantize_pages(pages, scales) if scales is not None else None)
    out = run(dict(inp, pages=pages), uniform_splits=264, page_scales=scales, kernel="gluon")
    _assert_close(out, ref, inp["real"], TOL[dtype])


class _Spy:
    """Records the grids a kernel is launched with, and launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    ("heads", "n", "uniform"), [(96, 1, False), (96, 3, False), (32, 1, False), (96, 1, True)]
)
def test_gpu_transposed_remainder_matches_reference(heads, n, uniform, monkeypatch):
    """The last 32 query rows of every split in `gluon_transposed` (any other rows in 64-row
    programs; the library does this for 32-row calls only, here for every 32-row remainder):
    splits starting mid-tile (granularity 16), ragged last tiles, padding rows, splits past a
    short history (uniform mode); and the padded path agrees."""
    spy = _Spy(gluon_transposed._split_kernel_transposed)
    monkeypatch.setattr(gluon_transposed, "_split_kernel_transposed", spy)
    monkeypatch.setattr(gluon_transposed, "takes_remainder", lambda rows, fp8: rows % 64 == 32)
    lens = [4, 5, 33, 64, 65, 700, 4097, 30000]
    inp = make_inputs(
        lens, n, pad_rows=2, dtype=torch.bfloat16, device="cuda", seed=7, **dict(K3, heads=heads)
    )
    kw = dict(uniform_splits=7) if uniform else dict(splits=plan(lens, 10, 96, 16, "cuda"))
    out = run(inp, gate=inp["gate"], kernel="gluon", **kw)
    slots = 10 * 7 if uniform else kw["splits"].split_len.numel()
    assert spy.grids == [(1, slots)]
    ref = reference(inp) * torch.sigmoid(inp["gate"].float().view(-1, heads, 128))
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])
    if not uniform:  # the planner gives padding rows no splits (uniform mode attends the sink)
        assert out[inp["real"] :].eq(0).all()
    monkeypatch.setattr(gluon_transposed, "takes_remainder", lambda rows, fp8: False)
    padded = run(inp, gate=inp["gate"], kernel="gluon", **kw)
    assert spy.grids == [(1, slots)]  # not launched again
    _assert_close(padded, ref, inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kimi_linear_calls_take_the_transposed_kernel_alone(dtype, monkeypatch):
    """32 heads, one query (32 rows): one transposed program per split, no 64-row program."""
    spies = {}
    for module, name in (
        (gluon_transposed, "_split_kernel_transposed"),
        (gluon_decode, "_split_kernel_gluon"),
    ):
        spies[name] = _Spy(getattr(module, name))
        monkeypatch.setattr(module, name, spies[name])
    lens = [4, 65, 700, 4097]
    inp = make_inputs(lens, 1, pad_rows=1, dtype=dtype, device="cuda", seed=9, **dict(K3, heads=32))
    splits = plan(lens, 5, 64, 16, "cuda")
    out = run(inp, splits)
    assert spies["_split_kernel_transposed"].grids == [(1, splits.split_len.numel())]
    assert spies["_split_kernel_gluon"].grids == []
    _assert_close(out, reference(inp), inp["real"], TOL[dtype])
