"""Weighted combine of expert rows back to token order, with the latent RMSNorm fused."""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ..tuning import integer, tuning_or_default, warp_count
from ._launch import cdiv, next_power_of_2


@attrs.frozen(kw_only=True)
class CombineTuning:
    """The tuning knobs of `combine` (and so of `fused_experts`' last launch, through
    `MoeKernelConfig.combine`); None means "by shape" (`resolve`). Neither changes the result.

    block_l: columns per program (None: whole rows, one program per token; the fused norm needs
    them); num_warps: the kernel's warps (None: 8 from 4096 columns, 4 from 1024, else one per
    256 columns).
    """

    block_l: int | None = attrs.field(default=None, validator=integer(pow2=True))
    num_warps: int | None = attrs.field(default=None, validator=warp_count())

    def resolve(self, width: int) -> tuple[int, int]:
        """(block_l, num_warps) of a combine over rows of `width` columns."""
        bl = self.block_l or next_power_of_2(width)
        if self.num_warps is not None:
            return bl, self.num_warps
        return bl, 8 if bl >= 4096 else 4 if bl >= 1024 else max(1, bl // 256)


@triton.jit
def _combine_kernel(
    y_ptr,
    pair_row_ptr,
    w_ptr,
    norm_ptr,
    out_ptr,
    L,
    stride_y,
    stride_o,
    eps,
    K: tl.constexpr,
    BL: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """y: [rows, L] expert outputs in the segment layout; pair_row, w: [T, K] (row -1: not
    local); out: [T, L] = sum_j w[t, j] * y[pair_row[t, j]] in fp32, summed in slot order
    (then, with HAS_NORM, RMSNorm as `ops.norm.rms_norm` computes it; BL then covers L).
    Program (t, c): token t, columns [c BL, (c+1) BL)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BL + tl.arange(0, BL)
    cmask = cols < L
    acc = tl.zeros([BL], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pair_row_ptr + t * K + j)
        # A branch, not a mask: on an expert-parallel rank about 15 of a token's 16 slots are
        # elsewhere, and converting and accumulating their masked zeros made the kernel
        # ALU-bound (2.5x a copy of the same bytes on the H200, docs/perf/moe.md).
        if row >= 0:
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            v = tl.load(y_ptr + row.to(tl.int64) * stride_y + cols, mask=cmask, other=0.0)
            acc += v.to(tl.float32) * w
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_NORM:
        xf = out.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / L + eps)
        normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(norm_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        out = (normed * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + cols, out, mask=cmask)


def combine(
    y: torch.Tensor,
    pair_row: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    tuning: CombineTuning | None = None,
) -> torch.Tensor:
    """Token outputs [T, L] from expert rows y [rows, L]; pair_row, weights: [T, k].

    tuning: the launch knobs (`CombineTuning`; None: whole rows, warps by width)."""
    tuning = tuning_or_default(tuning, CombineTuning)
    tokens, top_k = weights.shape
    width = y.shape[1]
    out = torch.empty(tokens, width, dtype=out_dtype, device=y.device)
    if tokens == 0:
        return out
    bl, num_warps = tuning.resolve(width)
    if norm_weight is not None and bl < width:
        raise ValueError(f"the fused norm needs whole rows: block_l {bl} < width {width}")
    _combine_kernel[(tokens, cdiv(width, bl))](
        y,
        pair_row.contiguous(),
        weights.contiguous(),
        norm_weight if norm_weight is not None else out,
        out,
        width,
        y.stride(0),
        out.stride(0),
        eps,
        K=top_k,
        BL=bl,
        HAS_NORM=norm_weight is not None,
        num_warps=num_warps,
    )
    return out
