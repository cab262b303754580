"""Attention residuals: a learned softmax mix over a bank of earlier representations."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..ops.attn_res import attn_res_mix
from .norm import RMSNorm


class AttnResMix(nn.Module):
    """One mixing site: norm weight [D] and pseudo-query proj [1, D].

    forward(bank): bank is N tensors [T, D]; returns their per-token softmax mix [T, D].
    """

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)  # only its weight is used: scores see rmsnorm(V_i) * w
        self.proj = nn.Linear(hidden, 1, bias=False)

    def forward(self, bank: Sequence[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(bank, self.proj.weight, self.norm.weight, self.norm.eps)
