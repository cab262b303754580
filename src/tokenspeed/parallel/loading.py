"""Per-rank loading: a rank reads only its share of a checkpoint.

The recipe (each step only slices or builds tensors, nothing is computed on weights):

    with torch.device("meta"):
        model = KimiForCausalLM(from_hf_config(path))   # + use_mxfp4_experts for MXFP4
    apply_dep(model, groups)                            # and/or apply_tp_subgroup, ...
    stats = load_rank_checkpoint(path, model)           # this rank's slices, from the files

The transforms mark every tensor they slice (`shards.mark_shard`); `rank_slices` collects the
marks and the model's loader (`model.partial_loader.load_checkpoint_into`) reads those slices:
a rank of DEP over R ranks reads E/R experts of each MoE layer, a TP-subgroup rank its rows of
each selected projection. The model knows nothing of ranks: it is given (dim, start, stop)
slices by parameter name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..model.partial_loader import MAX_GAP_BYTES, ReadStats, load_checkpoint_into
from .shards import rank_slices, source_config


def slices_of(model: nn.Module) -> Mapping[str, tuple[int, ...]]:
    """The model's shard marks as the loader takes them: name -> (dim, start, stop), or
    (dim, start, stop, blocks) for a shard of each of several stacked blocks."""
    return {
        name: (s.dim, s.start, s.stop) if s.blocks == 1 else (s.dim, s.start, s.stop, s.blocks)
        for name, s in rank_slices(model).items()
    }


def load_rank_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    strict: bool = True,
    max_gap_bytes: int = MAX_GAP_BYTES,
) -> ReadStats:
    """Load this rank's share of the checkpoint at `path` into `model`, in place.

    Preconditions: `model` is a `KimiForCausalLM` built from the checkpoint's config (on the
    meta device, typically), with its experts in the checkpoint's format, and already
    transformed for this rank (every sliced tensor marked with `mark_shard` under its
    single-device name). Unsliced tensors are read whole. dtype / device / strict: as for
    `model.loader.load_checkpoint`; max_gap_bytes: as for `load_checkpoint_into` (a slice
    along a later dim reads through holes up to that size). Returns what was read
    (`ReadStats.bytes_read`: tensor bytes in the checkpoint's dtypes, this rank's share plus
    the holes read through, exactly the share with `max_gap_bytes=0`; headers apart).
    """
    return load_checkpoint_into(
        model,
        path,
        slices=slices_of(model),
        dtype=dtype,
        device=device,
        strict=strict,
        config=source_config(model),
        max_gap_bytes=max_gap_bytes,
    )
