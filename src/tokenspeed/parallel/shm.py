"""Named POSIX shared-memory blocks seen as torch tensors (DWDP's one-sided CPU transport).

A block is a `multiprocessing.shared_memory.SharedMemory`; `block_tensor` views the whole
mapping as one uint8 tensor (`torch.frombuffer`), and tensors of any dtype are views of that.
Lifetime rules, so that no tensor ever points at unmapped memory:

- `torch.frombuffer` keeps a reference to the object it was given but no buffer export, so
  `SharedMemory.close()` would unmap the memory under the tensor. `block_tensor` hands it a
  memoryview of its own, whose export keeps the mmap open: `close()` then cannot unmap it
  (`SharedBlock.close` tolerates that), and the mapping goes with the last tensor viewing it.
- An owner `unlink`s its name as soon as every peer has attached: the mappings stay valid in
  every attached process, and nothing is left in /dev/shm whatever happens to the processes
  later. Until then the creator's resource tracker unlinks it if the creator dies.
- Attaching does not track the name (3.13's `track=False`; before, the attach's registration
  is withdrawn at once, and the owner registers again just before unlinking, so a tracker
  shared by the ranks, as under the spawn start method, sees each name registered and
  unregistered once).
"""

from __future__ import annotations

import contextlib
import os
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

_TRACK_PARAMETER = sys.version_info >= (3, 13)  # SharedMemory(..., track=False)
ALIGN = 64  # bytes: every tensor of a block starts at a multiple of this


class SharedBlock(SharedMemory):
    """A `SharedMemory` whose `close` leaves the mapping to the tensors still viewing it."""

    def close(self) -> None:
        try:
            super().close()
        except BufferError:
            # Tensors view the mapping (through block_tensor's memoryview): it is unmapped with
            # the last of them; the descriptor is not needed for that (mmap holds its own).
            fd = getattr(self, "_fd", -1)
            if fd >= 0:
                os.close(fd)
                self._fd = -1


def _tracker_name(block: SharedMemory) -> str:
    return getattr(block, "_name", "/" + block.name)


def create_block(name: str, size: int) -> SharedBlock:
    """A new block of `size` bytes (> 0) named `name`; FileExistsError if the name is taken."""
    return SharedBlock(name=name, create=True, size=size)


def attach_block(name: str) -> SharedBlock:
    """Map the block another process created, without tracking its name here."""
    if _TRACK_PARAMETER:
        return SharedBlock(name=name, track=False)
    block = SharedBlock(name=name)
    if os.name == "posix":
        resource_tracker.unregister(_tracker_name(block), "shared_memory")
    return block


def unlink_block(block: SharedMemory) -> None:
    """Remove the block's name (its mappings stay valid); a name already gone is fine."""
    if not _TRACK_PARAMETER and os.name == "posix":
        # Peers sharing this process's tracker withdrew the name when they attached.
        resource_tracker.register(_tracker_name(block), "shared_memory")
    with contextlib.suppress(FileNotFoundError):
        block.unlink()


def block_tensor(block: SharedMemory) -> torch.Tensor:
    """The whole mapping as a uint8 tensor (keeps the mapping alive: see the module docstring)."""
    return torch.frombuffer(memoryview(block.buf), dtype=torch.uint8)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def view_as(base: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    """The tensor of `shape` and `dtype` at byte `offset` of a uint8 `base` (same storage)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return base[offset : offset + nbytes].view(dtype).view(shape)
