"""Host-to-device copies of small step inputs that do not make the host wait for the GPU.

A copy from ordinary (pageable) host memory waits for the stream to drain before it returns, so a
host that prepares the next step's inputs while the GPU runs the current one (multi-step decoding
queues several steps before it reads any result) would stall at every page table or split plan.
Staged through pinned memory and issued asynchronously, the copy takes its place in stream order
and the host goes on; the pinned block is kept by torch's host allocator until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(src: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`src` (a host tensor) on `device`; on CUDA without waiting for the stream."""
    device = torch.device(device)
    if device.type != "cuda":
        return src.to(device)
    return src.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a host `src`; on CUDA without waiting for the stream."""
    if dst.is_cuda and not src.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
