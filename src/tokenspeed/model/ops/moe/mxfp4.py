"""MXFP4 (OCP microscaling FP4) as K3 checkpoints store routed experts.

Layout (compressed-tensors `mxfp4-pack-quantized`, group size 32), for a weight [out, in]:
- `weight_packed`: uint8 [out, in/2]; byte b holds input columns 2b (low nibble) and 2b+1
  (high nibble), each an E2M1 code: bit 3 sign, bits 0-2 index into (0, .5, 1, 1.5, 2, 3, 4, 6).
- `weight_scale`: uint8 [out, in/32]; E8M0 exponent per 32 consecutive input columns,
  multiplier 2^(scale - 127); 255 is NaN; 0 is 2^-127 (subnormal in fp32 / bf16).

value = e2m1(code) * 2^(scale - 127). Every such value is exact in bf16, fp16 (within its
range) and fp32, so dequantisation is exact; only the GEMM's accumulation rounds.

Loader interface (kept packed, never upcast): `load_experts_mxfp4` stacks the per-expert
checkpoint tensors of one projection into [E, out, in/2] and [E, out, in/32] uint8 tensors,
which `grouped.ExpertWeights.mxfp4` takes as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import triton
import triton.language as tl

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FORMAT_NAME = "mxfp4-pack-quantized"


# ---------------------------------------------------------------- torch reference and packing


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2^(s - 127) (exact; 255 -> NaN)."""
    exponent = scale.to(torch.int32) - 127
    value = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(scale == 255, torch.full_like(value, float("nan")), value)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> E2M1 codes uint8 [..., K] (low nibble first)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., K] (K even) -> uint8 [..., K/2] (even column in the low nibble)."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def decode_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference decode. packed: uint8 [..., K/2]; scale: uint8 [..., K/32] -> [..., K]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = unpack_e2m1(packed).long()
    values = table[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    k = values.shape[-1]
    if scale.shape[-1] * GROUP != k:
        raise ValueError(f"scale {tuple(scale.shape)} does not cover {k} columns in groups of 32")
    groups = values.reshape(*values.shape[:-1], k // GROUP, GROUP)
    return (groups * decode_e8m0(scale).unsqueeze(-1)).reshape(values.shape).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round w [..., K] (K % 32 == 0) to MXFP4 -> (packed uint8 [..., K/2], scale [..., K/32]).

    OCP rule: shared exponent floor(log2(amax)) - 2 (6 = 1.5 * 2^2 is the largest E2M1
    value), elements rounded to the nearest E2M1 value (ties to the smaller magnitude) and
    saturated at +-6. For tests and benchmarks; checkpoints ship packed tensors.
    """
    k = w.shape[-1]
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {GROUP}, got {k}")
    groups = w.float().reshape(*w.shape[:-1], k // GROUP, GROUP)
    amax = groups.abs().amax(-1)
    exponent = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, torch.zeros_like(amax)
    ).clamp(-127, 127)
    scale = (exponent + 127).to(torch.uint8)
    scaled = groups / decode_e8m0(scale).unsqueeze(-1)
    # Midpoints between neighbouring magnitudes; a tie lands in the lower bucket.
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)
    magnitude = torch.bucketize(scaled.abs(), bounds, out_int32=True)
    codes = magnitude + 8 * (scaled < 0).to(torch.int32)
    return pack_e2m1(codes.reshape(w.shape)), scale


# ---------------------------------------------------------------- Triton decode


@triton.jit
def e8m0_to_float(scale):
    """uint8 E8M0 -> fp32 2^(s - 127), built in the exponent bits (s = 0 -> 2^-127, 255 -> NaN)."""
    s = scale.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_dequant_pair(packed, scale):
    """packed: uint8 tile; scale: fp32 tile of the same shape (its group's multiplier).
    Returns (even-column values, odd-column values), fp32, exact.

    An E2M1 nibble s|e1 e0|m moved into an fp32 with e1 e0 as the two lowest exponent bits, m
    as the top mantissa bit and s as the sign is the E2M1 value times 2^-126, for every code:
    exponent 0 reads as an fp32 subnormal (0 or 2^-127 = 0.5 x 2^-126), as E2M1's does. So
    decoding is a few integer operations and a product, with no int-to-float conversion
    (those issue at a fraction of the FMA rate; with the conversion-based decode the MXFP4
    experts were 2.2-3.0x slower on the H200, docs/perf/moe.md)."""
    p = packed.to(tl.int32)
    lo = ((p & 7) << 22) | ((p & 8) << 28)
    hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
    lo = lo.to(tl.float32, bitcast=True) * 2.0**126
    hi = hi.to(tl.float32, bitcast=True) * 2.0**126
    return lo * scale, hi * scale


@triton.jit
def _dequant_kernel(
    p_ptr,
    s_ptr,
    out_ptr,
    rows,
    half_k,
    stride_p,
    stride_s,
    stride_o,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    """packed [R, K/2] + scale [R, K/32] -> out [R, K]; BH packed columns per program."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = (r < rows)[:, None] & (h < half_k)[None, :]
    r64 = r[:, None].to(tl.int64)
    packed = tl.load(p_ptr + r64 * stride_p + h[None, :], mask=mask, other=0)
    code = tl.load(s_ptr + r64 * stride_s + (h // 16)[None, :], mask=mask, other=127)
    lo, hi = mxfp4_dequant_pair(packed, e8m0_to_float(code))
    out = out_ptr + r64 * stride_o + 2 * h[None, :]
    tl.store(out, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Triton decode, same values as `decode_mxfp4`. packed [..., K/2], scale [..., K/32]."""
    half_k = packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != 2 * half_k:
        raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} differ")
    p2 = packed.reshape(-1, half_k).contiguous()
    s2 = scale.reshape(-1, scale.shape[-1]).contiguous()
    out = torch.empty(p2.shape[0], 2 * half_k, dtype=dtype, device=packed.device)
    br, bh = 16, min(128, triton.next_power_of_2(half_k))
    if p2.shape[0]:
        grid = (triton.cdiv(p2.shape[0], br), triton.cdiv(half_k, bh))
        _dequant_kernel[grid](
            p2,
            s2,
            out,
            p2.shape[0],
            half_k,
            p2.stride(0),
            s2.stride(0),
            out.stride(0),
            BR=br,
            BH=bh,
            num_warps=4,
        )
    return out.reshape(*packed.shape[:-1], 2 * half_k)


# ---------------------------------------------------------------- loader-facing helpers


def is_mxfp4_config(quant_config: Mapping | None) -> bool:
    """True for a compressed-tensors config that stores weights as packed MXFP4 (format at
    the top level or under config_groups.<group>.format, as K3 does)."""
    if not quant_config:
        return False
    if quant_config.get("format") == FORMAT_NAME:
        return True
    groups = quant_config.get("config_groups") or {}
    return any(isinstance(g, Mapping) and g.get("format") == FORMAT_NAME for g in groups.values())


def checkpoint_names(prefix: str) -> tuple[str, str]:
    """(packed, scale) names of one quantised linear, e.g. prefix
    `model.layers.3.block_sparse_moe.experts.7.w1`."""
    return f"{prefix}.weight_packed", f"{prefix}.weight_scale"


def load_experts_mxfp4(
    get_tensor: Callable[[str], torch.Tensor],
    expert_prefix: str,
    experts: Iterable[int],
    proj: str,
    out_features: int,
    in_features: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack one projection of several experts, still packed.

    get_tensor(name) returns a checkpoint tensor (e.g. a safetensors handle's get_tensor);
    expert_prefix: `...block_sparse_moe.experts`; experts: the global ids this rank owns, in
    local order; proj: "w1" | "w2" | "w3". Returns (packed uint8 [E, out, in/2], scale uint8
    [E, out, in/32]) on `device`. Raises ValueError naming the tensor on a shape or dtype
    mismatch.
    """
    if in_features % GROUP:
        raise ValueError(f"in_features {in_features} is not a multiple of {GROUP}")
    experts = list(experts)
    packed = torch.empty(
        len(experts), out_features, in_features // 2, dtype=torch.uint8, device=device
    )
    scale = torch.empty(
        len(experts), out_features, in_features // GROUP, dtype=torch.uint8, device=device
    )
    for local, expert in enumerate(experts):
        for name, dst in zip(
            checkpoint_names(f"{expert_prefix}.{expert}.{proj}"), (packed, scale), strict=True
        ):
            src = get_tensor(name)
            if src.dtype != torch.uint8 or tuple(src.shape) != tuple(dst.shape[1:]):
                raise ValueError(
                    f"{name}: expected uint8 {tuple(dst.shape[1:])}, got {src.dtype} "
                    f"{tuple(src.shape)}"
                )
            dst[local].copy_(src)
    return packed, scale
