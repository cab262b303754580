"""The split kernel of the absorbed MLA decode for Hopper, in Gluon (bf16 / fp16 / e4m3 caches).

Same contract as `decode._split_kernel` (one program per (split slot, 64 query-head rows),
normalised partial o [R] and log2-sum-exp per row into part_o / part_lse), written so the
tensor cores keep working while the softmax runs:

- Two warpgroups side by side along the output: for S = Q K^T each owns half of the tile's
  cache rows, for O += P V half of the 512 latent columns (acc [64, 256] fp32 each, 128
  registers a thread). The row max of S is exchanged between them through shared memory; the
  row sums are kept elementwise and reduced once at the end.
- Software pipelining across tiles (FlashAttention-3's intra-warpgroup order): tile i's
  Q K^T is issued, then tile i-1's P V, and the softmax of tile i runs while that P V is still
  on the tensor cores; only then is the accumulator rescaled.
- Full tiles come by TMA into a ring of STAGES shared-memory stages (a tile lies inside one
  page: tiles are aligned to BLOCK_N in the history and BLOCK_N divides the page size); the
  queries stay in shared memory for the whole split. The ragged last tile of a split is read
  with masked loads, so rows past the history are zeros, never stale page contents.
- e4m3 caches (SCALE_MODE 1 per page, 2 per row): each tile is converted exactly to the
  queries' type in shared memory and the scales multiply score columns and probabilities, as in
  the Triton kernel. Those steps run in order: a second converted buffer would not fit beside
  the queries and the ring. 1.26x the Triton kernel on the H200 (bf16: 1.5-1.7x at 96 heads).

Shared memory at the default shapes (K3: R 512, Dr 64, two stages of 64 rows): bf16 queries
72 KiB + 2 x 72 KiB of bf16 cache rows; e4m3: 72 KiB + 2 x 36 KiB + the 72 KiB converted tile.
The split kernel launches without programmatic dependent launch (the merge tail still uses it).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64
# 64-row tiles with two stages measured faster than 32 x 4 and 16 x 6 on the H200 (fewer
# softmax steps): 2.82 vs 3.01 and 5.0 ms on the mixed 36-request batch
# (scripts/mla_kernel_probe.py, docs/perf/mla.md).
BLOCK_N = 64
STAGES = 2


@gluon.jit
def _page_of(
    t, n_full, first, row, page_table, stride_table, BN: gl.constexpr, PAGE_SIZE: gl.constexpr
):
    """Page of full tile t (clamped to the last full tile), as int32; 0 without full tiles
    (a uniform split past the end of its history: its column may lie past the table's end)."""
    n0 = first + gl.minimum(t, gl.maximum(n_full - 1, 0)) * BN
    ptr = page_table + row * stride_table + n0 // PAGE_SIZE
    return gl.load(ptr, mask=n_full > 0, other=0).to(gl.int32)


@gluon.jit
def _issue(
    t,
    page,
    n_full,
    first,
    desc_c,
    desc_r,
    c_bufs,
    r_bufs,
    ready,
    PAGE_SIZE: gl.constexpr,
    RANK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """TMA loads of full tile t of the split (on `page`) into stage t % STAGES, predicated
    off past the last full tile."""
    BN: gl.constexpr = desc_c.block_type.shape[0]
    s = t % STAGES
    pred = t < n_full
    n0 = first + gl.minimum(t, gl.maximum(n_full - 1, 0)) * BN
    r0 = page * PAGE_SIZE + n0 % PAGE_SIZE  # TMA coordinates are 32-bit
    bar = ready.index(s)
    mbarrier.expect(bar, desc_c.block_type.nbytes + desc_r.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_c, [r0, 0], bar, c_bufs.index(s), pred)
    tma.async_copy_global_to_shared(desc_r, [r0, RANK], bar, r_bufs.index(s), pred)


@gluon.jit
def _scores(q_s, qr_s, c, r, zero_s):
    """S = Q_lat C^T + Q_rope K_rope^T for one tile, issued asynchronously."""
    s = warpgroup_mma(q_s, c.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, r.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(
    s,
    n0,
    start,
    end,
    last,
    m_i,
    l_acc,
    qk_scale,
    sc,
    col_l: gl.constexpr,
    BN: gl.constexpr,
    P_OP: gl.constexpr,
    dtype: gl.constexpr,
    HAS_SCALE: gl.constexpr,
):
    """Online-softmax step of one tile: (P in the PV operand layout, alpha, new max, row-sum
    accumulator). Rows outside [start, end) or after a query's own position are masked. FP8
    caches: sc [BN] scales the score columns and the probabilities (each cache row carries
    one scale for its key and its value), which costs no pass over the tile."""
    pos = n0 + gl.arange(0, BN, layout=col_l)
    inside = (pos >= start) & (pos < end)
    visible = inside[None, :] & (pos[None, :] <= last[:, None])
    if HAS_SCALE:
        s = s * sc[None, :]
    s = gl.where(visible, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_acc = l_acc * alpha[:, None] + p
    if HAS_SCALE:
        p = p * sc[None, :]
    return gl.convert_layout(p.to(dtype), P_OP), alpha, m_new, l_acc


@gluon.jit
def _split_kernel_gluon(
    q_lat,  # [T, H, R] strided, bf16
    q_rope,  # [T, H, Dr] strided
    pages,  # [NP, P, R + Dr] (ragged tiles)
    row_scales,  # FP8 caches: [NP] or [NP, P] fp32, else unused
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
    SCALE_MODE: gl.constexpr,  # 0 none (bf16 / fp16 cache), 1 per page, 2 per row (e4m3)
):
    BM: gl.constexpr = 64
    BN: gl.constexpr = desc_c.block_type.shape[0]
    ROWS: gl.constexpr = N_QUERY * NUM_HEADS
    WIDTH: gl.constexpr = RANK + ROPE
    cache_t: gl.constexpr = desc_c.block_type.element_ty
    dtype: gl.constexpr = q_lat.dtype.element_ty  # the MMAs' operand type
    HAS_SCALE: gl.constexpr = SCALE_MODE != 0
    CHUNK: gl.constexpr = 128 if RANK > 128 else RANK
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, RANK // 2, 16]
    )
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, S_L)
    col_l: gl.constexpr = gl.SliceLayout(0, S_L)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

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
    # Tiles are aligned to BN in the history (so a full tile never crosses a page); a split
    # that starts mid-tile masks the rows before its start (earlier rows of the same history).
    first = start - start % BN
    n_full = gl.maximum(end - first, 0) // BN

    c_bufs = gl.allocate_shared_memory(cache_t, [STAGES, BN, RANK], desc_c.layout)
    r_bufs = gl.allocate_shared_memory(cache_t, [STAGES, BN, ROPE], desc_r.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        page = _page_of(i, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
        _issue(
            i, page, n_full, first, desc_c, desc_r, c_bufs, r_bufs, ready, PAGE_SIZE, RANK, STAGES
        )

    # Queries of this program's rows (query j, head h) = m, into shared memory for the split.
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

    offs_m = pid_m * BM + gl.arange(0, BM, layout=row_l)
    last = length - N_QUERY + offs_m // NUM_HEADS  # query j sees rows 0 .. L - n + j
    zero_s = gl.zeros([BM, BN], gl.float32, S_L)
    acc = gl.zeros([BM, RANK], gl.float32, O_L)
    m_i = gl.full([BM], -1.0e30, gl.float32, row_l)
    l_acc = gl.zeros([BM, BN], gl.float32, S_L)

    if HAS_SCALE:
        # FP8 cache: each tile is converted to the MMA type exactly (e4m3 -> bf16 / fp16) into
        # one shared buffer, so the steps run in order (no second buffer fits beside the
        # queries and the ring); the TMA ring still runs STAGES tiles ahead.
        cb = gl.allocate_shared_memory(
            dtype, [BN, RANK], gl.NVMMASharedLayout.get_default_for([BN, RANK], dtype)
        )
        rb = gl.allocate_shared_memory(
            dtype, [BN, ROPE], gl.NVMMASharedLayout.get_default_for([BN, ROPE], dtype)
        )
        offs_n = gl.arange(0, BN, layout=col_l)
        for t in range(n_full):
            st = t % STAGES
            n0 = first + t * BN
            pg_t = gl.load(page_table + row * stride_table + n0 // PAGE_SIZE).to(gl.int64)
            if SCALE_MODE == 1:
                sc = gl.zeros([BN], gl.float32, col_l) + gl.load(row_scales + pg_t)
            else:
                sc = gl.load(row_scales + pg_t * PAGE_SIZE + n0 % PAGE_SIZE + offs_n)
            nxt = _page_of(t + STAGES, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
            mbarrier.wait(ready.index(st), (t // STAGES) & 1)
            # Convert by 128-column chunks (a whole tile in registers would spill).
            for k in gl.static_range(RANK // CHUNK):
                part = c_bufs.index(st).slice(k * CHUNK, CHUNK, dim=1).load(LD)
                cb.slice(k * CHUNK, CHUNK, dim=1).store(part.to(dtype))
            rb.store(r_bufs.index(st).load(LD).to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # stage st is read (refill it) and cb is written (MMAs read it)
            _issue(
                t + STAGES,
                nxt,
                n_full,
                first,
                desc_c,
                desc_r,
                c_bufs,
                r_bufs,
                ready,
                PAGE_SIZE,
                RANK,
                STAGES,
            )
            s = _scores(q_s, qr_s, cb, rb, zero_s)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_acc = _softmax(
                s, n0, start, end, last, m_i, l_acc, qk_scale, sc, col_l, BN, P_OP, dtype, True
            )
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            acc = warpgroup_mma(p, cb, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # the MMAs read cb before the next tile overwrites it
    else:
        cb = c_bufs.index(0)
        rb = r_bufs.index(0)
        if n_full > 0:
            mbarrier.wait(ready.index(0), 0)
            s = _scores(q_s, qr_s, c_bufs.index(0), r_bufs.index(0), zero_s)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_acc = _softmax(
                s, first, start, end, last, m_i, l_acc, qk_scale, 1.0, col_l, BN, P_OP, dtype, False
            )
            for t in range(1, n_full):
                st = t % STAGES
                prev = (t - 1) % STAGES
                # The page of the tile fetched at the end of this step, looked up before the wait
                # so that its latency hides behind the MMAs.
                page = _page_of(
                    t - 1 + STAGES, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE
                )
                mbarrier.wait(ready.index(st), (t // STAGES) & 1)
                s = _scores(q_s, qr_s, c_bufs.index(st), r_bufs.index(st), zero_s)
                acc = warpgroup_mma(p, c_bufs.index(prev), acc, is_async=True)
                # Tile t's scores are ready while tile t-1's P V may still run.
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                p, alpha, m_i, l_acc = _softmax(
                    s,
                    first + t * BN,
                    start,
                    end,
                    last,
                    m_i,
                    l_acc,
                    qk_scale,
                    1.0,
                    col_l,
                    BN,
                    P_OP,
                    dtype,
                    False,
                )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                # Stage prev is free again: fetch the tile STAGES after it. Each warpgroup
                # waited for its own MMAs only; the barrier makes it every warpgroup's.
                gl.thread_barrier()
                _issue(
                    t - 1 + STAGES,
                    page,
                    n_full,
                    first,
                    desc_c,
                    desc_r,
                    c_bufs,
                    r_bufs,
                    ready,
                    PAGE_SIZE,
                    RANK,
                    STAGES,
                )
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            last_st = (n_full - 1) % STAGES
            acc = warpgroup_mma(p, c_bufs.index(last_st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    n_tail = first + n_full * BN
    if n_tail < end:
        # The ragged last tile: masked loads into a free buffer, once every warpgroup's MMAs
        # have completed.
        gl.thread_barrier()
        pos_l = n_tail + gl.arange(0, BN, layout=gl.SliceLayout(1, LD))
        k_ok = (pos_l >= start) & (pos_l < end)
        pg = gl.load(page_table + row * stride_table + pos_l // PAGE_SIZE, mask=k_ok, other=0)
        base = pg.to(gl.int64) * stride_page + (pos_l % PAGE_SIZE) * WIDTH
        for k in gl.static_range(RANK // CHUNK):  # by chunks, as above
            offs_c = k * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD))
            c = gl.load(pages + base[:, None] + offs_c[None, :], mask=k_ok[:, None], other=0.0)
            cb.slice(k * CHUNK, CHUNK, dim=1).store(c.to(dtype))
        kr = gl.load(pages + base[:, None] + RANK + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        rb.store(kr.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        sc = 1.0
        if HAS_SCALE:
            pos_s = n_tail + gl.arange(0, BN, layout=col_l)
            ok_s = (pos_s >= start) & (pos_s < end)
            pg_s = gl.load(
                page_table + row * stride_table + pos_s // PAGE_SIZE, mask=ok_s, other=0
            ).to(gl.int64)
            if SCALE_MODE == 1:
                sc = gl.load(row_scales + pg_s, mask=ok_s, other=0.0)
            else:
                sc = gl.load(
                    row_scales + pg_s * PAGE_SIZE + pos_s % PAGE_SIZE, mask=ok_s, other=0.0
                )
        s = warpgroup_mma(q_s, cb.permute((1, 0)), zero_s, use_acc=False)
        s = warpgroup_mma(qr_s, rb.permute((1, 0)), s)
        p, alpha, m_i, l_acc = _softmax(
            s,
            n_tail,
            start,
            end,
            last,
            m_i,
            l_acc,
            qk_scale,
            sc,
            col_l,
            BN,
            P_OP,
            dtype,
            HAS_SCALE,
        )
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(p, cb, acc)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    l_i = gl.sum(l_acc, 1)
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))
    m_ok = offs_m < gl.where(live, ROWS, 0)
    gl.store(part_lse + slot.to(gl.int64) * ROWS + offs_m, lse, mask=m_ok)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, O_L))[:, None]
    offs_mo = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, O_L))
    offs_ro = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_L))
    part = slot.to(gl.int64) * ROWS + offs_mo
    gl.store(
        part_o + part[:, None] * RANK + offs_ro[None, :],
        o,
        mask=(offs_mo < gl.where(live, ROWS, 0))[:, None],
    )


def descriptors(
    pages: torch.Tensor, rank: int, block_n: int = BLOCK_N
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the page pool [NP, P, R + Dr] (bf16, fp16 or e4m3) as rows:
    [block_n, R] latent boxes and [block_n, Dr] shared-key boxes."""
    flat = pages.view(-1, pages.shape[-1])
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(pages.dtype, gl.float8e4nv)
    out = []
    for cols in (rank, flat.shape[1] - rank):
        block = [block_n, cols]
        layout = gl.NVMMASharedLayout.get_default_for(block, elem)
        out.append(TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout))
    return out[0], out[1]


def fits(rank: int, rope: int, page_size: int) -> bool:
    """Shapes the kernel tiles: R and Dr powers of two (64 <= R <= 512: each warpgroup's MMA is
    R/2 wide; 16 <= Dr <= 256), whole tiles inside a page, and the shared memory it takes."""
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    smem = 2 * (BLOCK_M + STAGES * BLOCK_N) * (rank + rope)
    return (
        pow2(rank)
        and 64 <= rank <= 512
        and pow2(rope)
        and 16 <= rope <= 256
        and page_size % BLOCK_N == 0
        and smem <= 224 * 1024
    )
