"""Torch reference of the attention-residual mix (AttnRes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def attn_res_mix(
    bank: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Softmax-weighted mix over a bank of earlier representations, per token, in fp32.

    bank: N tensors [T, D] (completed block sums, oldest first, then the current partial sum);
    query: [D] or [1, D] the learned pseudo-query (a hidden -> 1 projection);
    norm_weight: [D] the RMSNorm weight applied to each entry before scoring.
    alpha_i = softmax_i(<rmsnorm(V_i) * norm_weight, query>); returns sum_i alpha_i V_i [T, D]
    in the bank's dtype.
    """
    values = torch.stack([b.float() for b in bank])  # [N, T, D]
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    scores = normed @ (norm_weight.float() * query.float().reshape(-1))  # [N, T]
    alpha = scores.softmax(0)
    return (alpha.unsqueeze(-1) * values).sum(0).to(bank[0].dtype)
