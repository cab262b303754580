"""Per-row FP8 (E4M3) quantisation of activations sent between ranks.

Each row (one token) gets its own fp32 scale, amax / 448, sent beside the row; the receiver
multiplies back. Rows of zeros get scale 1 (never a division by zero). The codes travel as
bytes (`torch.uint8` views), which every collective backend moves.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, W] -> (codes [N, W] float8_e4m3fn, scales [N, 1] fp32); x ~= codes * scales."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else xf.new_zeros(x.shape[0], 1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, W] float8_e4m3fn, scale [N, 1] fp32 -> [N, W] in dtype."""
    return (codes.float() * scale).to(dtype)
