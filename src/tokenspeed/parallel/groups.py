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


def new_groups(size: int, backend: str, timeout: timedelta | None = None) -> Group:
    """Create the process groups of `size` consecutive ranks that partition the world (every
    rank of the world calls this, in the same order: torch.distributed creates groups
    collectively) and return this rank's. `timeout` bounds each group's collectives."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == 1:
        return Group(None, (rank,), rank)
    options = {} if timeout is None else {"timeout": timeout}
    mine = None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        handle = dist.new_group(list(ranks), backend=backend, **options)
        if rank in ranks:
            mine = Group(handle, ranks, rank)
    assert mine is not None, (size, world, rank)
    return mine


@attrs.frozen
class ParallelGroups:
    """dims: the layout. rank: this rank. device: where the groups' backend takes tensors.
    groups: kind -> `Group`. timeout: what bounds the groups' collectives (None: the default
    process group's), also given to groups a transform creates later (DWDP's fetch group)."""

    dims: ParallelDims
    rank: int
    device: torch.device
    groups: dict[str, Group]
    timeout: timedelta | None = None

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
        groups = {kind: new_groups(getattr(dims, kind), backend, timeout) for kind in KINDS}
        return cls(dims, rank, device, groups, timeout)
