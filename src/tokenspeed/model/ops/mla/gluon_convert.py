"""e4m3 caches in the Gluon MLA split kernel: tiles converted exactly to the queries' type
(`_to_mma_type`, `_convert_tile`) while the tensor cores run the previous tile's MMAs, and the
per-page or per-row scales of a tile (`_tile_scales`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .gluon_ring import _issue, _page_of, _wait_tile


@gluon.jit
def _to_mma_type(x, dtype: gl.constexpr):
    """Cache values to the MMA type, exactly (`x.to(dtype)` but for e4m3 -> bf16). e4m3 -> fp16:
    the hardware's packed convert. e4m3 -> bf16: by bit
    moves, four values per 32-bit word (sign to bit 15, exponent and mantissa into bf16's
    fields), then a packed multiply by 2^120 moves the exponent bias from 7 to 127 (e4m3
    subnormals land on bf16 subnormals and come out exact too). Triton's own e4m3 -> bf16 is
    e4m3 -> f16 -> bf16, whose second step is one slow `cvt` per value; that made the tile
    conversion the e4m3 path's bottleneck. e4m3fn's NaN (0x7f) is not kept: quantized caches
    hold none (values are clamped to +-448)."""
    if x.dtype != gl.float8e4nv or dtype != gl.bfloat16:
        y = x.to(dtype)
    else:
        y = gl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, slo, shi, k, z;
            prmt.b32 lo, $2, 0, 0x1404;
            prmt.b32 hi, $2, 0, 0x3424;
            shr.b32 slo, lo, 4;
            shr.b32 shi, hi, 4;
            and.b32 slo, slo, 0x07f007f0;
            and.b32 shi, shi, 0x07f007f0;
            and.b32 lo, lo, 0x80008000;
            and.b32 hi, hi, 0x80008000;
            or.b32 lo, lo, slo;
            or.b32 hi, hi, shi;
            mov.b32 k, 0x7b807b80;
            mov.b32 z, 0x80008000;
            fma.rn.bf16x2 $0, lo, k, z;
            fma.rn.bf16x2 $1, hi, k, z;
            }""",
            constraints="=r,=r,r",
            args=[x.to(gl.uint8, bitcast=True)],
            dtype=gl.bfloat16,
            is_pure=True,
            pack=4,
        )
    return y


@gluon.jit
def _convert_tile(
    t,
    split,
    ring,
    conv,
    PAGE_SIZE: gl.constexpr,
    CHUNK: gl.constexpr,
    LD: gl.constexpr,
):
    """e4m3 caches: wait for full tile t's raw rows, convert them exactly into converted buffer
    t % 3 (by CHUNK-column slices, `MlaDecodeTuning.fp8_convert_cols`), then refill the
    tile's ring stage with tile t + STAGES. split: (n_full, first, row, page_table,
    stride_table); ring: (desc_c, desc_r, c_bufs, r_bufs, ready); conv: (cv_c, cv_r)."""
    n_full, first, row, page_table, stride_table = split
    desc_c, _, c_bufs, r_bufs, ready = ring
    cv_c, cv_r = conv
    STAGES: gl.constexpr = c_bufs.shape[0]
    RANK: gl.constexpr = c_bufs.shape[2]
    BN: gl.constexpr = desc_c.block_type.shape[0]
    st = t % STAGES
    page = _page_of(t + STAGES, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
    # Buffer t % 3 last held tile t - 3, whose MMAs every warpgroup has waited for by now.
    gl.thread_barrier()
    _wait_tile(ready, st, (t // STAGES) & 1, RANK // desc_c.block_type.shape[1] + 1)
    dst = cv_c.index(t % 3)
    for k in gl.static_range(RANK // CHUNK):
        part = c_bufs.index(st).slice(k * CHUNK, CHUNK, dim=1).load(LD)
        dst.slice(k * CHUNK, CHUNK, dim=1).store(_to_mma_type(part, dst.dtype))
    cv_r.index(t % 3).store(_to_mma_type(r_bufs.index(st).load(LD), dst.dtype))
    fence_async_shared()
    gl.thread_barrier()  # stage st is read (refill it) and the buffer written (MMAs may read it)
    _issue(t + STAGES, page, n_full, first, ring, PAGE_SIZE)


@gluon.jit
def _tile_scales(
    t,
    where,
    BN: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    col_l: gl.constexpr,
):
    """e4m3 caches: the scales of full tile t's rows, [BN] fp32 (per page: one value);
    where: (first row of the split's first tile, the request's page-table row, the scales)."""
    first, table_row, row_scales = where
    n0 = first + t * BN
    page = gl.load(table_row + n0 // PAGE_SIZE).to(gl.int64)
    if SCALE_MODE == 1:
        sc = gl.zeros([BN], gl.float32, col_l) + gl.load(row_scales + page)
    else:
        sc = gl.load(
            row_scales + page * PAGE_SIZE + n0 % PAGE_SIZE + gl.arange(0, BN, layout=col_l)
        )
    return sc
