"""Per-rank random weights: the per-rank loading recipe with a seeded draw instead of a
checkpoint, for presets too large to draw whole on one host (Kimi-Linear-48B shapes: 192 GB in
fp32, per worker).

    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("kimi-linear-48b-a3b"))
    parallelize(model, groups)                       # apply_dep / apply_tp / ...: shards marked
    init_rank_random_weights(model, seed=0, dtype=torch.bfloat16, device="cuda:0")

Every tensor comes from a generator of its own, seeded by the seed and its single-device name
(`tokenspeed.model.init.random_tensor`): a rank draws the whole tensor on its device, keeps its
slice (the transform's `mark_shard`) and frees the rest, one tensor at a time. So the ranks of
any layout hold slices of one and the same single-device model (DEP and TEP over the same
weights, the same routing), replicated tensors are identical on every rank, and no process ever
holds more than its share plus one whole tensor. The values are not `init_random_weights'`
(which draws every tensor from one sequence): the same distributions, other numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..model.init import random_tensor
from ..model.kimi import KimiForCausalLM
from .shards import Shard, rank_slices, source_config


def _slice(full: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's part of the single-device tensor `full` (its blocks' slices, in order)."""
    if shard is None:
        return full
    dim, start, size = shard.dim, shard.start, shard.stop - shard.start
    if shard.blocks == 1:
        return full.narrow(dim, start, size)
    block = full.shape[dim] // shard.blocks
    parts = [full.narrow(dim, b * block + start, size) for b in range(shard.blocks)]
    return torch.cat(parts, dim)


@torch.no_grad()
def init_rank_random_weights(
    model: nn.Module,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    keep_fp32: Callable[[str], bool] = lambda name: False,
) -> nn.Module:
    """Give `model` (a `KimiForCausalLM` built on the meta device, transformed for this rank)
    its share of the seeded random single-device model, on `device`, in `dtype` (the tensors
    `keep_fp32(name)` names in fp32). Tied tensors stay tied. Returns the model.

    Raises ValueError when a tensor's shape is not its slice of the single-device shape (a
    transform that changed a shape without marking its shard)."""
    device = torch.device(device)
    config = source_config(model)
    with torch.device("meta"):
        full = KimiForCausalLM(config)
    shards = rank_slices(model)
    # id of a meta tensor -> (the meta tensor, kept alive so that ids stay unique; its value)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            tensors = getattr(module, kind)
            for leaf, old in list(tensors.items()):
                if old is None:
                    continue
                if id(old) not in made:  # else a tied tensor, drawn under its first name
                    name = f"{prefix}.{leaf}" if prefix else leaf
                    value = _draw(name, old, full, shards.get(name), seed, device)
                    if old.is_floating_point():
                        value = value.to(torch.float32 if keep_fp32(name) else dtype)
                    if isinstance(old, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=old.requires_grad)
                    made[id(old)] = (old, value)
                tensors[leaf] = made[id(old)][1]
    return model


def _draw(
    name: str, local: torch.Tensor, full: nn.Module, shard: Shard | None, seed: int, device
) -> torch.Tensor:
    prefix, _, leaf = name.rpartition(".")
    owner = full.get_submodule(prefix) if prefix else full
    whole = getattr(owner, leaf)
    drawn = random_tensor(name, owner, tuple(whole.shape), seed=seed, device=device)
    part = _slice(drawn, shard)
    if tuple(part.shape) != tuple(local.shape):
        raise ValueError(
            f"init_rank_random_weights: {name} is {tuple(local.shape)} on this rank, but its "
            f"slice {shard} of the single-device {tuple(whole.shape)} is {tuple(part.shape)}"
        )
    return part.clone() if shard is not None else part
