"""Which slice of a checkpoint tensor a rank's parameter holds, for per-rank loading.

A transform that keeps part of a parameter (a block of an expert stack, a column shard of a
projection) marks it: `mark_shard(module, "weight", dim=0, start=a, stop=b)` says that
`module.weight` holds rows [a, b) of the single-device tensor of the same qualified name. The
marks live on the module itself (no registry): `rank_slices(model)` collects them by qualified
parameter name, which is what a per-rank loader reads from the checkpoint. A transform that
gives the model a per-rank configuration first records the one it was built from
(`mark_source_config`), which the checkpoint must match.
"""

from __future__ import annotations

import attrs
from torch import nn

from .dims import ParallelError

_ATTR = "_tokenspeed_shards"
_SOURCE = "_tokenspeed_source_config"


@attrs.frozen
class Shard:
    """Rows (or columns, ...) [start, stop) along `dim` of the single-device tensor; with
    `blocks` > 1, the tensor is `blocks` equal blocks stacked along `dim` (the q|k|v conv taps)
    and the shard holds [start, stop) of each, in block order."""

    dim: int
    start: int
    stop: int
    blocks: int = 1


def mark_shard(
    module: nn.Module, name: str, *, dim: int, start: int, stop: int, blocks: int = 1
) -> None:
    """Record that `module.<name>` holds [start, stop) along `dim` of its full tensor (of each
    of its `blocks` blocks). A tensor is sliced once: marking a name already marked raises
    `ParallelError` (a second transform re-slicing a shard would load the wrong slice)."""
    if not 0 <= start < stop or blocks < 1:
        raise ValueError(
            f"a shard needs 0 <= start < stop and blocks >= 1, got [{start}, {stop}), {blocks}"
        )
    shards = module.__dict__.setdefault(_ATTR, {})
    if name in shards:
        raise ParallelError(
            f"{type(module).__name__}.{name} is already a shard ({shards[name]}): two transforms "
            "slice the same tensor"
        )
    shards[name] = Shard(dim, start, stop, blocks)


def shard_of(module: nn.Module, name: str) -> Shard | None:
    return module.__dict__.get(_ATTR, {}).get(name)


def rank_slices(model: nn.Module) -> dict[str, Shard]:
    """Qualified parameter / buffer name -> the slice this rank holds (only sharded ones)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, shard in module.__dict__.get(_ATTR, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out


def mark_source_config(model: nn.Module, config) -> None:
    """Record the configuration `model` was built from (its checkpoint's), before a transform
    gives the model a per-rank one (fewer local heads, ...); the first mark wins."""
    model.__dict__.setdefault(_SOURCE, config)


def source_config(model: nn.Module):
    """The configuration the model was built from: the marked one, else `model.config`."""
    return model.__dict__.get(_SOURCE, getattr(model, "config", None))
