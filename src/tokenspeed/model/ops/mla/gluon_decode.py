"""The split kernel of the absorbed MLA decode for Hopper, in Gluon (bf16 / fp16 / e4m3 caches).

Same contract as `decode._split_kernel` (one program per (split slot, 64 query-head rows),
normalised partial o [R] and log2-sum-exp per row into part_o / part_lse):

- Two warpgroups side by side along the output: for S = Q K^T each owns half of the tile's
  cache rows, for O += P V half of the 512 latent columns (acc [64, 256] fp32 each, 128
  registers a thread). The row max of S is exchanged between them through shared memory; the
  row sums are kept elementwise and reduced once at the end. P goes to shared memory for P V
  (`_publish`).
- Full tiles come by TMA into a ring of STAGES shared-memory stages (`gluon_ring`: a tile lies
  inside one page); the queries stay in shared memory for the whole split. The ragged last
  tile of a split is read with masked loads, so rows past the history are zeros, never stale
  page contents.
- Step order (bf16 / fp16): tile t-1's P V is issued, then tile t's Q K^T; as soon as that
  P V is done, its stage is refilled with tile t+1 while Q K^T still runs, then the softmax of
  tile t. With the queries resident only two 64-row stages fit, and a stage holds its tile
  until that tile's P V: FlashAttention-3's order (Q K^T of t, then P V of t-1 under the
  softmax of t) can refill a stage only at the very end of a step, so every tile's load
  latency was exposed. This order measured 1.23x faster on the H200 (2.08 against 2.56 ms on
  the mixed 36-request batch, docs/perf/mla.md), though the softmax now runs with the tensor
  cores idle.
- e4m3 caches (SCALE_MODE 1 per page, 2 per row): 32-row tiles; tile t+1 is converted exactly
  to the queries' type into one of three shared buffers while tile t's MMAs run, and the
  scales multiply score columns and probabilities, as in the Triton kernel (`gluon_convert`:
  the conversion to bf16 goes by bit moves). 1.7x the Triton kernel on the H200, though still
  2.0x the bf16 path's time (32-row tiles, a conversion between the MMAs).

Shared memory at the default shapes (K3: R 512, Dr 64): bf16 queries 72 KiB + 2 x 72 KiB of
64-row cache tiles + 8 KiB of P; e4m3: 72 KiB + 2 x 18 KiB of raw 32-row tiles + 3 x 36 KiB
converted.
The split kernel launches without programmatic dependent launch (the merge tail still uses it).
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

from .decode import MlaDecodeTuning
from .gluon_convert import _convert_tile, _tile_scales, _to_mma_type
from .gluon_ring import _chunk_bar, _issue, _page_of, _split_bounds, _start_ring

# Query rows per program: one Hopper warpgroup MMA tile (m64), the layouts' [4, 2] warps. The
# tunable parts (cache rows per tile, ring stages, e4m3 conversion width, and their measured
# defaults) are `decode.MlaDecodeTuning`'s gluon_block_n, gluon_stages and fp8_convert_cols.
BLOCK_M = 64


@gluon.jit
def _load_queries(
    q,
    offs_m,
    row,
    ok,
    N_QUERY: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    LD: gl.constexpr,
):
    """Query rows offs_m (query j, head h) of request `row` as [len(offs_m), R] and
    [len(offs_m), Dr] in layout LD, zeros where not `ok`. q: (q_lat, q_rope, stride_lt,
    stride_lh, stride_rt, stride_rh)."""
    q_lat, q_rope, stride_lt, stride_lh, stride_rt, stride_rh = q
    tok = (row * N_QUERY + offs_m // NUM_HEADS).to(gl.int64)
    qh = offs_m % NUM_HEADS
    offs_r = gl.arange(0, RANK, layout=gl.SliceLayout(0, LD))
    offs_d = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
    ql = gl.load(
        q_lat + tok[:, None] * stride_lt + qh[:, None] * stride_lh + offs_r[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    qr = gl.load(
        q_rope + tok[:, None] * stride_rt + qh[:, None] * stride_rh + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    return ql, qr


@gluon.jit
def _load_tail(pages, cb, rb, span, table_row, stride_page, PAGE_SIZE: gl.constexpr, LD):
    """The ragged last tile into buffers cb [BN, R] / rb [BN, Dr] (converted to their type) by
    masked loads: rows outside span = (n_tail, start, end) are zeros, never stale contents."""
    n_tail, start, end = span
    BN: gl.constexpr = cb.shape[0]
    RANK: gl.constexpr = cb.shape[1]
    ROPE: gl.constexpr = rb.shape[1]
    CHUNK: gl.constexpr = 128 if RANK > 128 else RANK
    pos_l = n_tail + gl.arange(0, BN, layout=gl.SliceLayout(1, LD))
    k_ok = (pos_l >= start) & (pos_l < end)
    pg = gl.load(table_row + pos_l // PAGE_SIZE, mask=k_ok, other=0)
    base = pg.to(gl.int64) * stride_page + (pos_l % PAGE_SIZE) * (RANK + ROPE)
    for k in gl.static_range(RANK // CHUNK):  # by chunks: a whole tile in registers would spill
        offs_c = k * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LD))
        c = gl.load(pages + base[:, None] + offs_c[None, :], mask=k_ok[:, None], other=0.0)
        cb.slice(k * CHUNK, CHUNK, dim=1).store(_to_mma_type(c, cb.dtype))
    offs_d = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD))
    kr = gl.load(pages + base[:, None] + RANK + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    rb.store(_to_mma_type(kr, rb.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _lse(m_i, l_i):
    """(log2-sum-exp, the divisor for o) from the row max and row sum; -inf and 1 for a row
    that saw no cache row."""
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    return gl.where(seen, m_i + gl.log2(l_safe), float("-inf")), l_safe


@gluon.jit
def _scores(q_s, qr_s, c, r, zero_s):
    """S = Q_lat C^T + Q_rope K_rope^T for one resident tile, issued asynchronously."""
    s = warpgroup_mma(q_s, c.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, r.permute((1, 0)), s, is_async=True)


@gluon.jit
def _scores_streamed(q_s, qr_s, c, r, zero_s, ready, st, phase, CW: gl.constexpr):
    """S of ring stage st, one asynchronous MMA group per chunk, each issued as soon as its
    chunk has landed (RANK / CW + 1 groups)."""
    RANK: gl.constexpr = q_s.shape[1]
    NCH: gl.constexpr = RANK // CW + 1
    s = zero_s
    for k in gl.static_range(RANK // CW):
        mbarrier.wait(_chunk_bar(ready, st, k, NCH), phase)
        s = warpgroup_mma(
            q_s.slice(k * CW, CW, dim=1),
            c.slice(k * CW, CW, dim=1).permute((1, 0)),
            s,
            use_acc=k > 0,
            is_async=True,
        )
    mbarrier.wait(_chunk_bar(ready, st, NCH - 1, NCH), phase)
    return warpgroup_mma(qr_s, r.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(
    s,
    n0,
    m_i,
    l_acc,
    sc,
    bounds,
    col_l: gl.constexpr,
    BN: gl.constexpr,
    dtype: gl.constexpr,
    HAS_SCALE: gl.constexpr,
):
    """Online-softmax step of the tile whose first history row is n0: (P in the MMA type and
    the scores' layout, alpha, new max, row-sum accumulator). bounds: (start, end, last,
    qk_scale) of the split; rows outside [start, end) or after a query's own position (last)
    are masked. FP8 caches: sc [BN] scales the score columns and the probabilities (each cache
    row carries one scale for its key and its value), which costs no pass over the tile."""
    start, end, last, qk_scale = bounds
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
    return p.to(dtype), alpha, m_new, l_acc


@gluon.jit
def _publish(p, p_s):
    """P into its shared buffer for the next MMA, visible to the async proxy (one block-wide
    barrier; each warpgroup wrote its part of the columns)."""
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()


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
    STAGES: gl.constexpr,  # `MlaDecodeTuning.gluon_stages`
    SCALE_MODE: gl.constexpr,  # 0 none (bf16 / fp16 cache), 1 per page, 2 per row (e4m3)
    CONVERT_COLS: gl.constexpr,  # e4m3: `MlaDecodeTuning.fp8_convert_cols`
):
    BM: gl.constexpr = 64
    BN: gl.constexpr = desc_c.block_type.shape[0]
    CW: gl.constexpr = desc_c.block_type.shape[1]
    NCH: gl.constexpr = RANK // CW + 1
    ROWS: gl.constexpr = N_QUERY * NUM_HEADS
    dtype: gl.constexpr = q_lat.dtype.element_ty  # the MMAs' operand type
    HAS_SCALE: gl.constexpr = SCALE_MODE != 0
    CHUNK: gl.constexpr = CONVERT_COLS if RANK > CONVERT_COLS else RANK
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
    plan = (context_lens, split_order, split_row, split_start, split_len, uniform_splits)
    slot, row, start, end, length, live, first, n_full = _split_bounds(
        gl.program_id(1), plan, UNIFORM, GRANULE, BN
    )
    ring_at = (n_full, first, row, page_table, stride_table)
    ring = _start_ring(desc_c, desc_r, ring_at, STAGES, RANK, PAGE_SIZE)
    _, _, c_bufs, r_bufs, ready = ring

    # Queries of this program's rows (query j, head h) = m, into shared memory for the split.
    offs_ml = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LD))
    q = (q_lat, q_rope, stride_lt, stride_lh, stride_rt, stride_rh)
    ok_l = offs_ml < gl.where(live, ROWS, 0)
    ql, qr = _load_queries(q, offs_ml, row, ok_l, N_QUERY, NUM_HEADS, RANK, ROPE, LD)
    q_s = gl.allocate_shared_memory(
        dtype, [BM, RANK], gl.NVMMASharedLayout.get_default_for([BM, RANK], dtype), ql
    )
    qr_s = gl.allocate_shared_memory(
        dtype, [BM, ROPE], gl.NVMMASharedLayout.get_default_for([BM, ROPE], dtype), qr
    )

    offs_m = pid_m * BM + gl.arange(0, BM, layout=row_l)
    last = length - N_QUERY + offs_m // NUM_HEADS  # query j sees rows 0 .. L - n + j
    bounds = (start, end, last, qk_scale)  # what every softmax step masks and scales by
    zero_s = gl.zeros([BM, BN], gl.float32, S_L)
    acc = gl.zeros([BM, RANK], gl.float32, O_L)
    m_i = gl.full([BM], -1.0e30, gl.float32, row_l)
    l_acc = gl.zeros([BM, BN], gl.float32, S_L)

    if HAS_SCALE:
        # FP8 cache: tile t is converted exactly to the MMA type (e4m3 -> bf16 / fp16) into
        # converted buffer t % 3 while the tensor cores run tile t-1's MMAs: Q K^T of tile t+1
        # and P V of tile t (the other two buffers) may still read theirs. The ring of raw e4m3
        # tiles feeds the conversions STAGES tiles ahead.
        cv_c = gl.allocate_shared_memory(
            dtype, [3, BN, RANK], gl.NVMMASharedLayout.get_default_for([BN, RANK], dtype)
        )
        cv_r = gl.allocate_shared_memory(
            dtype, [3, BN, ROPE], gl.NVMMASharedLayout.get_default_for([BN, ROPE], dtype)
        )
        # The arguments every tile conversion takes.
        split = (n_full, first, row, page_table, stride_table)
        conv = (cv_c, cv_r)
        # P of tile t into buffer t % 2 while P V of tile t-1 reads the other. Buffer t % 2 was
        # last read by P V of tile t-2, which every warpgroup waited for at the end of step
        # t-1, before the block-wide barriers of step t (the conversion's, and the softmax's
        # row max, which crosses the warpgroups through shared memory). Against P in registers
        # (the layout change through the compiler's scratch): 8 -> 6 barriers a tile, 1.04x
        # on the H200 (4.23 -> 4.06 ms, mixed 36-request batch, docs/perf/mla.md).
        p_s = gl.allocate_shared_memory(
            dtype, [2, BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
        )
        if n_full > 0:
            _convert_tile(0, split, ring, conv, PAGE_SIZE, CHUNK, LD)
            where = (first, page_table + row * stride_table, row_scales)
            sc = _tile_scales(0, where, BN, PAGE_SIZE, SCALE_MODE, col_l)
            # Scales come one tile ahead, so that their two dependent loads are not waited on.
            sc_next = _tile_scales(
                gl.minimum(n_full - 1, 1), where, BN, PAGE_SIZE, SCALE_MODE, col_l
            )
            s = _scores(q_s, qr_s, cv_c.index(0), cv_r.index(0), zero_s)
            if n_full > 1:
                _convert_tile(1, split, ring, conv, PAGE_SIZE, CHUNK, LD)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_acc = _softmax(
                s, first, m_i, l_acc, sc, bounds, col_l, BN, dtype, True
            )
            _publish(p, p_s.index(0))
            for t in range(1, n_full):
                b = t % 3
                s = _scores(q_s, qr_s, cv_c.index(b), cv_r.index(b), zero_s)
                pv = p_s.index((t - 1) % 2)
                acc = warpgroup_mma(pv, cv_c.index((t - 1) % 3), acc, is_async=True)
                sc = sc_next
                sc_next = _tile_scales(
                    gl.minimum(n_full - 1, t + 1), where, BN, PAGE_SIZE, SCALE_MODE, col_l
                )
                if t + 1 < n_full:
                    _convert_tile(t + 1, split, ring, conv, PAGE_SIZE, CHUNK, LD)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                p, alpha, m_i, l_acc = _softmax(
                    s, first + t * BN, m_i, l_acc, sc, bounds, col_l, BN, dtype, True
                )
                _publish(p, p_s.index(t % 2))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            pv = p_s.index((n_full - 1) % 2)
            acc = warpgroup_mma(pv, cv_c.index((n_full - 1) % 3), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # The ragged tail goes into the buffer no MMA reads any more.
        cb = cv_c.index(n_full % 3)
        rb = cv_r.index(n_full % 3)
    else:
        cb = c_bufs.index(0)
        rb = r_bufs.index(0)
        # P V reads P from shared memory (`_publish`: one block-wide barrier), not registers:
        # there the layout change goes through the compiler's 4 KiB scratch in two rounds of two
        # barriers each. 18 fewer registers; with split barriers 1.08x on the H200.
        p_s = gl.allocate_shared_memory(
            dtype, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
        )
        if n_full > 0:
            s = _scores_streamed(
                q_s, qr_s, c_bufs.index(0), r_bufs.index(0), zero_s, ready, 0, 0, CW
            )
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_acc = _softmax(
                s, first, m_i, l_acc, 1.0, bounds, col_l, BN, dtype, False
            )
            _publish(p, p_s)
            for t in range(1, n_full):
                st = t % STAGES
                prev = (t - 1) % STAGES
                # The page of the tile fetched into stage prev, looked up early so that its
                # latency hides behind the MMAs.
                page = _page_of(
                    t - 1 + STAGES, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE
                )
                # P V of tile t-1 first, then tile t's Q K^T chunk by chunk; stage prev is
                # refilled as soon as that P V is done, while Q K^T still runs, which gives
                # the refill the softmax and the next P V to land in. The softmax itself
                # runs with the tensor cores idle.
                acc = warpgroup_mma(p_s, c_bufs.index(prev), acc, is_async=True)
                s = _scores_streamed(
                    q_s,
                    qr_s,
                    c_bufs.index(st),
                    r_bufs.index(st),
                    zero_s,
                    ready,
                    st,
                    (t // STAGES) & 1,
                    CW,
                )
                acc = warpgroup_mma_wait(num_outstanding=NCH, deps=(acc,))
                gl.thread_barrier()  # every warpgroup's P V on stage prev is done
                _issue(t - 1 + STAGES, page, n_full, first, ring, PAGE_SIZE)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                p, alpha, m_i, l_acc = _softmax(
                    s, first + t * BN, m_i, l_acc, 1.0, bounds, col_l, BN, dtype, False
                )
                # P V of tile t-1 is done on every warpgroup (the refill barrier above), so
                # P of tile t may take its buffer.
                _publish(p, p_s)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            last_st = (n_full - 1) % STAGES
            acc = warpgroup_mma(p_s, c_bufs.index(last_st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    n_tail = first + n_full * BN
    if n_tail < end:
        # The ragged last tile: masked loads into a free buffer, once every warpgroup's MMAs
        # have completed.
        gl.thread_barrier()
        table_row = page_table + row * stride_table
        _load_tail(pages, cb, rb, (n_tail, start, end), table_row, stride_page, PAGE_SIZE, LD)
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
            s, n_tail, m_i, l_acc, sc, bounds, col_l, BN, dtype, HAS_SCALE
        )
        p = gl.convert_layout(p, P_OP)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(p, cb, acc)

    for i in gl.static_range(STAGES):
        for k in gl.static_range(NCH):
            mbarrier.invalidate(_chunk_bar(ready, i, k, NCH))

    lse, l_safe = _lse(m_i, gl.sum(l_acc, 1))
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


def fits(
    rank: int, rope: int, page_size: int, fp8: bool = False, tuning: MlaDecodeTuning | None = None
) -> bool:
    """Shapes the kernel tiles with the tuning's Gluon tiles (None: the defaults): R and Dr
    powers of two (64 <= R <= 512: each warpgroup's MMA is R/2 wide; 16 <= Dr <= 256), whole
    tiles inside a page, and the shared memory it takes (queries, the ring of cache tiles and,
    for e4m3 caches, three converted tiles, else P's buffer)."""
    tuning = tuning or MlaDecodeTuning()
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    width = rank + rope
    block_n = tuning.gluon_tile_rows(fp8)
    smem = 2 * BLOCK_M * width + tuning.gluon_stages * block_n * width * (1 if fp8 else 2)
    if fp8:
        smem += 3 * block_n * width * 2
    else:
        smem += 2 * BLOCK_M * block_n
    return (
        pow2(rank)
        and 64 <= rank <= 512
        and pow2(rope)
        and 16 <= rope <= 256
        and page_size % block_n == 0
        and smem <= 224 * 1024
    )
