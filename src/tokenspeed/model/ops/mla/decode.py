"""Split-KV decode of absorbed MLA over a paged latent cache (Triton), same math as
`reference.mla_decode_paged`.

Three steps per call, all with static shapes and no host sync (CUDA-graph safe; the split plan
lives in device tensors, so a captured graph replays any plan written into them):

1. Absorb W_UK into the queries (one batched GEMM over heads, torch):
   q_lat[t, h] = q_nope[t, h] @ w_uk[h]  -> [T, H, R], kept in the query dtype.
2. `_split_kernel`, one program per (split slot, block of BLOCK_M query-head rows): online
   softmax of the request's rows [start, start + len) against the absorbed queries. Scores are
   q_lat . c + q_rope . k_rope; the value is the latent c itself, so each cache tile is loaded
   once and feeds both dots. Rows of a program are (query j, head h) pairs of one request,
   m = j * H + h, so all heads and all 1-4 verify queries share the tile; query j sees rows
   <= L - n + j. Writes the normalised partial o [R] and its log2-sum-exp per row.
3. `_tail_kernel`, one program per (block of tokens, head): merges the request's partials by
   log-sum-exp, applies W_UV (o_lat [R] -> [Dv]) as a small GEMM against w_uv[h] and
   multiplies by sigmoid(gate) in the epilogue, then stores [T, H, Dv].

Programs take the split slots longest first (the planner's `split_order`, written on the host
with the plan; `longest_first` is the same order computed on the device): the planner makes
every split of a row but its last exactly the target length, so
launching the full ones first lets the short last splits fill in behind them (longest-
processing-time order) rather than delaying full ones into an extra partial wave.

Why the gate lives in the tail: it multiplies per V channel (after W_UV), while the split
programs and the merge hold 512-wide latents. W_UV must not go into the split kernel (every
split would re-read all of w_uv, 12.6 MB at K3) nor into a per-request combine (every request
would); a per-head program reads w_uv[h] once per token block, so merge + W_UV + gate is one
pass over the partials and no extra pass over anything.

On Hopper, bf16 / fp16 caches take `gluon_decode._split_kernel_gluon` for step 2 instead (same
inputs and outputs; warpgroup MMAs pipelined across tiles, TMA loads; 2.04-2.95x faster than
`_split_kernel` on the H200, docs/perf/mla.md), e4m3 caches too (1.71x); a tuning with
kernel="triton" or any of the Triton tile knobs (`MlaDecodeTuning`) keeps the Triton kernel,
which also serves other GPUs and the interpreter.
Calls of exactly 32 query rows per request (Kimi Linear's 32 heads, one query) take
`gluon_transposed` instead, which puts cache rows on the MMA's M side rather than padding the
rows to 64 (1.17x on the H200).

Split plans: `splits` carries the planner's fixed-capacity metadata (`SplitPlanBuffers` of
`tokenspeed.model.ops.mla.split_plan`, passed in by the caller): per-request split counts derived
from the batch's history lengths, so chunks are nearly equal. `uniform_splits=S` instead gives
every request S splits computed in-kernel from context_lens (the classic fixed-split decode,
kept as the baseline). FP8 (e4m3) caches carry a per-page [NP] or per-row [NP, P] fp32 scale;
the tile is converted to the query dtype exactly and the scale is applied to score columns and
to the probabilities, which costs no extra pass.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import torch
import triton
import triton.language as tl

from ..interpret import interpreting
from ..tuning import boolean, integer, one_of, tuning_or_default, warp_count

LOG2E = 1.4426950408889634
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Split lengths of the uniform mode are rounded up to this (the planner's default granularity).
UNIFORM_GRANULE = 64


class SplitMetadata(Protocol):
    """The planner's int32 device tensors (`SplitPlanBuffers` satisfies this).

    num_splits [max_batch], split_indptr [max_batch + 1], split_row / split_start / split_len /
    split_order [max_splits]; padded rows have 0 splits, unused slots have length 0;
    split_order lists the slots longest first (the programs' launch order).
    """

    num_splits: torch.Tensor
    split_indptr: torch.Tensor
    split_row: torch.Tensor
    split_start: torch.Tensor
    split_len: torch.Tensor
    split_order: torch.Tensor


KERNELS = ("gluon", "triton")


@attrs.frozen(kw_only=True)
class MlaDecodeTuning:
    """The tuning knobs of `mla_decode_paged_split` (and of `decode_parallelism`'s head
    groups); the defaults are the measured ones (H200, benchmarks/mla_decode.py,
    docs/perf/mla.md). None means "by shape", filled in by `resolve` (and `tail_launch`,
    `gluon_tile_rows`). None of them changes the math; the split kernel chosen and its tiles
    change the summation order, so the last bits of the result.

    kernel: the split kernel, "gluon" (the pipelined Hopper kernels of `gluon_decode` /
    `gluon_transposed`), "triton" (`_split_kernel`) or None: Gluon wherever `gluon_applies`
    and none of the Triton tile knobs below is given, else Triton.

    The Triton split kernel (`_split_kernel`), None: `resolve`'s by-shape tiles:
    block_m: query-head rows per program (GPU: 64, one Hopper warpgroup MMA tile, fewer when
    a request has fewer rows; K3 decode: 96 rows -> two programs of 64 per split);
    block_n: cache rows per step (GPU: 64 with 64-row groups, measured 1.45x faster than 32
    on the H200; else 32); num_warps: its warps (GPU: 8, 4 for 16-row groups); num_stages:
    its software pipeline depth (GPU: 2). The interpreter gets 16-row tiles, 4 warps and one
    stage so that CPU tests stay fast.

    The Gluon split kernels (Hopper):
    gluon_block_n: cache rows per tile (None: 64 for bf16 / fp16 caches, 32 for e4m3). 64-row
    tiles with two stages measured faster than 32 x 4 and 16 x 6 on the H200 (fewer softmax
    steps): 2.82 vs 3.01 and 5.0 ms on the mixed 36-request batch. e4m3 caches take 32-row
    tiles so that three converted tiles fit beside the queries and the ring (the conversion
    of one tile then overlaps the MMAs of the previous one). The 32-row transposed kernel
    (`gluon_transposed`) computes 64 cache rows per MMA and runs only with 64-row tiles.
    gluon_stages: shared-memory stages of the TMA ring (2; more only where `gluon_decode.fits`
    finds the shared memory for them);
    fp8_convert_cols: e4m3 caches: latent columns converted per pass of
    `gluon_convert._convert_tile` (512). Each pass's store into the converted buffer is
    another access to one shared allocation, so another block-wide barrier: one 512-column
    pass ran 1.07x faster than four 128-column ones on the H200 (4.20 against 4.49 ms, mixed
    36-request batch); with P in shared memory too, a tile has 6 barriers at 245 registers,
    no spills.

    The merge tail (`_tail_kernel`): tail_block_t: tokens per program (None: 16 up to 128
    tokens, 32 up to 512, else 64: small blocks while tokens are few, so that the tail has
    programs (tokens / block_t x H) to spread the partials' reads; each re-reads w_uv[h] from
    L2); tail_warps: its warps (None: 8 for 64-token blocks on the GPU, else 4).

    use_pdl: programmatic dependent launch of the Triton split kernel and the merge tail
    (None: `pdl_supported`; the Gluon split kernel launches without it).
    """

    kernel: str | None = attrs.field(default=None, validator=one_of(KERNELS, optional=True))
    block_m: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    block_n: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    num_warps: int | None = attrs.field(default=None, validator=warp_count())
    num_stages: int | None = attrs.field(default=None, validator=integer())
    gluon_block_n: int | None = attrs.field(
        default=None, validator=one_of((16, 32, 64, 128), optional=True)
    )
    gluon_stages: int = attrs.field(default=2, validator=integer(low=2))
    fp8_convert_cols: int = attrs.field(
        default=512, validator=integer(low=64, pow2=True, optional=False)
    )
    tail_block_t: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    tail_warps: int | None = attrs.field(default=None, validator=warp_count())
    use_pdl: bool | None = attrs.field(default=None, validator=boolean())

    @property
    def triton_tiles_given(self) -> bool:
        """Whether any of the Triton split kernel's tile knobs is set (then kernel=None takes
        the Triton kernel)."""
        return any(
            v is not None for v in (self.block_m, self.block_n, self.num_warps, self.num_stages)
        )

    def resolve(self, rows_per_request: int, on_gpu: bool) -> MlaDecodeTuning:
        """These knobs with the Triton split kernel's tiles filled in for n * H query-head rows
        per request. On the GPU, 64 rows (one Hopper warpgroup MMA tile; acc [64, 512] fp32 is
        128 registers a thread over 8 warps); smaller groups when fewer rows. Below 64 rows the
        MMA takes the query tile from registers (16 rows x 576 per warp, ~144 registers), so
        32 rows keep 8 warps to halve the accumulator's share."""
        block_m = self.block_m or max(16, min(64, triton.next_power_of_2(rows_per_request)))
        if not on_gpu:
            block_n, num_warps, num_stages = 16, 4, 1
        else:
            block_n = 64 if block_m == 64 else 32
            num_warps, num_stages = (4 if block_m == 16 else 8), 2
        return attrs.evolve(
            self,
            block_m=block_m,
            block_n=self.block_n or block_n,
            num_warps=self.num_warps or num_warps,
            num_stages=self.num_stages or num_stages,
        )

    def head_groups(self, rows_per_request: int) -> int:
        """Programs per split of the Triton kernel (block_m: by shape on the GPU when None)."""
        block_m = self.block_m or self.resolve(rows_per_request, on_gpu=True).block_m
        return -(-rows_per_request // block_m)

    def tail_launch(self, tokens: int, on_gpu: bool) -> tuple[int, int]:
        """(block_t, num_warps) of the merge tail over this many query tokens."""
        block_t = self.tail_block_t or (16 if tokens <= 128 else 32 if tokens <= 512 else 64)
        warps = self.tail_warps or (8 if on_gpu and block_t == 64 else 4)
        return block_t, warps

    def gluon_tile_rows(self, fp8: bool) -> int:
        """Cache rows per tile of the Gluon kernel for an e4m3 (fp8) or bf16 / fp16 cache."""
        return self.gluon_block_n or (32 if fp8 else 64)


def decode_parallelism(
    num_sms: int,
    num_heads: int,
    queries_per_request: int,
    tiles: MlaDecodeTuning | None = None,
    programs_per_sm: int = 1,
    waves: int = 4,
) -> int:
    """Split budget for the planner: splits x head groups ~ `waves` full waves of programs.

    More than one wave because the planner adds up to one short split per request on top of the
    budget: launched longest first, those fill in behind the full ones. A scheduling model of
    mixed and equal batches (132 SMs, 2 head groups) put 4 waves within a few percent of a
    perfect balance and 1 wave up to 1.7x off it on equal lengths (wave quantisation);
    benchmarks/mla_decode.py measures 1, 2 and 4. tiles: the decode's tuning, whose Triton
    block_m sets the head groups (None: the default, by shape on the GPU)."""
    rows = num_heads * queries_per_request
    tiles = tiles or MlaDecodeTuning()
    return max(1, waves * num_sms * programs_per_sm // tiles.head_groups(rows))


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, never under the interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def gluon_applies(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_scales: torch.Tensor | None,
    rank: int,
    rope: int,
    page_size: int,
    tuning: MlaDecodeTuning | None = None,
) -> bool:
    """Whether the Hopper Gluon split kernel (`gluon_decode`) can take this call: a CUDA device
    of compute capability 9.x (its MMAs are wgmma), not the interpreter (Gluon does not run
    there), a bf16 / fp16 cache in the queries' dtype or an e4m3 cache with its scales, and
    shapes it tiles with the tuning's Gluon tiles (`gluon_decode.fits`; None: the defaults)."""
    if interpreting() or not q.is_cuda:
        return False
    fp8 = pages.dtype == torch.float8_e4m3fn and page_scales is not None
    if not fp8 and (page_scales is not None or pages.dtype != q.dtype):
        return False
    if not pages.is_contiguous():  # its TMA descriptor views the pool as [NP * P, W] rows
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    try:
        from . import gluon_decode
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return gluon_decode.fits(rank, rope, page_size, fp8=fp8, tuning=tuning)


def quantize_fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., W] -> (e4m3 rows [..., W], fp32 scales [...]) with rows ~= q * scale."""
    amax = rows.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (rows.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_pages(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pages [NP, P, W] -> (e4m3 pages, fp32 per-page scales [NP])."""
    amax = pages.float().abs().amax((1, 2)).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (pages.float() / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_pages(pages: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Inverse of the quantizers (fp32): scales [NP] (per page) or [NP, P] (per row)."""
    if scales is None:
        return pages.float()
    s = scales[:, None, None] if scales.dim() == 1 else scales[:, :, None]
    return pages.float() * s


@triton.jit
def _split_kernel(
    q_lat,  # [T, H, R] strided
    q_rope,  # [T, H, Dr] strided
    pages,  # [NP, P, R + Dr], rows contiguous
    row_scales,  # [NP] or [NP, P] fp32 (FP8 caches), else unused
    page_table,  # [B, MP] int32/int64
    context_lens,  # [B]
    split_order,  # [S] int32 (planner mode): the slot each program takes, longest first
    split_row,  # [S] int32 (planner mode)
    split_start,
    split_len,
    part_o,  # [S, n * H, R] fp32
    part_lse,  # [S, n * H] fp32, log2 domain
    qk_scale,  # softmax scale * log2(e)
    stride_lt,
    stride_lh,
    stride_rt,
    stride_rh,
    stride_page,
    stride_table,
    uniform_splits,
    NUM_HEADS: tl.constexpr,
    N_QUERY: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,  # 0 none, 1 per page, 2 per row
    UNIFORM: tl.constexpr,
    GRANULE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # Every input (queries, pages, plan) comes from earlier work: wait before any load. The
        # tail may launch now; it waits for this grid in its own gdc_wait.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ROWS: tl.constexpr = N_QUERY * NUM_HEADS
    WIDTH: tl.constexpr = RANK + ROPE
    pid_m = tl.program_id(0)  # fastest axis: the head groups of one split run side by side
    slot = tl.program_id(1)  # and share its cache tiles through L2
    if UNIFORM:
        row = slot // uniform_splits
        length = tl.load(context_lens + row).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(length, uniform_splits), GRANULE) * GRANULE
        start = (slot % uniform_splits) * chunk
        end = tl.minimum(start + chunk, length)
        live = slot >= 0  # every slot is read by the merge, even an empty one
    else:
        # Blocks start in launch order: full-length splits first, each row's shorter last
        # split after them, so short programs fill the gaps instead of ending the kernel late.
        slot = tl.load(split_order + slot)
        row = tl.load(split_row + slot)
        start = tl.load(split_start + slot)
        n_rows = tl.load(split_len + slot)
        length = tl.load(context_lens + row).to(tl.int32)
        end = tl.minimum(start + n_rows, length)
        live = n_rows > 0  # unused slots load and store nothing
    end = tl.where(live, end, start)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.where(live, ROWS, 0)  # (tensor & scalar breaks the interpreter)
    qj = offs_m // NUM_HEADS
    qh = offs_m % NUM_HEADS
    tok = (row * N_QUERY + qj).to(tl.int64)
    offs_r = tl.arange(0, RANK)
    offs_d = tl.arange(0, ROPE)
    ql = tl.load(
        q_lat + tok[:, None] * stride_lt + qh[:, None] * stride_lh + offs_r[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    qr = tl.load(
        q_rope + tok[:, None] * stride_rt + qh[:, None] * stride_rh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    last = length - N_QUERY + qj  # query j sees cache rows 0 .. L - n + j

    # A finite floor instead of -inf keeps exp2(m_i - m_new) finite when a row sees nothing yet.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = pos < end
        page = tl.load(page_table + row * stride_table + pos // PAGE_SIZE, mask=k_ok, other=0)
        page = page.to(tl.int64)
        base = page * stride_page + (pos % PAGE_SIZE) * WIDTH
        c = tl.load(pages + base[:, None] + offs_r[None, :], mask=k_ok[:, None], other=0.0)
        kr = tl.load(pages + base[:, None] + RANK + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        c = c.to(ql.dtype)  # exact for e4m3 -> bf16 / fp16
        s = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr.to(ql.dtype)))
        if SCALE_MODE == 1:
            sc = tl.load(row_scales + page, mask=k_ok, other=0.0)
        elif SCALE_MODE == 2:
            sc = tl.load(row_scales + page * PAGE_SIZE + pos % PAGE_SIZE, mask=k_ok, other=0.0)
        if SCALE_MODE != 0:
            s = s * sc[None, :]
        s = s * qk_scale
        visible = k_ok[None, :] & (pos[None, :] <= last[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if SCALE_MODE != 0:
            p = p * sc[None, :]  # the value rows carry the same scale as the key rows
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    part = slot.to(tl.int64) * ROWS + offs_m
    tl.store(
        part_o + part[:, None] * RANK + offs_r[None, :], acc / l_safe[:, None], mask=m_ok[:, None]
    )
    tl.store(part_lse + part, lse, mask=m_ok)


@triton.jit
def _tail_kernel(
    part_o,  # [S, n * H, R] fp32
    part_lse,  # [S, n * H] fp32, log2 domain
    num_splits,  # [B] int32 (planner mode)
    split_indptr,  # [B + 1] int32 (planner mode)
    w_uv,  # [H, Dv, R]
    gate,  # [T, H, Dv] strided, or unused
    out,  # [T, H, Dv]
    num_tokens,
    uniform_splits,
    stride_wh,
    stride_wd,
    stride_gt,
    stride_gh,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    N_QUERY: tl.constexpr,
    RANK: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_GATE: tl.constexpr,
    UNIFORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ROWS: tl.constexpr = N_QUERY * NUM_HEADS
    pid_t = tl.program_id(0)  # fastest axis: programs of one head share w_uv[h] through L2
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    req = offs_t // N_QUERY
    m = (offs_t % N_QUERY) * NUM_HEADS + h  # the split kernel's row of (query, head)
    if UNIFORM:
        cnt = tl.where(t_ok, uniform_splits, 0)
        lo = req * uniform_splits
    else:
        cnt = tl.load(num_splits + req, mask=t_ok, other=0)
        lo = tl.load(split_indptr + req, mask=t_ok, other=0)
    max_cnt = tl.max(cnt, 0)

    # Pass 1 over the log-sum-exps only (tiny): the merged max and normaliser of each token.
    mx = tl.full([BLOCK_T], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_T], tl.float32)
    for s in range(0, max_cnt):
        lse = tl.load(
            part_lse + (lo + s).to(tl.int64) * ROWS + m, mask=s < cnt, other=float("-inf")
        )
        new = tl.maximum(mx, lse)
        den = den * tl.exp2(mx - new) + tl.exp2(lse - new)
        mx = new
    # Padded rows (no splits) come out as zeros.
    inv = tl.where(den > 0.0, 1.0 / tl.where(den > 0.0, den, 1.0), 0.0)

    # Pass 2, by chunks of the latent: merge the partials' chunk, then multiply by w_uv[h]'s
    # matching columns, so no [BLOCK_T, R] tile has to be sliced.
    offs_v = tl.arange(0, V_DIM)
    res = tl.zeros([BLOCK_T, V_DIM], tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        o_c = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for s in range(0, max_cnt):
            ok = s < cnt
            idx = (lo + s).to(tl.int64) * ROWS + m
            lse = tl.load(part_lse + idx, mask=ok, other=float("-inf"))
            wgt = tl.exp2(lse - mx) * inv
            o_s = tl.load(
                part_o + idx[:, None] * RANK + offs_r[None, :], mask=ok[:, None], other=0.0
            )
            o_c += wgt[:, None] * o_s
        w = tl.load(w_uv + h * stride_wh + offs_v[:, None] * stride_wd + offs_r[None, :])
        res += tl.dot(o_c.to(w.dtype), tl.trans(w))
    if HAS_GATE:
        g = tl.load(
            gate + offs_t[:, None] * stride_gt + h * stride_gh + offs_v[None, :],
            mask=t_ok[:, None],
            other=0.0,
        )
        res = res * tl.sigmoid(g.to(tl.float32))
    tl.store(
        out + offs_t[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
        res.to(out.dtype.element_ty),
        mask=t_ok[:, None],
    )


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def mla_decode_paged_split(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    splits: SplitMetadata | None = None,
    *,
    uniform_splits: int | None = None,
    gate: torch.Tensor | None = None,
    page_scales: torch.Tensor | None = None,
    split_order: torch.Tensor | None = None,
    tuning: MlaDecodeTuning | None = None,
) -> torch.Tensor:
    """Split-KV absorbed decode; `reference.mla_decode_paged` with an optional output gate.

    q: [B * n, H, Dn + Dr] request-major, n = 1..4 queries per request at its last n positions;
    pages: [NP, P, R + Dr] bf16 / fp16 (fp32 only under the interpreter) or float8_e4m3fn with
    page_scales [NP] (per page) or [NP, P] (per row), fp32; page_table: [B, MP] int32/int64;
    context_lens: [B] rows of each request including this step's n; w_uk: [H, Dn, R];
    w_uv: [H, Dv, R]; gate: optional [B * n, H * Dv] or [B * n, H, Dv] pre-sigmoid logits.
    Exactly one of `splits` (planner metadata over history lengths = context_lens, device int32)
    and `uniform_splits` (S splits per request). Returns [B * n, H, Dv] in q's dtype:
    attention * sigmoid(gate) when a gate is given. No host sync; static shapes.
    split_order: overrides `splits.split_order`, the launch order the planner wrote (longest
    first; `longest_first` computes the same on the device).
    tuning: the launch knobs (`MlaDecodeTuning`: which split kernel, its tiles, the tail's,
    PDL; None: the measured defaults).
    """
    tuning = tuning_or_default(tuning, MlaDecodeTuning)
    _check(
        (splits is None) != (uniform_splits is None),
        "pass exactly one of splits (planner metadata) and uniform_splits",
    )
    tokens, heads, qk_dim = q.shape
    batch = page_table.shape[0]
    _check(tokens % batch == 0, f"q has {tokens} rows, not a multiple of {batch} requests")
    n_query = tokens // batch
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    rope = qk_dim - nope
    v_dim = w_uv.shape[1]
    page_size, width = pages.shape[1], pages.shape[2]
    _check(width == rank + rope, f"page rows are {width} wide, expected R + Dr = {rank + rope}")
    _check(pages.stride(2) == 1 and pages.stride(1) == width, "page rows must be contiguous")
    _check(_pow2(rank) and _pow2(rope) and _pow2(v_dim), "R, Dr and Dv must be powers of two >= 16")
    _check(
        w_uk.shape[0] == heads and w_uv.shape[0] == heads and w_uv.shape[2] == rank,
        "w_uk [H, Dn, R] and w_uv [H, Dv, R] do not match q",
    )
    fp8 = pages.dtype == torch.float8_e4m3fn
    _check(fp8 == (page_scales is not None), "FP8 pages need page_scales; others take none")
    scale_mode = 0
    if page_scales is not None:
        _check(
            page_scales.dtype == torch.float32 and page_scales.is_contiguous(),
            "page_scales must be contiguous fp32",
        )
        scale_mode = 1 if page_scales.dim() == 1 else 2
        _check(
            page_scales.shape[0] == pages.shape[0]
            and (scale_mode == 1 or page_scales.shape[1] == page_size),
            "page_scales must be [NP] or [NP, P]",
        )
    _check(page_table.stride(1) == 1, "page_table rows must be contiguous")
    _check(q.stride(2) == 1, "q channels must be contiguous")
    if splits is not None:
        _check(
            splits.num_splits.numel() == batch,
            f"plan has {splits.num_splits.numel()} rows for {batch} requests",
        )
    else:
        _check(uniform_splits >= 1, "uniform_splits must be positive")

    on_gpu = q.is_cuda
    rows = n_query * heads
    fits_gluon = gluon_applies(q, pages, page_scales, rank, rope, page_size, tuning)
    _check(
        tuning.kernel != "gluon" or not tuning.triton_tiles_given,
        "block_m, block_n, num_warps and num_stages configure the Triton kernel only",
    )
    _check(
        tuning.kernel != "gluon" or fits_gluon, "the Gluon kernel does not apply (gluon_applies)"
    )
    use_gluon = tuning.kernel == "gluon" or (
        tuning.kernel is None and not tuning.triton_tiles_given and fits_gluon
    )
    tiles = tuning.resolve(rows, on_gpu)
    pdl = pdl_supported(q.device) if tuning.use_pdl is None else tuning.use_pdl
    launch = {"launch_pdl": True} if pdl else {}

    # 1. Absorb W_UK: [H, T, Dn] @ [H, Dn, R] -> [H, T, R], read below as [T, H, R] by strides.
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk.to(q.dtype))
    q_rope = q[..., nope:]

    if splits is not None:
        num_slots = splits.split_len.numel()
        order = splits.split_order if split_order is None else split_order
        _check(order.numel() == num_slots, "split_order must have one entry per split slot")
        meta = (order, splits.split_row, splits.split_start, splits.split_len)
        n_uniform = 1
    else:
        num_slots = batch * uniform_splits
        meta = (context_lens,) * 4  # unused in uniform mode
        n_uniform = uniform_splits
    part_o = torch.empty(num_slots, rows, rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_slots, rows, dtype=torch.float32, device=q.device)
    scales_arg = page_scales if page_scales is not None else part_lse

    grid = (tiles.head_groups(rows), num_slots)
    # Arguments both split kernels take (same contract), after their cache operands.
    tail_args = (
        page_table,
        context_lens,
        *meta,
        part_o,
        part_lse,
        scale * LOG2E,
        q_lat.stride(1),
        q_lat.stride(0),
        q_rope.stride(0),
        q_rope.stride(1),
        pages.stride(0),
        page_table.stride(0),
        n_uniform,
    )
    shape = {
        "NUM_HEADS": heads,
        "N_QUERY": n_query,
        "RANK": rank,
        "ROPE": rope,
        "PAGE_SIZE": page_size,
        "SCALE_MODE": scale_mode,
        "UNIFORM": splits is None,
        "GRANULE": UNIFORM_GRANULE,
    }
    if use_gluon:
        from . import gluon_decode, gluon_ring, gluon_transposed

        block_n = tuning.gluon_tile_rows(fp8)
        desc_c, desc_r = gluon_ring.descriptors(pages, rank, block_n)
        operands = (q_lat, q_rope, pages, scales_arg, desc_c, desc_r, *tail_args)
        # The last 32 query rows may go to a program that puts cache rows on the MMA's M side
        # instead of padding a 64-row one (`takes_remainder` says when; its MMAs take 64 cache
        # rows, so 64-row tiles only).
        full = rows // gluon_decode.BLOCK_M
        transposed = gluon_transposed.takes_remainder(rows, fp8) and block_n == 64
        blocks = full if transposed else -(-rows // gluon_decode.BLOCK_M)
        if blocks:
            gluon_decode._split_kernel_gluon[(blocks, num_slots)](
                *operands,
                **shape,
                STAGES=tuning.gluon_stages,
                CONVERT_COLS=tuning.fp8_convert_cols,
                num_warps=8,
            )
        if transposed:
            gluon_transposed._split_kernel_transposed[(1, num_slots)](
                *operands,
                **shape,
                STAGES=tuning.gluon_stages,
                ROW0=full * gluon_decode.BLOCK_M,
                num_warps=4,
            )
    else:
        _split_kernel[grid](
            q_lat,
            q_rope,
            pages,
            scales_arg,
            *tail_args,
            **shape,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            USE_PDL=pdl,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **launch,
        )

    out = torch.empty(tokens, heads, v_dim, dtype=q.dtype, device=q.device)
    if gate is not None:
        gate = gate.reshape(tokens, heads, v_dim)
        _check(gate.stride(2) == 1, "gate channels must be contiguous")
    g_arg = gate if gate is not None else out
    block_t, tail_warps = tuning.tail_launch(tokens, on_gpu)
    block_r = min(rank, 128)
    w_uv_c = w_uv.to(q.dtype)
    _check(w_uv_c.stride(2) == 1, "w_uv rows must be contiguous")
    num_splits = splits.num_splits if splits is not None else context_lens
    indptr = splits.split_indptr if splits is not None else context_lens
    _tail_kernel[(triton.cdiv(tokens, block_t), heads)](
        part_o,
        part_lse,
        num_splits,
        indptr,
        w_uv_c,
        g_arg,
        out,
        tokens,
        n_uniform,
        w_uv_c.stride(0),
        w_uv_c.stride(1),
        g_arg.stride(0),
        g_arg.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=heads,
        N_QUERY=n_query,
        RANK=rank,
        V_DIM=v_dim,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        HAS_GATE=gate is not None,
        UNIFORM=splits is None,
        USE_PDL=pdl,
        num_warps=tail_warps,
        **launch,
    )
    return out


def longest_first(splits: SplitMetadata) -> torch.Tensor:
    """Launch order of the split slots computed on the device from split_len: longest first
    (unused, empty slots last), as the planner's `split_order`. [S] int32, no host sync."""
    order = torch.argsort(splits.split_len, descending=True, stable=True)
    return order.to(torch.int32)


def uniform_split_count(batch: int, parallelism: int) -> int:
    """The fixed-split baseline at the same budget: S = ceil(parallelism / B) per request."""
    return max(1, math.ceil(parallelism / batch))
