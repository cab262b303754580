"""Which slice of a checkpoint tensor a rank's parameter holds, for per-rank loading.

A transform that keeps part of a parameter (a block of an expert stack, a column shard of a
projection) marks it: `mark_shard(module, "weight", dim=0, start=a, stop=b)` says that
`module.weight` holds rows [a, b) of the single-device tensor of the same qualified name. The
marks live on the module itself (no registry): `rank_slices(model)` collects them by qualified
parameter name, which is what a per-rank loader reads from the checkpoint.
"""

from __future__ import annotations

import attrs
from torch import nn

_ATTR = "_tokenspeed_shards"


@attrs.frozen
class Shard:
    """Rows (or columns, ...) [start, stop) along `dim` of the single-device tensor."""

    dim: int
    start: int
    stop: int


def mark_shard(module: nn.Module, name: str, *, dim: int, start: int, stop: int) -> None:
    """Record that `module.<name>` holds [start, stop) along `dim` of its full tensor."""
    if not 0 <= start < stop:
        raise ValueError(f"a shard needs 0 <= start < stop, got [{start}, {stop})")
    shards = module.__dict__.setdefault(_ATTR, {})
    shards[name] = Shard(dim, start, stop)


def shard_of(module: nn.Module, name: str) -> Shard | None:
    return module.__dict__.get(_ATTR, {}).get(name)


def rank_slices(model: nn.Module) -> dict[str, Shard]:
    """Qualified parameter / buffer name -> the slice this rank holds (only sharded ones)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, shard in module.__dict__.get(_ATTR, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out
