"""Launch helpers shared by the MoE, AttnRes and KDA Triton wrappers."""

from __future__ import annotations

import functools

import torch

# Triton's `eviction_policy` values, for the ops' cache-hint knobs ("" is none).
EVICTION_POLICIES = ("", "evict_first", "evict_last")


# `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from the host, each
# call goes through Triton's constexpr unwrapping (about 1.4 us, 100 times the arithmetic, on a
# fast CPU). The launch wrappers call these plain copies instead (same results for every int).
def cdiv(x: int, y: int) -> int:
    """ceil(x / y), as `triton.cdiv`."""
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as `triton.next_power_of_2` (same bit moves)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    n += 1
    return n


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(x: torch.Tensor) -> int:
    """Streaming multiprocessors of x's GPU, looked up once per device (a small stand-in under
    the interpreter)."""
    if x.is_cuda:
        return _sm_count(x.device.index if x.device.index is not None else 0)
    return 4
