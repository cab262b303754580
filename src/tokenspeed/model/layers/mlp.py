"""Dense gated MLP (the first layer, and the shared experts of a MoE layer)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ActivationConfig
from ..ops.activation import silu_glu, situ_glu


def make_glu(config: ActivationConfig):
    """The GLU function glu(gate, up) named by the activation config."""
    if config.kind == "silu":
        return silu_glu
    beta, linear_beta = config.situ_beta, config.situ_linear_beta
    return lambda gate, up: situ_glu(gate, up, beta, linear_beta)


class GluMlp(nn.Module):
    """down(glu(gate(x), up(x))). x: [T, D] -> [T, D]."""

    def __init__(self, hidden: int, intermediate: int, activation: ActivationConfig):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.glu = make_glu(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
