"""Prefill / extend of MLA over a paged latent cache (Triton), same math as
`reference.mla_prefill`: the new tokens of each request attend to its cached rows and to
themselves (their rows are already in the pages), causally, queries at the last n positions.

Many queries share each cached row here, so the expanded form is the cheap one: rows are
gathered from the pages and expanded once by kv_b_proj into per-head keys and values (a
[rows, R] x [R, H * (Dn + Dv)] GEMM), then `_prefill_kernel` runs flash attention over them. The
64-wide shared key slice is read straight from the gathered rows for every head (never
broadcast). The expansion costs rows x H x (Dn + Dv) x 2 bytes (48 KiB a row at K3), so long
histories go in key chunks of at most `max_chunk_rows` rows in total per launch; the kernel
merges each chunk into a running fp32 output and log-sum-exp, so memory stays bounded whatever
the history (200k rows would otherwise need ~10 GB).

Eager only: the chunk schedule is built on the host from the lengths (one sync per call), as the
prefill path of the layer already is.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ..tuning import integer, tuning_or_default, warp_count
from .decode import LOG2E


@attrs.frozen(kw_only=True)
class MlaPrefillTuning:
    """The tuning knobs of `mla_prefill_paged`'s `_prefill_kernel`; None means "by shape",
    filled in by `resolve` from the longest query run of the call (the prefill is checked but
    not timed in docs/perf/mla.md). On the GPU: 64 x 64 tiles,
    4 warps, 2 stages, and 128 x 64 tiles with 8 warps and 3 stages once a request has more
    than 64 new tokens; the interpreter gets 16 x 16 tiles, 4 warps and one stage so that CPU
    tests stay fast. None of them changes the math (the summation order, so the last bits).

    block_m: query rows (tokens of one request, one head) per program; block_n: key rows per
    step; num_warps: the kernel's warps; num_stages: its software pipeline depth.
    """

    block_m: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    block_n: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    num_warps: int | None = attrs.field(default=None, validator=warp_count())
    num_stages: int | None = attrs.field(default=None, validator=integer())

    def resolve(self, max_queries: int, on_gpu: bool) -> MlaPrefillTuning:
        """These knobs with every by-shape default filled in for a call whose longest request
        has `max_queries` new tokens: what `mla_prefill_paged` launches with."""
        if not on_gpu:
            auto = (16, 16, 4, 1)
        elif max_queries > 64:
            auto = (128, 64, 8, 3)
        else:
            auto = (64, 64, 4, 2)
        given = (self.block_m, self.block_n, self.num_warps, self.num_stages)
        block_m, block_n, num_warps, num_stages = (
            a if g is None else g for g, a in zip(given, auto, strict=True)
        )
        return MlaPrefillTuning(
            block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages
        )


@triton.jit
def _prefill_kernel(
    q,  # [T, H, Dn + Dr]
    kv,  # [N, H, Dn + Dv] expanded keys | values of this launch's segments
    rows,  # [N, R + Dr] gathered latent rows (the shared key part is read from here)
    o_acc,  # [T, H, Dv] fp32 running output (normalised)
    lse_acc,  # [T, H] fp32 running log2-sum-exp
    cu_q,  # [B + 1] query offsets
    context_lens,  # [B]
    seg_req,  # [S] request of each segment
    seg_k0,  # [S] first key position of the segment
    seg_len,  # [S] keys in the segment
    seg_row0,  # [S] first row of the segment in kv / rows
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_kvh,
    stride_rn,
    stride_ot,
    stride_oh,
    stride_lt,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V_DIM: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    req = tl.load(seg_req + seg)
    k0 = tl.load(seg_k0 + seg)
    k_len = tl.load(seg_len + seg)
    row0 = tl.load(seg_row0 + seg).to(tl.int64)
    q_lo = tl.load(cu_q + req)
    n_q = tl.load(cu_q + req + 1) - q_lo
    length = tl.load(context_lens + req)

    offs_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = offs_i < n_q
    tok = (q_lo + offs_i).to(tl.int64)
    q_pos = length - n_q + offs_i  # query i sits at position L - n + i and sees keys <= it
    offs_dn = tl.arange(0, NOPE)
    offs_dr = tl.arange(0, ROPE)
    offs_v = tl.arange(0, V_DIM)
    q_base = q + tok[:, None] * stride_qt + h * stride_qh
    qn = tl.load(q_base + offs_dn[None, :], mask=i_ok[:, None], other=0.0)
    qr = tl.load(q_base + NOPE + offs_dr[None, :], mask=i_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    # Keys past the block's last query position are invisible to every query of the block.
    last_pos = tl.max(tl.where(i_ok, q_pos, -1), 0)
    hi = tl.minimum(k_len, last_pos - k0 + 1)
    for j0 in range(0, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_ok = offs_j < hi
        r = row0 + offs_j
        kv_base = kv + r[:, None] * stride_kvn + h * stride_kvh
        kn = tl.load(kv_base + offs_dn[None, :], mask=j_ok[:, None], other=0.0)
        vv = tl.load(kv_base + NOPE + offs_v[None, :], mask=j_ok[:, None], other=0.0)
        kr = tl.load(
            rows + r[:, None] * stride_rn + RANK + offs_dr[None, :], mask=j_ok[:, None], other=0.0
        )
        s = tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr.to(qr.dtype)))
        s = s * qk_scale
        visible = j_ok[None, :] & ((k0 + offs_j)[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    o_ptr = o_acc + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    lse_ptr = lse_acc + tok * stride_lt + h
    if k0 > 0:
        # A later chunk of this request: merge with what earlier launches left.
        prev_lse = tl.load(lse_ptr, mask=i_ok, other=float("-inf"))
        prev_o = tl.load(o_ptr, mask=i_ok[:, None], other=0.0)
        mx = tl.maximum(tl.maximum(prev_lse, lse), -1.0e30)
        w_prev = tl.exp2(prev_lse - mx)
        w_new = tl.exp2(lse - mx)
        tot = w_prev + w_new
        o = (prev_o * w_prev[:, None] + o * w_new[:, None]) / tot[:, None]
        lse = mx + tl.log2(tot)
    tl.store(o_ptr, o, mask=i_ok[:, None])
    tl.store(lse_ptr, lse, mask=i_ok)


def _segments(
    lens: list[int], n_queries: list[int], max_rows: int
) -> list[list[tuple[int, int, int]]]:
    """Launch groups of (request, first key, keys): each request's keys in chunks of at most
    max_rows, chunks in order, at most max_rows keys per group and one chunk of a request per
    group (chunks of one request merge into the same outputs, so they go in later groups)."""
    groups: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for b, (length, n) in enumerate(zip(lens, n_queries, strict=True)):
        if n == 0:
            continue
        for k0 in range(0, length, max_rows):
            k_len = min(max_rows, length - k0)
            if cur and (used + k_len > max_rows or cur[-1][0] == b):
                groups.append(cur)
                cur, used = [], 0
            cur.append((b, k0, k_len))
            used += k_len
    if cur:
        groups.append(cur)
    return groups


def mla_prefill_paged(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
    *,
    page_scales: torch.Tensor | None = None,
    max_chunk_rows: int = 16384,
    tuning: MlaPrefillTuning | None = None,
) -> torch.Tensor:
    """Varlen causal attention of new tokens over their requests' paged latent rows.

    q: [T, H, Dn + Dr] packed by request (cu_seqlens_q [B + 1]); pages: [NP, P, R + Dr] (FP8
    e4m3 with page_scales [NP] or [NP, P]); page_table: [B, MP]; context_lens: [B] rows of each
    request including its new tokens, which are its last n rows; kv_b_weight: [H * (Dn + Dv), R].
    The chunk plan is made on the host: host cu_seqlens_q / context_lens spare a device read.
    Returns [T, H, Dv] in q's dtype; `reference.mla_prefill` over the same rows.
    max_chunk_rows: key rows expanded per launch (the memory bound); tuning: the launch knobs
    (`MlaPrefillTuning`; None: the defaults, by shape).
    """
    tuning = tuning_or_default(tuning, MlaPrefillTuning)
    tokens, heads, qk_dim = q.shape
    rank = kv_b_weight.shape[1]
    width = pages.shape[2]
    rope = width - rank
    nope = qk_dim - rope
    page_size = pages.shape[1]
    if kv_b_weight.shape[0] != heads * (nope + v_head_dim):
        raise ValueError("kv_b_weight is not [H * (Dn + Dv), R] for these queries")
    if max_chunk_rows <= 0:
        raise ValueError("max_chunk_rows must be positive")
    lens = [int(n) for n in context_lens.tolist()]
    cq = [int(n) for n in cu_seqlens_q.tolist()]
    n_queries = [cq[i + 1] - cq[i] for i in range(len(lens))]
    bad = [i for i, (n, length) in enumerate(zip(n_queries, lens, strict=True)) if n > length]
    if bad:
        raise ValueError(f"requests {bad} have more queries than cached rows")

    device = q.device
    tiles = tuning.resolve(max(n_queries, default=1), q.is_cuda)
    o_acc = torch.zeros(tokens, heads, v_head_dim, dtype=torch.float32, device=device)
    lse_acc = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=device)
    weight = kv_b_weight.to(q.dtype)
    # Gather 1-byte (FP8) rows as uint8: indexing kernels need not support float8 types.
    flat = pages.view(-1, width)
    if pages.element_size() == 1:
        flat = flat.view(torch.uint8)
    cu_q_dev = cu_seqlens_q.to(device=device, dtype=torch.int32)
    lens_dev = context_lens.to(device=device, dtype=torch.int32)
    for group in _segments(lens, n_queries, max_chunk_rows):
        meta = torch.tensor([[b, k0, k_len] for b, k0, k_len in group], dtype=torch.int64).to(
            device
        )
        req, k0, k_len = meta.unbind(1)
        row0 = torch.cumsum(k_len, 0) - k_len
        total = sum(k_len for _, _, k_len in group)
        # Cache slot of every key of the group, on the device: [total].
        seg = torch.repeat_interleave(
            torch.arange(len(group), device=device), k_len, output_size=total
        )
        pos = k0[seg] + torch.arange(total, device=device) - row0[seg]
        page = page_table[req[seg], pos // page_size].long()
        slot = page * page_size + pos % page_size
        rows = flat.index_select(0, slot).view(pages.dtype)
        if page_scales is not None:
            s = page_scales[page] if page_scales.dim() == 1 else page_scales.view(-1)[slot]
            rows = rows.float() * s[:, None]
        rows = rows.to(q.dtype)
        kv = (rows[:, :rank] @ weight.t()).view(total, heads, nope + v_head_dim)
        max_n = max(n_queries[b] for b, _, _ in group)
        grid = (triton.cdiv(max_n, tiles.block_m), heads, len(group))
        _prefill_kernel[grid](
            q,
            kv,
            rows,
            o_acc,
            lse_acc,
            cu_q_dev,
            lens_dev,
            req.to(torch.int32),
            k0.to(torch.int32),
            k_len.to(torch.int32),
            row0.to(torch.int32),
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            kv.stride(1),
            rows.stride(0),
            o_acc.stride(0),
            o_acc.stride(1),
            lse_acc.stride(0),
            NOPE=nope,
            ROPE=rope,
            V_DIM=v_head_dim,
            RANK=rank,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return o_acc.to(q.dtype)
