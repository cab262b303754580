"""FP8 e4m3 with block scales (DeepSeek-style), for the routed experts.

Weights: 128 x 128 blocks, one fp32 scale each: w [.., N, K] e4m3, s [.., N/128, K/128].
Activations: 1 x 128 groups per row, quantised on the fly: q [T, K] e4m3, s [T, K/128].
value = q * s; s = amax / 448 (448: the largest e4m3 value), so every group uses the full range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpret import interpreting
from ._launch import cdiv, next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


@triton.jit
def _round_e4m3(x):
    """x rounded to the nearest e4m3 value (ties to even), in fp32; |x| <= 448 assumed.

    Only for the CPU interpreter, whose fp32 -> e4m3 cast drops the carry when the mantissa
    rounds up into the next binade (31.3 -> 16 instead of 32); on GPUs the hardware cast is
    used. Quantum: 2^(e - 3) for normals (3 mantissa bits), 2^-9 below 2^-6.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    q_exp = tl.maximum(exponent, -6) - 3
    quantum = ((q_exp + 127) << 23).to(tl.float32, bitcast=True)
    scaled = x / quantum  # exact: quantum is a power of two
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, to even
    return ((scaled + magic) - magic) * quantum


@triton.jit
def to_fp8(x, INTERPRET: tl.constexpr):
    """fp32 [...] (already clamped to +-448) -> e4m3, round to nearest even."""
    if INTERPRET:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    T,
    K,
    G,
    stride_x,
    stride_q,
    stride_s,
    BG: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """x: [T, K] -> q [T, K] e4m3, s [T, G] fp32 (G = ceil(K / GROUP)); each program takes BG
    consecutive groups of the row-major [T, G] group grid, so rows of any K fill the tiles."""
    g = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    row = g // G
    grp = g - row * G
    cols = grp[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [BG, GROUP]
    live = row < T
    mask = live[:, None] & (cols < K)
    x = tl.load(x_ptr + row[:, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), amax * 0.0 + 448.0)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + row[:, None] * stride_q + cols, to_fp8(q, INTERPRET), mask=mask)
    tl.store(s_ptr + row * stride_s + grp, scale, mask=live)


# Groups per program: [32, 128] elements, 32 a thread (4 warps), so four 16-byte loads per
# thread are in flight; one program per row's 8 groups (one load a thread) was latency-bound
# (73 us at 16384 x 3584 bf16 on the H200, ~1.6x the bytes' time).
_GROUPS_PER_PROGRAM = 32


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-128-column e4m3 quantisation (Triton). x: [T, K] -> (q [T, K], s [T, K/128]).

    Same arithmetic as `quantize_fp8_rows_reference` (IEEE divisions), so results match it
    bit for bit.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with contiguous rows, got {tuple(x.shape)}")
    tokens, k = x.shape
    groups = cdiv(k, GROUP)
    q = torch.empty(tokens, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(tokens, groups, dtype=torch.float32, device=x.device)
    bg = min(_GROUPS_PER_PROGRAM, next_power_of_2(tokens * groups))
    if tokens and k:
        _quantize_rows_kernel[(cdiv(tokens * groups, bg),)](
            x,
            q,
            s,
            tokens,
            k,
            groups,
            x.stride(0),
            q.stride(0),
            s.stride(0),
            BG=bg,
            GROUP_SIZE=GROUP,
            INTERPRET=interpreting(),
            num_warps=4,
        )
    return q, s


def quantize_fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_fp8_rows`. x: [T, K], K % 128 == 0."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1).clamp_min(1e-12)
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal,
    # which rounds apart from a division now and then (the kernel divides, IEEE).
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize_fp8_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[T, K] e4m3 with [T, K/128] scales -> fp32 [T, K]."""
    return (q.float().reshape(q.shape[0], -1, GROUP) * s.unsqueeze(-1)).reshape(q.shape)


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., N, K] (N, K multiples of 128) -> (e4m3 [..., N, K], fp32 [..., N/128, K/128]).

    A load-time helper (checkpoints in this format ship q and s already).
    """
    *lead, n, k = w.shape
    if n % GROUP or k % GROUP:
        raise ValueError(f"fp8 block quantisation needs multiples of {GROUP}, got {n} x {k}")
    blocks = w.float().reshape(*lead, n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / FP8_MAX  # [..., N/128, K/128]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(w.shape), scale


def dequantize_fp8_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8_blocks` up to rounding: fp32 [..., N, K]."""
    *lead, n, k = q.shape
    blocks = q.float().reshape(*lead, n // GROUP, GROUP, k // GROUP, GROUP)
    return (blocks * s[..., :, None, :, None]).reshape(q.shape)
