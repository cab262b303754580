"""Random weights for models built from a config (tests, benchmarks, the `tiny` demo).

Scales keep activations O(1) through every layer so that tests compare meaningful numbers and a
random model's greedy output does not collapse onto one token.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from .kimi import KimiForCausalLM
from .layers.kda import KdaAttention
from .layers.moe import Router


@torch.no_grad()
def init_random_weights(model: KimiForCausalLM, seed: int = 0) -> KimiForCausalLM:
    """Fill every parameter and buffer of `model` in place from a seeded generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    def uniform(t: torch.Tensor, low: float, high: float) -> None:
        t.copy_(torch.rand(t.shape, generator=gen) * (high - low) + low)

    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            normal(param, 0.1, mean=1.0)
        elif param.dim() in (2, 3):  # linear [out, in] or stacked experts [E, out, in]
            normal(param, 1.0 / math.sqrt(param.shape[-1]))
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            normal(module.weight, 1.0)
        elif isinstance(module, KdaAttention):
            # Decay rates exp(A_log) in [1, 16] and dt = softplus(dt_bias) in [1e-3, 1e-1], as
            # Kimi models are initialised; conv taps O(1/sqrt(W)).
            uniform(module.A_log, 0.0, math.log(16.0))
            dt = torch.empty_like(module.dt_bias)
            uniform(dt, math.log(1e-3), math.log(1e-1))
            dt = dt.exp()
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            normal(module.conv_weight, 1.0 / math.sqrt(module.conv_weight.shape[-1]))
        elif isinstance(module, Router):
            normal(module.e_score_correction_bias, 0.05)
    return model


@torch.no_grad()
def fill_random_on_device(model: KimiForCausalLM, std: float = 0.02, seed: int = 0):
    """Fill `model` in place from a generator on its parameters' device: N(0, std) weights,
    norm weights 1, buffers 0. For models too large to draw on the host (built on the meta
    device, then `to_empty` on the GPU), in benchmarks that time kernels, not outputs: unlike
    `init_random_weights` nothing keeps activations O(1) through the layers."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0, std, generator=gen)
    for b in model.buffers():
        b.zero_()
    return model


def tensor_seed(seed: int, name: str) -> int:
    """The seed of tensor `name`'s own generator (`random_tensor`): the same on every process
    (unlike hash(), salted per process for strings)."""
    raw = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


@torch.no_grad()
def random_tensor(
    name: str,
    module: nn.Module,
    shape: tuple[int, ...],
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Tensor `name` (a qualified parameter or buffer name of a `KimiForCausalLM`; `module`:
    the module holding it, `shape`: its single-device shape) drawn from the distribution
    `init_random_weights` gives it, from a generator of its own seeded by (seed, name): the
    same values whatever else is drawn, so a rank that keeps a slice of a tensor (a parallel
    transform's shard) can draw the whole tensor on its device and keep that slice, and every
    rank draws the same replicated tensors. fp32 on `device`. (Not the values of
    `init_random_weights`, which draws every tensor from one sequence.) Raises ValueError for
    a tensor no rule covers."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std + mean

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=device) * (high - low) + low

    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding) and leaf == "weight":
        return normal(1.0)
    if isinstance(module, KdaAttention) and leaf == "A_log":
        return uniform(0.0, math.log(16.0))
    if isinstance(module, KdaAttention) and leaf == "dt_bias":
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if isinstance(module, Router) and leaf == "e_score_correction_bias":
        return normal(0.05)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return normal(0.1, mean=1.0)
    if len(shape) in (2, 3):  # linear [out, in], stacked experts [E, out, in], conv taps
        return normal(1.0 / math.sqrt(shape[-1]))
    raise ValueError(f"random_tensor: no rule draws {name} ({type(module).__name__}, {shape})")
