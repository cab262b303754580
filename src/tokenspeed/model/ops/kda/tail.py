"""KDA output tail in one pass: per-head RMSNorm of the attention output, times the sigmoid of
the output gate, optionally quantised to FP8 e4m3 with one scale per token for o_proj.

Same math as `tokenspeed.model.ops.norm.gated_rms_norm` (fp32 throughout); the FP8 form
quantises the fp32 result: scale = max(amax, FP8_MIN_AMAX) / 448, q = clamp(y / scale).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ..tuning import boolean, tuning_or_default, warp_count
from .decode import pdl_enabled

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-10  # keeps the scale of an all-zero row finite


@attrs.frozen(kw_only=True)
class KdaTailTuning:
    """The tuning knobs of `kda_output_tail`; the defaults are the measured ones (None: by
    shape). num_warps: the kernel's warps (None: about 32 fp32 values of a token's [H, V] tile
    per thread, 1..16); use_pdl: programmatic dependent launch (None: `pdl_enabled`). Neither
    changes the result."""

    num_warps: int | None = attrs.field(default=None, validator=warp_count())
    use_pdl: bool | None = attrs.field(default=None, validator=boolean())

    def warps(self, heads: int, v_dim: int) -> int:
        """The warps of a launch over H heads of V values."""
        if self.num_warps is not None:
            return self.num_warps
        # About 32 fp32 values of each row tile per thread.
        return max(1, min(16, triton.next_power_of_2(heads) * v_dim // 1024))


@triton.jit
def _kda_tail_kernel(
    o_ptr,  # [T, H*V] attention output
    gate_ptr,  # [T, H*V] output-gate logits
    weight_ptr,  # [V] norm weight
    y_ptr,  # [T, H*V] model dtype, or float8_e4m3fn when FP8
    scale_ptr,  # [T] fp32 per-token scales (FP8 only)
    stride_o,
    stride_gate,
    stride_y,
    eps,
    fp8_max,
    min_amax,
    H: tl.constexpr,
    V: tl.constexpr,
    BH: tl.constexpr,  # next power of two >= H
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    oh = tl.arange(0, BH)
    ov = tl.arange(0, V)
    mask = (oh < H)[:, None]
    tile = oh[:, None] * V + ov[None, :]  # the whole row as [heads, V]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(o_ptr + row * stride_o + tile, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_gate + tile, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + ov).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / V + eps)
    y = x * rstd[:, None] * w[None, :] * tl.sigmoid(g)
    if FP8:
        amax = tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), axis=0)
        scale = tl.maximum(amax, min_amax) / fp8_max
        q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
        tl.store(y_ptr + row * stride_y + tile, q.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(y_ptr + row * stride_y + tile, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, tokens: int, width: int, name: str) -> torch.Tensor:
    x = x.reshape(tokens, width)
    if x.stride(1) != 1:
        raise ValueError(f"{name} needs each token's H*V values contiguous")
    return x


def kda_output_tail(
    o: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    fp8: bool = False,
    out: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    tuning: KdaTailTuning | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm per head of o, times weight and sigmoid(gate), for T tokens.

    o: [T, H, V] (or [T, H*V] with H given by gate / weight: H = width / V); gate: same number
    of elements per token, logits of the output gate; weight: [V].
    Returns y [T, H*V] in o's dtype, or with fp8=True (q [T, H*V] float8_e4m3fn, scales [T, 1]
    fp32) such that y ~= q * scales (row-wise scales as torch._scaled_mm takes them).
    out / scales: optional destinations of those shapes (static buffers under CUDA graphs). With
    fp8=True an fp32 `out` receives the scaled values before the e4m3 rounding.
    tuning: the launch knobs (`KdaTailTuning`; None: the measured defaults).

    Preconditions: each token's H*V values of o and gate are contiguous (token rows may be
    strided, e.g. a slice of a fused projection); V is a power of two. No host sync.
    """
    tuning = tuning_or_default(tuning, KdaTailTuning)
    v_dim = weight.shape[0]
    tokens = o.shape[0]
    width = o.shape[1:].numel()
    if width % v_dim or v_dim & (v_dim - 1):
        raise ValueError(
            f"o has {width} values per token; weight [{v_dim}] must divide it and be a power of two"
        )
    if gate.numel() != o.numel():
        raise ValueError(f"gate {tuple(gate.shape)} does not match o {tuple(o.shape)}")
    heads = width // v_dim
    o2, gate2 = _rows(o, tokens, width, "o"), _rows(gate, tokens, width, "gate")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    y = out
    if y is None:
        dtype = torch.float8_e4m3fn if fp8 else o.dtype
        y = torch.empty(tokens, width, dtype=dtype, device=o.device)
    if y.shape != (tokens, width) or y.stride(1) != 1:
        raise ValueError(f"out must be [{tokens}, {width}] with contiguous rows")
    if not fp8:
        scales = None
    elif scales is None:
        scales = torch.empty(tokens, 1, dtype=torch.float32, device=o.device)
    elif scales.shape != (tokens, 1) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous fp32 [{tokens}, 1]")
    if tokens:
        block_h = triton.next_power_of_2(heads)
        num_warps = tuning.warps(heads, v_dim)
        use_pdl = pdl_enabled(o) if tuning.use_pdl is None else tuning.use_pdl
        launch = {"launch_pdl": True} if use_pdl else {}
        _kda_tail_kernel[(tokens,)](
            o2,
            gate2,
            weight,
            y,
            scales,
            o2.stride(0),
            gate2.stride(0),
            y.stride(0),
            float(eps),
            FP8_MAX,
            FP8_MIN_AMAX,
            H=heads,
            V=v_dim,
            BH=block_h,
            FP8=fp8,
            USE_PDL=use_pdl,
            num_warps=num_warps,
            **launch,
        )
    return (y, scales) if fp8 else y


def fp8_quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the FP8 step: per-row scale and e4m3 values of fp32 y [T, D]."""
    yf = y.float()
    scales = yf.abs().amax(-1, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    q = (yf / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales
