"""Experimental: a warp-specialized form of the Hopper MLA split kernel (bf16 / fp16 caches).

Same contract and arguments as `gluon_decode._split_kernel_gluon`. Two consumer warpgroups and
one producer warp:

- The producer warp refills the two-stage ring by TMA as soon as both consumers are done with
  a stage (an `empty` barrier per stage, two arrivals).
- Consumer c computes S = Q K^T for the tiles t with t % 2 == c, over the whole tile (one
  64 x 64 MMA per k-step instead of two 64 x 32 halves), runs the online softmax of that tile
  and publishes P (bf16, written over the tile's shared-key columns, which no MMA needs any
  more) and the new row max through shared memory. Both consumers then add P V for their half
  of the 512 latent columns. The softmax of one consumer runs while the other's MMAs do, and
  no block-wide barrier sits in the loop.
- The row max passes from the owner of tile t to the owner of tile t+1 (the chain the online
  softmax needs); each consumer keeps the row sums of its own tiles, and the two are added
  at the end.
- The ragged last tile is loaded with masked loads by both consumers (half the rows each) into
  the free stage, so rows past the history are zeros.
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

from .gluon_decode import _issue, _page_of


@gluon.jit
def _step(
    t,
    by_tma: gl.constexpr,
    s,
    acc,
    m_i,
    l_i,
    ring,
    bounds,
    loads,
    zero_s,
    C: gl.constexpr,
    PIPE: gl.constexpr,
):
    """Tile t (stage t % 2) for consumer C: if C owns it, Q K^T, the softmax on the row max
    after tile t-1, and P and the new max published; then, in
    both consumers, the rescale and P V over this consumer's half of the latent columns.
    The owner of tile t then refills its stage with tile t+2 once the other consumer is done
    with it too. PIPE: the Q K^T of this consumer's next tile (t+1) is issued in the other
    consumer's step t, before waiting for its P, and handed over in s. Returns (s, acc,
    row max, own row sums)."""
    q_s, qr_s, c_bufs, r_bufs, ready, empty, p_ready, m_buf = ring
    first, start, end, last, qk_scale = bounds
    tma_ring, n_full, row, page_table, stride_table, PAGE_SIZE = loads
    BN: gl.constexpr = c_bufs.shape[1]
    S_L: gl.constexpr = zero_s.type.layout
    row_l: gl.constexpr = gl.SliceLayout(1, S_L)
    col_l: gl.constexpr = gl.SliceLayout(0, S_L)
    PRE: gl.constexpr = PIPE and by_tma  # Q K^T of this consumer's next tile issued early
    st = t % 2
    ph = (t // 2) & 1
    refill = by_tma & (t % 2 == C) & (t + 2 < n_full)
    page = 0
    if refill:  # looked up now, so that its latency hides behind the MMAs
        page = _page_of(t + 2, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
    if t % 2 == C:
        issued = False  # in step t-1, with PIPE
        if PRE:
            issued = t > 0
        if not issued:
            if by_tma:
                _wait_ready(ready, st, ph)
            s = _scores(q_s, qr_s, c_bufs.index(st), r_bufs.index(st), zero_s)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        pos = first + t * BN + gl.arange(0, BN, layout=col_l)
        inside = (pos >= start) & (pos < end)
        visible = inside[None, :] & (pos[None, :] <= last[:, None])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        # m_i is already the max after tile t-1: this consumer read it from the owner of
        # t-1 at that step.
        m_t = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_t[:, None])
        # P over the shared-key columns of this stage: only this consumer's Q K^T read them.
        r_bufs.index(st).store(p.to(q_s.dtype))
        m_buf.index(st).store(m_t)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(st), count=1)
        alpha = gl.exp2(m_i - m_t)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = _pv(acc, alpha, r_bufs.index(st), c_bufs.index(st), C)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        if PRE:
            # This consumer's next tile, issued before waiting for the other's P. Past the last
            # full tile the MMA reads whatever the stage holds and its result is dropped (the
            # tail step computes its own), so that no async result crosses a branch.
            _wait_ready(ready, 1 - st, ((t + 1) // 2) & 1, t + 1 < n_full)
            s = _scores(q_s, qr_s, c_bufs.index(1 - st), r_bufs.index(1 - st), zero_s)
        mbarrier.wait(p_ready.index(st), ph)
        m_t = m_buf.index(st).load(row_l)
        alpha = gl.exp2(m_i - m_t)
        l_i = l_i * alpha
        acc = _pv(acc, alpha, r_bufs.index(st), c_bufs.index(st), C)
        if PRE:
            acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(st), count=1)
    if refill:
        mbarrier.wait(empty.index(st), ph)
        _issue(t + 2, page, n_full, first, tma_ring, PAGE_SIZE)
    return s, acc, m_t, l_i


@gluon.jit
def _wait_ready(ready, st, ph, pred=True):
    """Wait for every chunk of ring stage st."""
    NCH: gl.constexpr = ready.shape[0] // 2
    for k in gl.static_range(NCH):
        mbarrier.wait(ready.index(st * NCH + k), ph, pred=pred)


@gluon.jit
def _pv(acc, alpha, p_s, c, C: gl.constexpr):
    """acc * alpha + P V over consumer C's half of the latent columns, issued asynchronously."""
    HALF: gl.constexpr = acc.shape[1]
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return warpgroup_mma(p_s, c.slice(C * HALF, HALF, dim=1), acc, is_async=True)


@gluon.jit
def _scores(q_s, qr_s, c, r, zero_s):
    """S = Q_lat C^T + Q_rope K_rope^T over one whole tile, issued asynchronously."""
    s = warpgroup_mma(q_s, c.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, r.permute((1, 0)), s, is_async=True)


@gluon.jit
def _consumer(ctx, C: gl.constexpr, PIPE: gl.constexpr):
    (
        q_s,
        qr_s,
        c_bufs,
        r_bufs,
        ready,
        empty,
        p_ready,
        m_buf,
        l_buf,
        sync,
        pages,
        page_table,
        part_o,
        part_lse,
        split,
        qk_scale,
        stride_page,
        stride_table,
        NUM_HEADS,
        N_QUERY,
        PAGE_SIZE,
        tma_ring,
    ) = ctx
    slot, row, pid_m, start, end, first, n_full, length, live = split
    BM: gl.constexpr = q_s.shape[0]
    RANK: gl.constexpr = q_s.shape[1]
    ROPE: gl.constexpr = qr_s.shape[1]
    BN: gl.constexpr = c_bufs.shape[1]
    HALF: gl.constexpr = RANK // 2
    WIDTH: gl.constexpr = RANK + ROPE
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    row_l: gl.constexpr = gl.SliceLayout(1, S_L)
    orow_l: gl.constexpr = gl.SliceLayout(1, O_L)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ROWS = N_QUERY * NUM_HEADS

    offs_m = pid_m * BM + gl.arange(0, BM, layout=row_l)
    last = length - N_QUERY + offs_m // NUM_HEADS  # query j sees rows 0 .. L - n + j
    zero_s = gl.zeros([BM, BN], gl.float32, S_L)
    acc = gl.zeros([BM, HALF], gl.float32, O_L)
    m_i = gl.full([BM], -1.0e30, gl.float32, row_l)
    l_i = gl.zeros([BM], gl.float32, row_l)
    ring = (q_s, qr_s, c_bufs, r_bufs, ready, empty, p_ready, m_buf)
    bounds = (first, start, end, last, qk_scale)
    loads = (tma_ring, n_full, row, page_table, stride_table, PAGE_SIZE)
    s = zero_s
    for t in range(n_full):
        s, acc, m_i, l_i = _step(t, True, s, acc, m_i, l_i, ring, bounds, loads, zero_s, C, PIPE)
    n_tail = first + n_full * BN
    if n_tail < end:
        # The ragged last tile: each consumer loads half its rows (zeros past the history)
        # into the stage both have finished with, after the loop so that none of its
        # addresses stay live through it.
        t = n_full
        st = t % 2
        if t >= 2:
            mbarrier.wait(empty.index(st), ((t - 2) // 2) & 1)
        HR: gl.constexpr = BN // 2
        pos = n_tail + C * HR + gl.arange(0, HR, layout=gl.SliceLayout(1, LD))
        ok = (pos >= start) & (pos < end)
        pg = gl.load(page_table + row * stride_table + pos // PAGE_SIZE, mask=ok, other=0)
        base = pg.to(gl.int64) * stride_page + (pos % PAGE_SIZE) * WIDTH
        for k in gl.static_range(RANK // 128):
            offs_c = k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
            c = gl.load(pages + base[:, None] + offs_c[None, :], mask=ok[:, None], other=0.0)
            c_bufs.index(st).slice(C * HR, HR, dim=0).slice(k * 128, 128, dim=1).store(c)
        offs_d = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
        kr = gl.load(pages + base[:, None] + RANK + offs_d[None, :], mask=ok[:, None], other=0.0)
        r_bufs.index(st).slice(C * HR, HR, dim=0).store(kr)
        fence_async_shared()
        mbarrier.arrive(sync.index(0), count=1)
        mbarrier.wait(sync.index(0), 0)
        s, acc, m_i, l_i = _step(t, False, s, acc, m_i, l_i, ring, bounds, loads, zero_s, C, PIPE)

    # Row sums: each consumer holds those of its own tiles (rescaled to the final max).
    l_buf.index(C).store(l_i)
    mbarrier.arrive(sync.index(1), count=1)
    mbarrier.wait(sync.index(1), 0)
    l_tot = l_buf.index(0).load(row_l) + l_buf.index(1).load(row_l)
    seen = l_tot > 0.0
    l_safe = gl.where(seen, l_tot, 1.0)
    m_ok = offs_m < gl.where(live, ROWS, 0)
    if C == 0:
        lse = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(part_lse + slot.to(gl.int64) * ROWS + offs_m, lse, mask=m_ok)
    o = acc / gl.convert_layout(l_safe, orow_l)[:, None]
    offs_mo = pid_m * BM + gl.arange(0, BM, layout=orow_l)
    offs_ro = C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    part = slot.to(gl.int64) * ROWS + offs_mo
    gl.store(
        part_o + part[:, None] * RANK + offs_ro[None, :],
        o,
        mask=(offs_mo < gl.where(live, ROWS, 0))[:, None],
    )


@gluon.jit
def _split_kernel_seesaw(
    q_lat,  # [T, H, R] strided, bf16
    q_rope,  # [T, H, Dr] strided
    pages,  # [NP, P, R + Dr] (ragged tiles)
    row_scales,  # unused (bf16 / fp16 caches only)
    desc_c,  # TMA over pages as [NP * P, R + Dr]: blocks [BN, R] at column 0
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
    PIPE: gl.constexpr = True,  # see _step
):
    gl.static_assert(STAGES == 2, "the seesaw alternates two stages")
    gl.static_assert(SCALE_MODE == 0, "bf16 / fp16 caches only")
    BM: gl.constexpr = 64
    BN: gl.constexpr = desc_c.block_type.shape[0]
    CW: gl.constexpr = desc_c.block_type.shape[1]
    gl.static_assert(BN == ROPE, "P is written over the shared-key columns of its stage")
    NCH: gl.constexpr = RANK // CW + 1
    ROWS: gl.constexpr = N_QUERY * NUM_HEADS
    cache_t: gl.constexpr = desc_c.block_type.element_ty
    dtype: gl.constexpr = q_lat.dtype.element_ty
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    pid_m = gl.program_id(0)
    slot = gl.program_id(1)
    if UNIFORM:
        row = slot // uniform_splits
        length = gl.load(context_lens + row).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(length, uniform_splits), GRANULE) * GRANULE
        start = (slot % uniform_splits) * chunk
        end = gl.minimum(start + chunk, length)
        live = slot >= 0
    else:
        slot = gl.load(split_order + slot)
        row = gl.load(split_row + slot)
        start = gl.load(split_start + slot)
        n_rows = gl.load(split_len + slot)
        length = gl.load(context_lens + row).to(gl.int32)
        end = gl.minimum(start + n_rows, length)
        live = n_rows > 0
    end = gl.where(live, end, start)
    first = start - start % BN
    n_full = gl.maximum(end - first, 0) // BN

    c_bufs = gl.allocate_shared_memory(cache_t, [2, BN, RANK], desc_c.layout)
    r_bufs = gl.allocate_shared_memory(cache_t, [2, BN, ROPE], desc_r.layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [2 * NCH, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    sync = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)  # tail tile, final row sums
    for i in gl.static_range(2 * NCH):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(sync.index(i), count=2)
    stat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m_buf = gl.allocate_shared_memory(gl.float32, [2, BM], stat_l)
    l_buf = gl.allocate_shared_memory(gl.float32, [2, BM], stat_l)
    ring = (desc_c, desc_r, c_bufs, r_bufs, ready)
    for i in gl.static_range(2):
        page = _page_of(i, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
        _issue(i, page, n_full, first, ring, PAGE_SIZE)

    offs_ml = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LD))
    ok_l = offs_ml < gl.where(live, ROWS, 0)
    tok_l = (row * N_QUERY + offs_ml // NUM_HEADS).to(gl.int64)
    qh_l = offs_ml % NUM_HEADS
    offs_r = gl.arange(0, RANK, layout=gl.SliceLayout(0, LD))
    offs_d = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
    ql = gl.load(
        q_lat + tok_l[:, None] * stride_lt + qh_l[:, None] * stride_lh + offs_r[None, :],
        mask=ok_l[:, None],
        other=0.0,
    )
    qr = gl.load(
        q_rope + tok_l[:, None] * stride_rt + qh_l[:, None] * stride_rh + offs_d[None, :],
        mask=ok_l[:, None],
        other=0.0,
    )
    q_s = gl.allocate_shared_memory(
        dtype, [BM, RANK], gl.NVMMASharedLayout.get_default_for([BM, RANK], dtype), ql
    )
    qr_s = gl.allocate_shared_memory(
        dtype, [BM, ROPE], gl.NVMMASharedLayout.get_default_for([BM, ROPE], dtype), qr
    )
    fence_async_shared()
    gl.thread_barrier()

    split = (slot, row, pid_m, start, end, first, n_full, length, live)
    ctx = (
        q_s,
        qr_s,
        c_bufs,
        r_bufs,
        ready,
        empty,
        p_ready,
        m_buf,
        l_buf,
        sync,
        pages,
        page_table,
        part_o,
        part_lse,
        split,
        qk_scale,
        stride_page,
        stride_table,
        NUM_HEADS,
        N_QUERY,
        PAGE_SIZE,
        ring,
    )
    gl.warp_specialize([(_consumer, (ctx, 0, PIPE)), (_consumer, (ctx, 1, PIPE))], [4], [256])
