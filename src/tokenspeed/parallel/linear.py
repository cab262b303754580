"""Pieces the transforms share: slicing a parameter or buffer into a rank's shard
(`shard_tensor`), and a row-parallel linear (a slice of the input columns, then one all-reduce).

Slicing copies (`narrow(...).clone()`), never computes, so it works on meta tensors too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .comm import CommLog, all_reduce_
from .dims import ParallelError
from .groups import Group
from .shards import mark_shard


def take(tensor: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """A copy of [start, stop) of `tensor` along `dim` (its own storage: the full tensor can be
    freed once every shard is taken)."""
    return tensor.detach().narrow(dim, start, stop - start).clone()


def as_parameter(tensor: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=like.requires_grad)


def shard_tensor(module: nn.Module, name: str, *, dim: int, start: int, stop: int) -> None:
    """Replace `module.<name>` (a parameter or a buffer) by a copy of [start, stop) of it along
    `dim`, of the same kind, and mark the shard (`mark_shard`: a tensor is sliced once)."""
    old = getattr(module, name)
    if not isinstance(old, nn.Parameter) and name not in module._buffers:
        raise TypeError(f"{type(module).__name__}.{name} is neither a parameter nor a buffer")
    part = take(old, dim, start, stop)
    mark_shard(module, name, dim=dim, start=start, stop=stop)  # raises before any change
    if isinstance(old, nn.Parameter):
        setattr(module, name, as_parameter(part, old))
    else:
        module._buffers[name] = part


def shard_linear_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Keep output features [start, stop) of an nn.Linear (a column-parallel shard that needs
    no communication: its consumer works on the local slice)."""
    shard_tensor(linear, "weight", dim=0, start=start, stop=stop)
    if linear.bias is not None:
        shard_tensor(linear, "bias", dim=0, start=start, stop=stop)
    linear.out_features = stop - start


def shard_linear_columns(linear: nn.Linear, start: int, stop: int) -> None:
    """Keep input features [start, stop) of an nn.Linear (its output is a partial sum, which a
    bias would be added to on every member: refused, use `RowParallelLinear`)."""
    if linear.bias is not None:
        raise ParallelError(
            f"shard_linear_columns: a linear with a bias ({linear.in_features} -> "
            f"{linear.out_features}) would add it once per member to the partial sums"
        )
    shard_tensor(linear, "weight", dim=1, start=start, stop=stop)
    linear.in_features = stop - start


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols]^T) + b: each rank holds input columns [start, stop)
    of the single-device weight and the matching slice of x; the partial products are summed
    over `group` (the bias, kept whole, is added once after the sum).

    Parameter names are those of the nn.Linear it replaces (`weight`, `bias`).
    """

    def __init__(
        self,
        linear: nn.Linear,
        start: int,
        stop: int,
        group: Group,
        log: CommLog | None,
        name: str,
    ):
        super().__init__()
        self.in_features = stop - start
        self.out_features = linear.out_features
        self.weight = linear.weight
        shard_tensor(self, "weight", dim=1, start=start, stop=stop)
        self.bias = linear.bias  # whole, added after the reduction
        self.group = group
        self.log = log
        self.exchange = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_(F.linear(x, self.weight), self.group, self.log, self.exchange)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (shard), out_features={self.out_features}, "
            f"group={self.group.ranks}, bias={self.bias is not None}"
        )
