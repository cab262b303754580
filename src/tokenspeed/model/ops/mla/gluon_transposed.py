"""The split kernel of the absorbed MLA decode for a 32-row remainder, cache rows on the MMA's
M side (Hopper, Gluon; bf16 / fp16 caches).

`gluon_decode._split_kernel_gluon` puts query rows on the MMA's M side, 64 at a time: with
Kimi Linear's 32 heads (one query) a program holds 32 real rows and 32 of padding, and with
K3's 96 heads so does the last program of each split; each does the MMA work of 64 rows. This
kernel computes 32 rows transposed, with the tile's cache rows as M (64 per MMA) and the 32
query rows as N:

- S^T = C Q^T + K_rope Qr^T: [64 cache rows, 32 query rows], the cache tile straight from its
  TMA stage as the A operand and the resident queries as B;
- the online softmax runs down the columns (per query row: max and sums over the tile's rows);
- P^T goes to shared memory (the B operand of the next MMA), and O^T += C^T P^T: [R, 32] fp32,
  the same cache tile read transposed (an M-major A operand).

Same contract as `_split_kernel_gluon` for rows ROW0 .. ROW0 + 31 of each split: normalised
partial o and log2-sum-exp into part_o / part_lse. One warpgroup; the TMA ring, the step order
(P V of tile t-1 and Q K^T of tile t in flight together, the stage refilled as soon as that
P V is done) and the ragged last tile are those of `gluon_decode`.

A probe timed the MMAs alone (docs/perf/mla.md) on the H200: the transposed 32-row block
takes about 0.65-0.7x the time of a padded 64-row program's. `takes_remainder` says where
the library launches it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_decode import _load_queries, _load_tail, _lse, _publish
from .gluon_ring import _chunk_bar, _issue, _page_of, _split_bounds, _start_ring

BLOCK_ROWS = 32  # query rows per program (the MMA's N)


def takes_remainder(rows: int, fp8: bool) -> bool:
    """Whether the library gives this kernel the last 32 of a call's `rows` query rows per
    request (bf16 / fp16 caches). Only when they are all of them: Kimi Linear's 32 heads with
    one query, 1.17x the padded 64-row program on the H200. Behind 64-row programs (K3's 96
    heads) it lost: as a second launch 1.06x slower (a split's programs no longer share their
    cache tiles through L2), and as the last program of the same grid with 8 warps no faster
    (docs/perf/mla.md)."""
    return not fp8 and rows == BLOCK_ROWS


@gluon.jit
def _scores_t(q_s, qr_s, c, r, zero_s, ready, st, phase, CW: gl.constexpr, PRED: gl.constexpr):
    """S^T [BN, HB] of ring stage st (PRED: wait for its chunks first), one asynchronous MMA
    group per latent chunk and one for the shared key."""
    RANK: gl.constexpr = q_s.shape[1]
    NCH: gl.constexpr = RANK // CW + 1
    s = zero_s
    for k in gl.static_range(RANK // CW):
        if PRED:
            mbarrier.wait(_chunk_bar(ready, st, k, NCH), phase)
        s = warpgroup_mma(
            c.slice(k * CW, CW, dim=1),
            q_s.slice(k * CW, CW, dim=1).permute((1, 0)),
            s,
            use_acc=k > 0,
            is_async=True,
        )
    if PRED:
        mbarrier.wait(_chunk_bar(ready, st, NCH - 1, NCH), phase)
    return warpgroup_mma(r, qr_s.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_t(s, n0, m_i, l_acc, bounds, BN: gl.constexpr):
    """Online-softmax step down the columns of S^T [BN, HB] for the tile whose first history
    row is n0: (P^T, alpha, new max, row-sum accumulator), all per query row (column).
    bounds: (start, end, last [HB], qk_scale), as in `gluon_decode._softmax`."""
    start, end, last, qk_scale = bounds
    row_l: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    pos = n0 + gl.arange(0, BN, layout=row_l)
    inside = (pos >= start) & (pos < end)
    visible = inside[:, None] & (pos[:, None] <= last[None, :])
    s = gl.where(visible, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_acc = l_acc * alpha[None, :] + p
    return p, alpha, m_new, l_acc


@gluon.jit
def _split_kernel_transposed(
    q_lat,  # [T, H, R] strided, bf16 / fp16
    q_rope,  # [T, H, Dr] strided
    pages,  # [NP, P, R + Dr] (ragged tiles)
    row_scales,  # unused (bf16 / fp16 caches only)
    desc_c,  # TMA over pages as [NP * P, R + Dr]: blocks [BN, CW] of the latent part
    desc_r,  # the same rows: blocks [BN, Dr] at column R
    page_table,  # [B, MP] int32
    context_lens,  # [B]
    split_order,  # [S] int32 (planner mode)
    split_row,
    split_start,
    split_len,
    part_o,  # [S, n * H, R] fp32
    part_lse,  # [S, n * H] fp32, log2 domain
    qk_scale,
    stride_lt,
    stride_lh,
    stride_rt,
    stride_rh,
    stride_page,
    stride_table,
    uniform_splits,
    NUM_HEADS: gl.constexpr,
    N_QUERY: gl.constexpr,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    UNIFORM: gl.constexpr,
    GRANULE: gl.constexpr,
    STAGES: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    ROW0: gl.constexpr,  # first of this program's BLOCK_ROWS query rows (query j, head h)
):
    gl.static_assert(SCALE_MODE == 0, "bf16 / fp16 caches only")
    HB: gl.constexpr = 32
    BN: gl.constexpr = desc_c.block_type.shape[0]
    CW: gl.constexpr = desc_c.block_type.shape[1]
    NCH: gl.constexpr = RANK // CW + 1
    ROWS: gl.constexpr = N_QUERY * NUM_HEADS
    dtype: gl.constexpr = q_lat.dtype.element_ty
    gl.static_assert(desc_c.block_type.element_ty == dtype, "cache and queries of one type")
    # S^T [BN, HB] and O^T [R, HB] share one layout: alpha and the row bounds broadcast along
    # the query columns of both.
    L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16]
    )
    col_l: gl.constexpr = gl.SliceLayout(0, L)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    plan = (context_lens, split_order, split_row, split_start, split_len, uniform_splits)
    slot, row, start, end, length, live, first, n_full = _split_bounds(
        gl.program_id(1), plan, UNIFORM, GRANULE, BN
    )
    ring_at = (n_full, first, row, page_table, stride_table)
    ring = _start_ring(desc_c, desc_r, ring_at, STAGES, RANK, PAGE_SIZE)
    _, _, c_bufs, r_bufs, ready = ring

    # This program's query rows, resident in shared memory for the split (the B operand).
    offs_ml = ROW0 + gl.arange(0, HB, layout=gl.SliceLayout(1, LD))
    q = (q_lat, q_rope, stride_lt, stride_lh, stride_rt, stride_rh)
    ok_l = offs_ml < gl.where(live, ROWS, 0)
    ql, qr = _load_queries(q, offs_ml, row, ok_l, N_QUERY, NUM_HEADS, RANK, ROPE, LD)
    q_s = gl.allocate_shared_memory(
        dtype, [HB, RANK], gl.NVMMASharedLayout.get_default_for([HB, RANK], dtype), ql
    )
    qr_s = gl.allocate_shared_memory(
        dtype, [HB, ROPE], gl.NVMMASharedLayout.get_default_for([HB, ROPE], dtype), qr
    )
    p_s = gl.allocate_shared_memory(
        dtype, [BN, HB], gl.NVMMASharedLayout.get_default_for([BN, HB], dtype)
    )
    fence_async_shared()
    gl.thread_barrier()

    offs_h = ROW0 + gl.arange(0, HB, layout=col_l)
    last = length - N_QUERY + offs_h // NUM_HEADS  # query j sees rows 0 .. L - n + j
    bounds = (start, end, last, qk_scale)
    zero_s = gl.zeros([BN, HB], gl.float32, L)
    acc = gl.zeros([RANK, HB], gl.float32, L)
    m_i = gl.full([HB], -1.0e30, gl.float32, col_l)
    l_acc = gl.zeros([BN, HB], gl.float32, L)

    if n_full > 0:
        s = _scores_t(q_s, qr_s, c_bufs.index(0), r_bufs.index(0), zero_s, ready, 0, 0, CW, True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_acc = _softmax_t(s, first, m_i, l_acc, bounds, BN)
        _publish(p, p_s)
        for t in range(1, n_full):
            st = t % STAGES
            prev = (t - 1) % STAGES
            page = _page_of(
                t - 1 + STAGES, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE
            )
            # O^T of tile t-1 and S^T of tile t in flight together; stage prev is refilled as
            # soon as that O^T is done.
            acc = warpgroup_mma(c_bufs.index(prev).permute((1, 0)), p_s, acc, is_async=True)
            s = _scores_t(
                q_s,
                qr_s,
                c_bufs.index(st),
                r_bufs.index(st),
                zero_s,
                ready,
                st,
                (t // STAGES) & 1,
                CW,
                True,
            )
            acc = warpgroup_mma_wait(num_outstanding=NCH, deps=(acc,))
            gl.thread_barrier()  # every warp's O^T on stage prev (and on P^T) is done
            _issue(t - 1 + STAGES, page, n_full, first, ring, PAGE_SIZE)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_acc = _softmax_t(s, first + t * BN, m_i, l_acc, bounds, BN)
            acc = acc * alpha[None, :]
            _publish(p, p_s)
        last_st = (n_full - 1) % STAGES
        acc = warpgroup_mma(c_bufs.index(last_st).permute((1, 0)), p_s, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    n_tail = first + n_full * BN
    if n_tail < end:
        # The ragged last tile: masked loads into stage 0 (no load is in flight past the last
        # full tile), once every warp's MMAs have completed.
        gl.thread_barrier()
        cb = c_bufs.index(0)
        rb = r_bufs.index(0)
        table_row = page_table + row * stride_table
        _load_tail(pages, cb, rb, (n_tail, start, end), table_row, stride_page, PAGE_SIZE, LD)
        s = _scores_t(q_s, qr_s, cb, rb, zero_s, ready, 0, 0, CW, False)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_acc = _softmax_t(s, n_tail, m_i, l_acc, bounds, BN)
        acc = acc * alpha[None, :]
        _publish(p, p_s)
        acc = warpgroup_mma(cb.permute((1, 0)), p_s, acc)

    for i in gl.static_range(STAGES):
        for k in gl.static_range(NCH):
            mbarrier.invalidate(_chunk_bar(ready, i, k, NCH))

    lse, l_safe = _lse(m_i, gl.sum(l_acc, 0))
    h_ok = offs_h < gl.where(live, ROWS, 0)
    part = slot.to(gl.int64) * ROWS + offs_h
    gl.store(part_lse + part, lse, mask=h_ok)
    o = acc / l_safe[None, :]
    offs_ro = gl.arange(0, RANK, layout=gl.SliceLayout(1, L))
    gl.store(part_o + part[None, :] * RANK + offs_ro[:, None], o, mask=h_ok[None, :])
