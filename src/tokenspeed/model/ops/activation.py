"""Gated linear unit activations: SiLU-GLU (Kimi Linear) and SiTU-GLU (K3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. gate, up: [..., I] -> [..., I]."""
    return F.silu(gate) * up


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None
) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta).

    The tanh soft-caps bound both branches. Computed in fp32, returned in gate's dtype.
    gate, up: [..., I] -> [..., I]. linear_beta None leaves `up` uncapped.
    """
    g = gate.float()
    u = up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)
