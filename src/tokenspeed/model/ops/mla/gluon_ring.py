"""The TMA ring of the Gluon MLA split kernels (`gluon_decode`, `gluon_transposed`): where a
split reads (`_split_bounds`), the tiles of its history loaded by TMA into a ring of shared-memory
stages with one mbarrier per latent chunk (`_start_ring`, `_issue`, `_wait_tile`), and the TMA
descriptors over the page pool (`descriptors`).

A tile is BN consecutive history rows inside one page (tiles are aligned to BN in the history
and BN divides the page size), loaded as 576-wide rows: the latent part in chunks of the
descriptor's box width, then the shared key.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _split_bounds(slot, plan, UNIFORM: gl.constexpr, GRANULE: gl.constexpr, BN: gl.constexpr):
    """Where split slot `slot` (the grid's second index) reads: (slot as the partials' index,
    request row, start, end, history length, live, first row of its first tile, full tiles).
    plan: (context_lens, split_order, split_row, split_start, split_len, uniform_splits)."""
    context_lens, split_order, split_row, split_start, split_len, uniform_splits = plan
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
    return slot, row, start, end, length, live, first, n_full


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
def _chunk_bar(ready, s, k: gl.constexpr, NCH: gl.constexpr):
    """The barrier of chunk k of ring stage s (k = NCH - 1: the shared key). ready: NCH
    allocations of STAGES barriers, one per chunk (`_start_ring`)."""
    return ready[k].index(s)


@gluon.jit
def _issue(t, page, n_full, first, ring, PAGE_SIZE: gl.constexpr):
    """TMA loads of full tile t of the split (on `page`) into stage t % STAGES, predicated
    off past the last full tile: one load and one barrier per CW-column chunk of the latent
    part (CW: desc_c's box width) and one for the shared key, so that Q K^T can start on the
    first chunks while the later ones are still in flight. ring: (desc_c, desc_r, c_bufs,
    r_bufs, ready)."""
    desc_c, desc_r, c_bufs, r_bufs, ready = ring
    STAGES: gl.constexpr = c_bufs.shape[0]
    RANK: gl.constexpr = c_bufs.shape[2]
    BN: gl.constexpr = desc_c.block_type.shape[0]
    CW: gl.constexpr = desc_c.block_type.shape[1]
    NCH: gl.constexpr = RANK // CW + 1
    s = t % STAGES
    pred = t < n_full
    n0 = first + gl.minimum(t, gl.maximum(n_full - 1, 0)) * BN
    r0 = page * PAGE_SIZE + n0 % PAGE_SIZE  # TMA coordinates are 32-bit
    # All expects first, then all copies: interleaved, the compiler puts two block-wide
    # barriers between each expect and its copy.
    for k in gl.static_range(RANK // CW):
        mbarrier.expect(_chunk_bar(ready, s, k, NCH), desc_c.block_type.nbytes, pred=pred)
    mbarrier.expect(_chunk_bar(ready, s, NCH - 1, NCH), desc_r.block_type.nbytes, pred=pred)
    for k in gl.static_range(RANK // CW):
        dst = c_bufs.index(s).slice(k * CW, CW, dim=1)
        bar = _chunk_bar(ready, s, k, NCH)
        tma.async_copy_global_to_shared(desc_c, [r0, k * CW], bar, dst, pred)
    bar = _chunk_bar(ready, s, NCH - 1, NCH)
    tma.async_copy_global_to_shared(desc_r, [r0, RANK], bar, r_bufs.index(s), pred)


@gluon.jit
def _wait_tile(ready, s, phase, NCH: gl.constexpr):
    """Wait for every chunk of ring stage s."""
    for k in gl.static_range(NCH):
        mbarrier.wait(_chunk_bar(ready, s, k, NCH), phase)


@gluon.jit
def _start_ring(
    desc_c,
    desc_r,
    where,
    STAGES: gl.constexpr,
    RANK: gl.constexpr,
    PAGE_SIZE,
):
    """The ring of STAGES cache-tile stages (and a barrier per chunk of each), its first STAGES
    tiles issued. where: (n_full, first, row, page_table, stride_table). Returns the ring
    (desc_c, desc_r, c_bufs, r_bufs, ready); ready: see `_chunk_bar`.

    One shared allocation per chunk's barriers rather than one for all: Triton 3.6 orders any
    two accesses to one allocation with a block-wide barrier, whichever barriers of it they
    touch. With the chunks apart, the waits on a tile's chunks and the expects of a refill
    follow each other without one (11 -> 8 barriers per tile; 1.04x on the H200 with P in
    registers, docs/perf/mla.md)."""
    n_full, first, row, page_table, stride_table = where
    cache_t: gl.constexpr = desc_c.block_type.element_ty
    BN: gl.constexpr = desc_c.block_type.shape[0]
    NCH: gl.constexpr = RANK // desc_c.block_type.shape[1] + 1
    ROPE: gl.constexpr = desc_r.block_type.shape[1]
    c_bufs = gl.allocate_shared_memory(cache_t, [STAGES, BN, RANK], desc_c.layout)
    r_bufs = gl.allocate_shared_memory(cache_t, [STAGES, BN, ROPE], desc_r.layout)
    ready = ()
    for _ in gl.static_range(NCH):
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = ready + (bars,)  # noqa: RUF005 (the JIT takes no starred tuples)
    for i in gl.static_range(STAGES):
        for k in gl.static_range(NCH):
            mbarrier.init(_chunk_bar(ready, i, k, NCH), count=1)
    ring = (desc_c, desc_r, c_bufs, r_bufs, ready)  # what every tile load takes
    for i in gl.static_range(STAGES):
        page = _page_of(i, n_full, first, row, page_table, stride_table, BN, PAGE_SIZE)
        _issue(i, page, n_full, first, ring, PAGE_SIZE)
    return ring


def descriptors(
    pages: torch.Tensor, rank: int, block_n: int, chunk: int | None = None
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the page pool [NP, P, R + Dr] (bf16, fp16 or e4m3) as rows:
    [block_n, chunk] boxes of the latent part (the kernel loads a tile chunk by chunk, one
    barrier each) and [block_n, Dr] shared-key boxes. block_n: rows per tile
    (`MlaDecodeTuning.gluon_tile_rows`); chunk: all R
    columns by default. Chunks of 64 or 128 columns measured slower on the H200 (2.43 / 2.30
    against 2.08 ms on the mixed 36-request batch, docs/perf/mla.md): the compiler puts a
    block-wide barrier around every barrier expect and TMA copy, which costs more than
    starting Q K^T on the first chunks gains."""
    chunk = chunk or rank
    flat = pages.view(-1, pages.shape[-1])
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(pages.dtype, gl.float8e4nv)
    out = []
    for cols in (chunk, flat.shape[1] - rank):
        block = [block_n, cols]
        layout = gl.NVMMASharedLayout.get_default_for(block, elem)
        out.append(TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout))
    return out[0], out[1]
