"""Torch references for the sigmoid router and the routed experts."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row; ties go to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-corrected (optionally grouped) top-k selection.

    x: [T, D]; weight: [E, D]; bias: [E] (e_score_correction_bias; selection only).
    Scores s = sigmoid(x W^T) in fp32. Experts are chosen by s + bias: with num_groups > 1,
    each group is scored by the sum of its two best biased scores, the best topk_groups groups
    are kept and the top_k experts are chosen among them. Weights are the unbiased s of the
    chosen experts, renormalised to sum 1 when `renormalize`, times `scaling`.
    Returns (weights [T, top_k] fp32, expert ids [T, top_k] int64), best expert first.
    """
    scores = torch.sigmoid(x.float() @ weight.float().t())  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, num_groups, experts // num_groups)
        group_scores = grouped.gather(-1, _top(grouped, 2)).sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _top(group_scores, topk_groups), True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(tokens, experts)
    ids = _top(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Weighted sum of each token's chosen experts, accumulated in fp32.

    x: [T, D]; weights, ids: [T, k]; w1 (gate), w3 (up): [E, I, D]; w2 (down): [E, D, I];
    glu(gate, up) -> [.., I]. Returns [T, D] in x's dtype.
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = x[token]
        y = glu(h @ w1[expert].t(), h @ w3[expert].t()) @ w2[expert].t()
        out.index_add_(0, token, y.float() * weights[token, slot].unsqueeze(-1))
    return out.to(x.dtype)


def routed_experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`routed_experts` with grouped GEMMs over (token, expert) pairs sorted by expert.

    Same contract and result; static shapes and no host synchronisation, so it can be captured
    in a CUDA graph. Needs rows of 16-byte multiples (torch._grouped_mm).
    """
    tokens, top_k = ids.shape
    experts = w1.shape[0]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    token = order // top_k
    h = x[token]
    gate = torch._grouped_mm(h, w1.transpose(1, 2), offs=offsets)
    up = torch._grouped_mm(h, w3.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(glu(gate, up), w2.transpose(1, 2), offs=offsets)
    y = y.float() * weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y).to(x.dtype)


def routed_experts_dense(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`routed_experts` computing every expert on every token, weighted by each token's routing
    weight for it (zero when not chosen). Same result, graph-safe in any dtype, E times the
    FLOPs: for small models in fp32 on a GPU (tests), where grouped GEMMs need bf16."""
    experts = w1.shape[0]
    dense = torch.zeros(x.shape[0], experts, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids, weights.float())
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(experts):
        y = glu(x @ w1[e].t(), x @ w3[e].t()) @ w2[e].t()
        out += y.float() * dense[:, e : e + 1]
    return out.to(x.dtype)
