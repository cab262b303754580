"""Depthwise causal short convolution (KDA's q/k/v conv), for prefill and for one-step decode.

The conv state of a sequence is the last W-1 inputs it has seen, oldest first: [C, W-1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence, continuing from `state`.

    x: [T, C] new inputs; weight: [C, W] (tap W-1 multiplies the current input);
    state: [C, W-1] the previous W-1 inputs (zeros when None, i.e. a fresh sequence).
    Returns y: [T, C] (SiLU applied when `silu`) and the new state [C, W-1].
    """
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, W-1+T]
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=channels)[0].t()
    if silu:
        y = F.silu(y)
    return y, window[:, -(width - 1) :].clone()


def causal_conv_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences.

    x: [B, C] the new input of each sequence; state: [B, C, W-1]; weight: [C, W].
    Returns y: [B, C] and the new state [B, C, W-1] (inputs are not modified).
    """
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * weight.to(x.dtype)).sum(-1)
    if silu:
        y = F.silu(y)
    return y, window[..., 1:].clone()
