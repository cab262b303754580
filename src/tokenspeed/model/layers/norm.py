"""Weight-carrying normalisation modules."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. x: [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm times sigmoid(gate) (KDA's output tail). x, gate: [..., K]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
