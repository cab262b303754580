"""The one place that picks an implementation for each op the layers call.

Today: the torch references, except where a graph-safe torch form is needed on CUDA. The GPU
kernel work (KDA, MLA, MoE) plugs its Triton paths in here, keeping the references as the
fallback when Triton or a GPU is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .moe import routed_experts as _routed_loop
from .moe import routed_experts_grouped as _routed_grouped


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Routed experts: grouped GEMMs on CUDA (graph-safe), the per-expert loop elsewhere."""
    if x.is_cuda:
        return _routed_grouped(x, weights, ids, w1, w2, w3, glu)
    return _routed_loop(x, weights, ids, w1, w2, w3, glu)
