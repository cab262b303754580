"""Launch helpers shared by the MoE, AttnRes and KDA Triton wrappers."""

from __future__ import annotations

import torch

# Triton's `eviction_policy` values, for the ops' cache-hint knobs ("" is none).
EVICTION_POLICIES = ("", "evict_first", "evict_last")


def num_sms(x: torch.Tensor) -> int:
    """Streaming multiprocessors of x's GPU (a small stand-in under the interpreter)."""
    if x.is_cuda:
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return 4
