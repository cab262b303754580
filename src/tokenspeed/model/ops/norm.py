"""Normalisations used across the model, computed in fp32."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / rms(x) * weight.

    x: [..., D]; weight: [D]. The normalisation runs in fp32 and is cast back to x's dtype
    before the weight is applied (as Kimi checkpoints were trained).
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x times sigmoid(gate), all in fp32 (KDA's output tail).

    x, gate: [..., K]; weight: [K]. Returns x's dtype.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (the q/k norm of KDA).

    x: [..., K] -> fp32 [..., K].
    """
    xf = x.float()
    return xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
