"""The FP8 down GEMM of the routed experts for Hopper, in Gluon (large batches).

y = h W2^T over the segment layout of align.py, with h in e4m3 and 1 x 128 scales, W2 in e4m3
with 128 x 128 block scales: the contract of grouped_gemm._down_kernel with WFMT = FP8.

Why Gluon: every 128-K partial product of a block-scaled FP8 GEMM has to be promoted into
an fp32 accumulator by itself (Hopper's FP8 MMA accumulates in reduced precision). Triton
waits for each MMA before that promotion. Here the MMA of K step k+1 is issued before step
k's partial is promoted (`warpgroup_mma_wait(num_outstanding=1)`), and one [64, 256] product
per tile gives each warpgroup 128-column wgmma instructions (the Triton tile's two [64, 128]
products issue 64-column ones). On the H200 at 16384 tokens this kernel takes 597 us where
the Triton one takes 687 us (docs/perf/moe.md, bullet "FP8 in Gluon (down GEMM)"); the outputs agree
within 1e-3 relative RMS (tests/model/ops/test_moe_gluon_fp8.py). Caveat: ptxas (Triton 3.6,
sm_90a) reports C7514 for this loop, "wgmma.mma_async instructions are serialized": the
promotion reads accumulator registers inside the wgmma pipeline, so the issued overlap is not
what runs (docs/perf/moe.md, bullet "FP8 GEMMs run at ~39% of the FP8 matmul").

Persistent over (block, n-tile), block-major, bound read on the device; TMA fills a ring of
shared-memory stages across tile boundaries and the scales are loaded three K steps ahead.
Shapes: BLOCK_M 64 (the segment alignment), 256 output columns per tile (two weight-scale
blocks: a column's scale is picked per warpgroup half), BK 128; L a multiple of 256 and I
of 128. These are the layout's, not knobs; the one knob, the ring's depth, is `stages`, which
`fused_experts` takes from `MoeKernelConfig.down.num_stages`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._launch import cdiv

BM, BN, BK = 64, 256, 128


@gluon.jit
def _tile(tile, tiling, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first h row, first W2 row, offset of its two scale rows, expert) of a tile.
    tiling: (block_expert_ptr, n_tiles, L, stride_se, stride_sn)."""
    block_expert_ptr, n_tiles, L, stride_se, stride_sn = tiling
    blk = tile // n_tiles
    t = tile % n_tiles
    # A block past the ones in use has expert -1; only a program with no tile at all looks one
    # up (its loads are predicated off), so clamp to keep every address inside the buffers.
    e = gl.maximum(gl.load(block_expert_ptr + blk), 0)
    s = e * stride_se + (t * (BLOCK_N // 128)) * stride_sn
    return blk * BLOCK_M, e * L + t * BLOCK_N, s, e


@gluon.jit
def _pick(use_next, cur, nxt):
    return cur + use_next * (nxt - cur)


@gluon.jit
def _issue_loads(q, my_steps, KSTEPS, j, cur, nxt, ring):
    """TMA loads of this program's local K step q (of its tile j or of the next one) into
    stage q % STAGES; predicated off past its last step. cur, nxt: the _tile coordinates of
    tile j and of the next one; ring: (h_desc, w_desc, a_bufs, b_bufs, ready)."""
    h_desc, w_desc, a_bufs, b_bufs, ready = ring
    STAGES: gl.constexpr = a_bufs.shape[0]
    s = q % STAGES
    use_next = (q // KSTEPS != j).to(gl.int32)
    k = (q % KSTEPS) * h_desc.block_type.shape[1]
    pred = q < my_steps
    bar = ready.index(s)
    mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        h_desc, [_pick(use_next, cur[0], nxt[0]), k], bar, a_bufs.index(s), pred
    )
    tma.async_copy_global_to_shared(
        w_desc, [_pick(use_next, cur[1], nxt[1]), k], bar, b_bufs.index(s), pred
    )


@gluon.jit
def _load_scales(q, my_steps, KSTEPS, j, cur, nxt, scales):
    """Scales of local K step q (clamped to the last step): h's [BM] row scales and the
    tile's two weight-block scales. With no step at all it reads step 0 (never used).
    cur, nxt: as for _issue_loads; scales: (hs_ptr, s2_ptr, stride_hsr, stride_hsk,
    stride_sn, offs_m)."""
    hs_ptr, s2_ptr, stride_hsr, stride_hsk, stride_sn, offs_m = scales
    q = gl.maximum(gl.minimum(q, my_steps - 1), 0)
    use_next = (q // KSTEPS != j).to(gl.int32)
    k = q % KSTEPS
    rows = _pick(use_next, cur[0], nxt[0]) + offs_m
    a_s = gl.load(hs_ptr + rows * stride_hsr + k * stride_hsk)
    w = s2_ptr + _pick(use_next, cur[2], nxt[2]) + k
    return a_s, gl.load(w), gl.load(w + stride_sn)


@gluon.jit
def _mma_async(cons, ring, zero):
    """Wait for the stage of local K step cons and issue its MMA asynchronously, not
    accumulating (zero): every step's partial is promoted into the accumulator by itself."""
    _, _, a_bufs, b_bufs, ready = ring
    STAGES: gl.constexpr = a_bufs.shape[0]
    s = cons % STAGES
    mbarrier.wait(ready.index(s), (cons // STAGES) & 1)
    return warpgroup_mma(
        a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _promote(acc, partial, step_scales, first_block):
    """acc + a finished step's partial product times its scales (from _load_scales): h's row
    scales and, per warpgroup half of the columns, the weight block's scale."""
    a_s, w0, w1 = step_scales
    return acc + partial * (a_s[:, None] * gl.where(first_block, w0, w1)[None, :])


@gluon.jit
def _down_kernel_fp8_gluon(
    h_desc,  # [rows_cap, I] e4m3, segment layout; TMA blocks [BM, BK]
    w_desc,  # W2 as [E * L, I] e4m3; TMA blocks [BN, BK]
    hs_ptr,  # h scales, [rows_cap, I/128] fp32 (strides stride_hsr, stride_hsk)
    s2_ptr,  # [E, L/128, I/128] fp32 block scales of W2
    y_ptr,  # [rows_cap, L] bf16, segment layout
    block_expert_ptr,
    expert_start_ptr,
    counts_ptr,
    num_blocks_ptr,
    L,
    inter,
    stride_hsr,
    stride_hsk,
    stride_se,
    stride_sn,
    STAGES: gl.constexpr,
):
    BLOCK_M: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # Two warpgroups side by side along N: each owns 128 columns, i.e. one weight-scale block.
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 32]
    )
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], h_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    KSTEPS = inter // BLOCK_K
    n_tiles = gl.cdiv(L, BLOCK_N)
    total = gl.load(num_blocks_ptr) * n_tiles
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    my_tiles = gl.maximum(total - pid + nprog - 1, 0) // nprog
    my_steps = my_tiles * KSTEPS
    offs_m = gl.arange(0, BLOCK_M, layout=row_l)
    offs_n = gl.arange(0, BLOCK_N, layout=col_l)
    first_block = offs_n < 128
    tiling = (block_expert_ptr, n_tiles, L, stride_se, stride_sn)
    ring = (h_desc, w_desc, a_bufs, b_bufs, ready)
    scales = (hs_ptr, s2_ptr, stride_hsr, stride_hsk, stride_sn, offs_m)

    # Two streams run ahead of the MMAs across tile boundaries: the TMA loads (STAGES steps)
    # and the scale loads (3 steps); a tile looks up its successor's coordinates at its start.
    cur = _tile(gl.minimum(pid, gl.maximum(total - 1, 0)), tiling, BLOCK_M, BLOCK_N)
    for i in gl.static_range(STAGES):
        _issue_loads(i, my_steps, KSTEPS, 0, cur, cur, ring)
    prod = gl.to_tensor(STAGES)
    cons = gl.to_tensor(0)
    c0 = _load_scales(0, my_steps, KSTEPS, 0, cur, cur, scales)
    c1 = _load_scales(1, my_steps, KSTEPS, 0, cur, cur, scales)
    c2 = _load_scales(2, my_steps, KSTEPS, 0, cur, cur, scales)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for j in range(my_tiles):
        tile = pid + j * nprog
        t = tile % n_tiles
        cur_a, _, _, cur_e = cur
        row_end = gl.load(expert_start_ptr + cur_e) + gl.load(counts_ptr + cur_e)
        nxt = _tile(gl.minimum(tile + nprog, total - 1), tiling, BLOCK_M, BLOCK_N)
        q0 = j * KSTEPS
        acc = zero
        # K step 0: issue its MMA; every step's partial is promoted one step later.
        p = _mma_async(cons, ring, zero)
        cons += 1
        for k in range(1, KSTEPS):
            c3 = _load_scales(q0 + k + 2, my_steps, KSTEPS, j, cur, nxt, scales)
            pn = _mma_async(cons, ring, zero)
            # The previous step's MMA is done (the one just issued may still run): refill its
            # stage and promote its partial while the tensor cores work.
            pd = warpgroup_mma_wait(num_outstanding=1, deps=(p,))
            # Both warpgroups read the stage's h tile: the refill waits for the other's MMA too.
            gl.thread_barrier()
            _issue_loads(prod, my_steps, KSTEPS, j, cur, nxt, ring)
            prod += 1
            acc = _promote(acc, pd, c0, first_block)
            p = pn
            c0 = c1
            c1 = c2
            c2 = c3
            cons += 1
        pd = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        gl.thread_barrier()  # as above
        _issue_loads(prod, my_steps, KSTEPS, j, cur, nxt, ring)
        prod += 1
        c3 = _load_scales(q0 + KSTEPS + 2, my_steps, KSTEPS, j, cur, nxt, scales)
        acc = _promote(acc, pd, c0, first_block)
        c0 = c1
        c1 = c2
        c2 = c3

        rows = cur_a + offs_m
        cols = t * BLOCK_N + offs_n
        ptrs = y_ptr + rows.to(gl.int64)[:, None] * L + cols[None, :]
        gl.store(ptrs, acc.to(gl.bfloat16), mask=(rows < row_end)[:, None] & (cols < L)[None, :])
        cur = nxt

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def applies(width: int, inter: int, block_m: int) -> bool:
    """Whether the kernel's tiles fit these expert shapes and segment alignment."""
    return block_m == BM and width % BN == 0 and inter % BK == 0


def down_fp8(
    h: torch.Tensor,
    hs: torch.Tensor,
    layout,
    w2: torch.Tensor,
    s2: torch.Tensor,
    y: torch.Tensor,
    *,
    programs: int,
    stages: int = 4,
) -> None:
    """y = h W2^T for the rows of `layout` (an align.PairLayout with BLOCK_M 64), into y.

    h: [rows_cap, I] e4m3 with hs [rows_cap, I/128] fp32 (any strides); w2: [E, L, I] e4m3,
    contiguous, with s2 [E, L/128, I/128]; y: [rows_cap, L] bf16. stages: shared-memory ring
    depth (40 KiB a stage)."""
    num_e, width, inter = w2.shape
    if not applies(width, inter, layout.block_m) or not w2.is_contiguous():
        raise ValueError(
            f"Gluon FP8 down GEMM: needs BLOCK_M {BM}, L % {BN} == 0, I % {BK} == 0 and a "
            f"contiguous W2; got BLOCK_M {layout.block_m}, W2 {tuple(w2.shape)}"
        )
    grid = (max(1, min(programs, layout.block_expert.shape[0] * cdiv(width, BN))),)
    _down_kernel_fp8_gluon[grid](
        _desc(h, [BM, BK]),
        _desc(w2.reshape(num_e * width, inter), [BN, BK]),
        hs,
        s2,
        y,
        layout.block_expert,
        layout.expert_start,
        layout.counts,
        layout.num_blocks,
        width,
        inter,
        hs.stride(0),
        hs.stride(1),
        s2.stride(0),
        s2.stride(1),
        STAGES=stages,
        num_warps=8,
    )
