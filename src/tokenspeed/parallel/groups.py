"""`ParallelGroups`: the process groups of one `ParallelDims` layout, for one rank.

Built collectively: every rank of the world calls `ParallelGroups.build` with the same dims, in
the same order relative to its other collective calls (torch.distributed creates groups by
collective agreement). The default process group must be initialised by the caller (torchrun,
`torch.distributed.init_process_group`); nothing here is global: two layouts in one process
get groups of their own.
"""

from __future__ import annotations

from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from .dims import KINDS, ParallelDims, ParallelError


def backend_for(device: torch.device | str) -> str:
    """The collective backend for tensors on `device`: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@attrs.frozen
class Group:
    """One process group and this rank's place in it."""

    handle: object  # a torch.distributed ProcessGroup (None when the group is just this rank)
    ranks: tuple[int, ...]
    rank: int  # the global rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position in the group."""
        return self.ranks.index(self.rank)


@attrs.frozen
class ParallelGroups:
    dims: ParallelDims
    rank: int
    device: torch.device
    groups: dict[str, Group]

    def __getitem__(self, kind: str) -> Group:
        return self.groups[kind]

    @classmethod
    def build(
        cls,
        dims: ParallelDims,
        device: torch.device | str = "cpu",
        *,
        timeout: timedelta | None = None,
    ) -> ParallelGroups:
        """This rank's groups of every kind with degree > 1. `timeout` bounds every collective
        of these groups (a dead peer makes the others fail instead of waiting forever)."""
        if not dist.is_initialized():
            raise ParallelError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != dims.world_size:
            raise ParallelError(
                f"ParallelDims.world_size={dims.world_size} but the process group has {world} ranks"
            )
        device = torch.device(device)
        backend = backend_for(device)
        options = {} if timeout is None else {"timeout": timeout}
        groups = {}
        for kind in KINDS:
            degree = getattr(dims, kind)
            if degree == 1:
                groups[kind] = Group(None, (rank,), rank)
                continue
            for start in range(0, world, degree):
                ranks = tuple(range(start, start + degree))
                handle = dist.new_group(list(ranks), backend=backend, **options)
                if rank in ranks:
                    groups[kind] = Group(handle, ranks, rank)
        return cls(dims, rank, device, groups)
