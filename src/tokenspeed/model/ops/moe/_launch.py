"""Launch helpers shared by the MoE, AttnRes and KDA Triton wrappers."""

from __future__ import annotations

import os

import torch

# Triton's `eviction_policy` values, for the ops' cache-hint knobs ("" is none).
EVICTION_POLICIES = ("", "evict_first", "evict_last")


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_sms(x: torch.Tensor) -> int:
    """Streaming multiprocessors of x's GPU (a small stand-in under the interpreter)."""
    if x.is_cuda:
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return 4
