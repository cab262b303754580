"""Grouped expert GEMMs over BLOCK_M-aligned expert segments (see align.py), in Triton.

- `_gate_up_kernel`: h = glu(A W1^T, A W3^T) for every local pair row, A gathered from the
  token rows (row_pair // top_k); the GLU (SiLU or SiTU) runs in the epilogue on fp32
  accumulators, so gate and up never reach memory. With FP8 it also quantises h per row and
  128 columns for the down GEMM.
- `_down_kernel`: y = h W2^T, rows stay in the segment layout (the combine gathers them).

Both are persistent: a fixed grid walks tiles (block, n-tile), block-major so the n-tiles of
one block run together and share the block's A rows in L2, and the bound (blocks in use) is
read on the device, so shapes are static and nothing waits on the host.

Weight formats (WFMT): 0 dense (bf16 / fp16 / fp32), 1 FP8 e4m3 with 128 x 128 block scales
and FP8 activations (1 x 128 scales), 2 MXFP4 weight-only (dequantised to A's dtype in
registers). Weights are [E, N, K] with K contiguous (checkpoint layout, no transposes).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .fp8 import to_fp8
from .mxfp4 import e8m0_to_float, mxfp4_dequant_pair

DENSE, FP8, MXFP4 = 0, 1, 2
SILU, SITU = 0, 1


@triton.jit
def _div(a, b, EXACT: tl.constexpr):
    # IEEE division as torch computes it (Triton's `/` on fp32 is the approximate div.full).
    if EXACT:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _tanh(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.tanh(x)
    else:
        t = tl.exp(-2.0 * tl.abs(x))
        r = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0, -r, r)


@triton.jit
def _tanh_approx(x):
    # One MUFU instruction (max relative error about 2^-11), against two MUFU and five FP32
    # instructions for the exp form above: the fast epilogue runs serialised with the main
    # loop (one CTA per SM), so its instruction count is GEMM time.
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _glu(
    g,
    u,
    beta,
    linear_beta,
    ACT: tl.constexpr,
    CAP_UP: tl.constexpr,
    ROUND: tl.constexpr,
    EXACT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """fp32 gate/up (already rounded to ROUND like the reference's GEMM outputs) -> fp32 h.

    SiLU mirrors `F.silu(gate) * up` on ROUND tensors (silu rounded, then the product);
    SiTU mirrors `situ_glu` (all fp32, one rounding at the end, done by the caller).
    EXACT: libdevice and IEEE divisions (the GLU as torch computes it). Otherwise on a GPU
    PTX's tanh.approx (sigmoid(g) = (1 + tanh(g / 2)) / 2, divisions by beta as products with
    its reciprocal); under the interpreter, which cannot run PTX, exp-based formulas.
    """
    if EXACT or INTERPRET:
        if ACT == 0:
            silu = _div(g, 1.0 + _exp(-g, EXACT), EXACT)
            return silu.to(ROUND).to(tl.float32) * u
        else:
            sig = _div(g * 0.0 + 1.0, 1.0 + _exp(-g, EXACT), EXACT)
            act = beta * _tanh(_div(g, g * 0.0 + beta, EXACT), EXACT) * sig
            if CAP_UP:
                u = linear_beta * _tanh(_div(u, u * 0.0 + linear_beta, EXACT), EXACT)
            return act * u
    else:
        sig = 0.5 * _tanh_approx(0.5 * g) + 0.5
        if ACT == 0:
            return (g * sig).to(ROUND).to(tl.float32) * u
        else:
            act = beta * _tanh_approx(g * (1.0 / beta)) * sig
            if CAP_UP:
                u = linear_beta * _tanh_approx(u * (1.0 / linear_beta))
            return act * u


@triton.jit
def _mxfp4_operand(x, dtype: tl.constexpr):
    """Decoded MXFP4 values (fp32) as an MMA operand of `dtype`. Each is a bf16 value (at most
    two significant bits, bf16's exponent range), so for bf16 the high half of the fp32 is the
    value: a shift instead of a conversion (conversions issue at a fraction of the FMA rate)."""
    if dtype == tl.bfloat16:
        return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _mma_step(
    acc,
    a_blk,
    w_ptr,
    s_ptr,
    w_offs,
    nmask,
    K,
    WFMT: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
):
    """acc += a [BM, BK] @ W[:, k0:k0+BK]^T for one weight.

    a_blk: (a, a_scale, k0, ks), A's K block: a_scale the [BM] FP8 activation scales of this
    K block (unused otherwise), ks = k0 + arange(BK). w_ptr, s_ptr: the weight and its scales;
    w_offs: the tile's (w_off, s_off, s_block) into them, shared by gate and up. w_off: [1, BN]
    offsets of the weight rows (K contiguous); s_off: [1, BN] offsets of the rows of the scales
    (FP8: the 128-row block's scale row; MXFP4: the row's scales); s_block: FP8 with BN <= 128:
    the offset of the scale row of the one 128-row block the tile lies in.
    """
    a, a_scale, k0, ks = a_blk
    w_off, s_off, s_block_off = w_offs
    w_tile = w_ptr + w_off
    s_tile = s_ptr + s_off
    s_block = s_ptr + s_block_off
    if WFMT == 0:
        b = tl.load(w_tile + ks[:, None], mask=nmask & (ks < K)[:, None], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc)
    elif WFMT == 1:
        b = tl.load(w_tile + ks[:, None], mask=nmask & (ks < K)[:, None], other=0.0)
        if BN <= 128:
            # One weight block across the tile: a scalar scale, folded into the row scales
            # (a [BM] product, not a [BM, BN] one, and one load instead of BN).
            b_scale = tl.load(s_block + k0 // 128)
            acc += tl.dot(a, b) * (a_scale * b_scale)[:, None]
        else:
            b_scale = tl.load(s_tile + k0 // 128, mask=nmask, other=0.0)  # [1, BN]
            acc += tl.dot(a, b) * (a_scale[:, None] * b_scale)
    else:
        kk = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(w_tile + kk[:, None], mask=nmask & (kk < K // 2)[:, None], other=0)
        kg = k0 // 32 + tl.arange(0, BK // 32)
        code = tl.load(s_tile + kg[:, None], mask=nmask & (kg < K // 32)[:, None], other=127)
        scale = e8m0_to_float(code)  # [BK/32, BN] -> one per 16 packed rows
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BK // 32, 16, BN]), [BK // 2, BN])
        lo, hi = mxfp4_dequant_pair(packed, scale)
        # K order inside a tile is free: even columns meet the low nibbles, odd the high.
        a_even, a_odd = tl.split(tl.reshape(a, [a.shape[0], BK // 2, 2]))
        acc = tl.dot(a_even, _mxfp4_operand(lo, a.dtype), acc)
        acc = tl.dot(a_odd, _mxfp4_operand(hi, a.dtype), acc)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,
    xs_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    hs_ptr,
    row_pair_ptr,
    block_expert_ptr,
    expert_start_ptr,
    counts_ptr,
    num_blocks_ptr,
    L,
    inter,
    top_k,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ht,
    stride_hst,
    beta,
    linear_beta,
    WFMT: tl.constexpr,
    ACT: tl.constexpr,
    CAP_UP: tl.constexpr,
    OUT_FP8: tl.constexpr,
    ROUND: tl.constexpr,
    EXACT: tl.constexpr,
    INTERPRET: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """x: [T, L] (FP8: e4m3 with xs [T, L/128]); w1, w3: [E, I, L] (MXFP4: [E, I, L/2]);
    h: [rows, I] in the segment layout (FP8: e4m3 with hs [rows, I/128])."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(inter, BN)
    total = tl.load(num_blocks_ptr) * n_tiles
    for tile in range(pid, total, tl.num_programs(0)):
        blk = tile // n_tiles
        nt = tile - blk * n_tiles
        e = tl.load(block_expert_ptr + blk)
        rows = blk * BM + tl.arange(0, BM)
        rmask = rows < tl.load(expert_start_ptr + e) + tl.load(counts_ptr + e)
        token = (tl.load(row_pair_ptr + rows, mask=rmask, other=0) // top_k).to(tl.int64)
        cols = nt * BN + tl.arange(0, BN)
        nmask = (cols < inter)[None, :]
        e64 = e.to(tl.int64)
        w_off = e64 * stride_we + cols[None, :].to(tl.int64) * stride_wn
        if WFMT == 1:
            s_off = e64 * stride_se + (cols[None, :] // 128).to(tl.int64) * stride_sn
        else:
            s_off = e64 * stride_se + cols[None, :].to(tl.int64) * stride_sn
        s_block = e64 * stride_se + ((nt * BN) // 128).to(tl.int64) * stride_sn
        w_offs = (w_off, s_off, s_block)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, L, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(
                x_ptr + token[:, None] * stride_xt + ks[None, :],
                mask=rmask[:, None] & (ks < L)[None, :],
                other=0.0,
            )
            a_scale = tl.zeros([BM], dtype=tl.float32)  # only FP8 has activation scales
            if WFMT == 1:
                a_scale = tl.load(xs_ptr + token * stride_xst + k0 // 128, mask=rmask, other=0.0)
            a_blk = (a, a_scale, k0, ks)
            acc_g = _mma_step(acc_g, a_blk, w1_ptr, s1_ptr, w_offs, nmask, L, WFMT, BK, BN)
            acc_u = _mma_step(acc_u, a_blk, w3_ptr, s3_ptr, w_offs, nmask, L, WFMT, BK, BN)
        g = acc_g.to(ROUND).to(tl.float32)
        u = acc_u.to(ROUND).to(tl.float32)
        h = _glu(g, u, beta, linear_beta, ACT, CAP_UP, ROUND, EXACT, INTERPRET).to(ROUND)
        out_mask = rmask[:, None] & nmask
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + cols[None, :]
        if OUT_FP8:
            # BN == 128: this tile is exactly one activation-quantisation group per row.
            hf = tl.where(out_mask, h.to(tl.float32), 0.0)
            amax = tl.maximum(tl.max(tl.abs(hf), axis=1), 1e-12)
            if EXACT:
                scale = tl.math.div_rn(amax, amax * 0.0 + 448.0)
                q = tl.math.div_rn(hf, scale[:, None])
            else:
                # One reciprocal per row instead of an IEEE division per element.
                scale = amax * (1.0 / 448.0)
                q = hf * (448.0 / amax)[:, None]
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            tl.store(h_ptrs, to_fp8(q, INTERPRET), mask=out_mask)
            tl.store(hs_ptr + rows.to(tl.int64) * stride_hst + nt, scale, mask=rmask)
        else:
            tl.store(h_ptrs, h, mask=out_mask)


@triton.jit
def _down_kernel(
    h_ptr,
    hs_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    block_expert_ptr,
    expert_start_ptr,
    counts_ptr,
    num_blocks_ptr,
    L,
    inter,
    stride_ht,
    stride_hst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    WFMT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """h: [rows, I] segment layout (FP8: e4m3 + hs [rows, I/128]); w2: [E, L, I]
    (MXFP4: [E, L, I/2]); y: [rows, L] segment layout."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(L, BN)
    total = tl.load(num_blocks_ptr) * n_tiles
    for tile in range(pid, total, tl.num_programs(0)):
        blk = tile // n_tiles
        nt = tile - blk * n_tiles
        e = tl.load(block_expert_ptr + blk)
        rows = blk * BM + tl.arange(0, BM)
        rmask = rows < tl.load(expert_start_ptr + e) + tl.load(counts_ptr + e)
        r64 = rows.to(tl.int64)
        cols = nt * BN + tl.arange(0, BN)
        nmask = (cols < L)[None, :]
        e64 = e.to(tl.int64)
        w_off = e64 * stride_we + cols[None, :].to(tl.int64) * stride_wn
        if WFMT == 1:
            s_off = e64 * stride_se + (cols[None, :] // 128).to(tl.int64) * stride_sn
        else:
            s_off = e64 * stride_se + cols[None, :].to(tl.int64) * stride_sn
        s_block = e64 * stride_se + ((nt * BN) // 128).to(tl.int64) * stride_sn
        w_offs = (w_off, s_off, s_block)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, inter, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(
                h_ptr + r64[:, None] * stride_ht + ks[None, :],
                mask=rmask[:, None] & (ks < inter)[None, :],
                other=0.0,
            )
            a_scale = tl.zeros([BM], dtype=tl.float32)
            if WFMT == 1:
                a_scale = tl.load(hs_ptr + r64 * stride_hst + k0 // 128, mask=rmask, other=0.0)
            a_blk = (a, a_scale, k0, ks)
            acc = _mma_step(acc, a_blk, w2_ptr, s2_ptr, w_offs, nmask, inter, WFMT, BK, BN)
        y_ptrs = y_ptr + r64[:, None] * stride_yt + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask)
