"""Linear projections held in FP8 e4m3 with block scales, as DeepSeek / Kimi FP8 releases store
them (`quantization_config: {"quant_method": "fp8", "weight_block_size": [B0, B1]}`).

`Fp8Linear` holds `weight` float8_e4m3fn [out, in] and `weight_scale_inv` fp32
[ceil(out / B0), ceil(in / B1)] (the checkpoint's names and layouts): the weight it stands for is
`weight.float() * weight_scale_inv` expanded over the B0 x B1 blocks (edge blocks cut to the
weight). Its forward:
- everywhere (the reference, and CPU): dequantise the weight block-wise in fp32, cast it to the
  activations' dtype, `F.linear` (so it computes exactly what an `nn.Linear` holding the
  dequantised weight computes);
- on CUDA (GPU code, marked below): activations quantised per token in 1 x 128 groups (as
  DeepSeek-V3 does, Triton `ops.moe.fp8.quantize_fp8_rows`), then `torch._scaled_mm` with
  the 128 x 128 weight blocks, where the shapes allow (128 x 128 blocks, in a multiple of 512
  and out of 128, bf16 / fp16 activations: `_cublas_shape`) and the torch build takes
  blockwise scales; the dequantising path otherwise.
`forward_quantized` takes activations already in FP8 (e4m3 + per-token or 1 x 128 group
scales, e.g. from the KDA output tail) without quantising them again: `_scaled_mm` on CUDA where
it applies, the dequantising reference otherwise.

Nothing here imports Triton at import time: the module loads on CPU-only machines.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("tokenspeed.model")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Scales of all-zero blocks: amax clamped here (as `ops.moe.fp8.quantize_fp8_blocks` does).
_MIN_AMAX = 1e-12


def scale_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out / B0), ceil(in / B1)]: one scale per weight block."""
    return (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/B0), ceil(K/B1)] -> one per weight entry [N, K] (edges cut)."""
    rows, cols = shape
    s = scale.float().repeat_interleave(block[0], dim=0)[:rows]
    return s.repeat_interleave(block[1], dim=1)[:, :cols]


def quantize_fp8_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scale_inv [ceil(N/B0), ceil(K/B1)]), one scale per
    block = its amax / 448 (so every block uses e4m3's full range), ragged edge blocks included.

    On shapes of whole 128 x 128 blocks this is `ops.moe.fp8.quantize_fp8_blocks` (the routed
    experts' helper, which takes multiples of 128 only and imports Triton); the test checks it.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a 2-D weight, got {tuple(weight.shape)}")
    b0, b1 = block
    n, k = weight.shape
    sn, sk = scale_shape(n, k, block)
    padded = weight.new_zeros(sn * b0, sk * b1, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.reshape(sn, b0, sk, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(sn * b0, sk * b1)[:n, :k].contiguous(), scale


def dequantize_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """e4m3 [N, K] with scale_inv [ceil(N/B0), ceil(K/B1)] -> fp32 [N, K]."""
    return weight.float() * _expand(scale_inv, tuple(weight.shape), block)


class Fp8Linear(nn.Module):
    """A bias-free linear layer over an FP8 e4m3 block-scaled weight (see the module doc).

    Buffers (the checkpoint's names): weight float8_e4m3fn [out, in], weight_scale_inv fp32
    [ceil(out / B0), ceil(in / B1)]. `Module.to(dtype)` / `.half()` move them between devices
    but keep their dtypes (a cast would upcast the weight and round its scales).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block_size: tuple[int, int] = (128, 128),
        device: torch.device | str | None = None,
    ):
        super().__init__()
        block_size = tuple(int(b) for b in block_size)
        if len(block_size) != 2 or min(block_size) <= 0:
            raise ValueError(f"block_size must be two positive ints, got {block_size}")
        self.in_features, self.out_features = in_features, out_features
        self.block_size = block_size
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device)
        )
        scales = scale_shape(out_features, in_features, block_size)
        self.register_buffer(
            "weight_scale_inv", torch.ones(scales, dtype=torch.float32, device=device)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: tuple[int, int] = (128, 128)):
        """`linear`'s weight rounded to FP8 blocks (for tests; checkpoints ship them)."""
        if linear.bias is not None:
            raise ValueError("Fp8Linear has no bias")
        out = cls(linear.in_features, linear.out_features, block_size, linear.weight.device)
        out.weight, out.weight_scale_inv = quantize_fp8_blockwise(
            linear.weight.detach(), block_size
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block_size={list(self.block_size)}, e4m3"
        )

    def _apply(self, fn, recurse=True):
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(device=moved.device)

        return super()._apply(keep_dtype, recurse)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for, [out, in] in `dtype` (computed in fp32, cast once)."""
        return dequantize_fp8_blockwise(self.weight, self.weight_scale_inv, self.block_size).to(
            dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _scaled_mm_applies(self, x):
            out = _scaled_mm_forward(self, x)
            if out is not None:
                return out
        return F.linear(x, self.dequantized_weight(x.dtype))

    def forward_quantized(
        self, x_fp8: torch.Tensor, x_scales: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """y = x W^T for activations already in FP8 (not quantised again): x_fp8 [..., in]
        float8_e4m3fn with fp32 x_scales [..., 1] (one scale per token, as the KDA output tail
        emits them) or [..., ceil(in / 128)] (1 x 128 groups, as `_scaled_mm` takes them), the
        activations being x_fp8 * scale over each group. Returns [..., out] in out_dtype.

        On CUDA where `_scaled_mm` applies (as `forward`: 128 x 128 weight blocks, in and out
        multiples of 128, bf16 / fp16 out) the FP8 operands go to the tensor cores as they are
        (a per-token scale is the 1 x 128 group scale of every group of its row); otherwise the
        dequantising reference: the activations and the weight dequantised in fp32, `F.linear`,
        cast to out_dtype."""
        if x_fp8.dtype != FP8_DTYPE or x_fp8.shape[-1] != self.in_features:
            raise ValueError(
                f"x_fp8 must be float8_e4m3fn [..., {self.in_features}], got {x_fp8.dtype} "
                f"{tuple(x_fp8.shape)}"
            )
        groups = math.ceil(self.in_features / 128)
        lead = x_fp8.shape[:-1]
        rows = x_fp8.reshape(-1, self.in_features)
        scales = x_scales.reshape(rows.shape[0], -1).float()
        if scales.shape[1] not in (1, groups):
            raise ValueError(
                f"x_scales must hold 1 or {groups} (1 x 128 groups) scales per token, got "
                f"{tuple(x_scales.shape)}"
            )
        if rows.is_cuda and _scaled_mm_applies_quantized(self, rows, out_dtype):
            out = _scaled_mm_quantized(self, rows, scales.expand(-1, groups), out_dtype)
            if out is not None:
                return out.reshape(*lead, self.out_features)
        if scales.shape[1] == 1:
            x = rows.float() * scales
        else:
            x = rows.float() * scales.repeat_interleave(128, dim=1)[:, : self.in_features]
        y = F.linear(x, self.dequantized_weight(torch.float32))
        return y.to(out_dtype).reshape(*lead, self.out_features)


def to_fp8_linear(linear: nn.Module, block_size: tuple[int, int]) -> Fp8Linear:
    """An (empty) `Fp8Linear` of `linear`'s shape, on its device (meta before a load)."""
    device = linear.weight.device
    return Fp8Linear(linear.in_features, linear.out_features, block_size, device)


def use_fp8_linears(model: nn.Module, modules: dict[str, tuple[int, int]]) -> nn.Module:
    """Replace the `nn.Linear` submodules named in `modules` (qualified name -> block size) by
    empty `Fp8Linear`s on their devices (e.g. "meta" before a checkpoint is assigned)."""
    for name, block in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise ValueError(f"{name}: not a bias-free nn.Linear, cannot hold an FP8 weight")
        setattr(parent, child, to_fp8_linear(linear, block))
    return model


def dequantize_fp8_linears(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every `Fp8Linear` of `model` by an `nn.Linear` holding its dequantised weight (in
    `dtype`, default the model's embedding dtype), in place; returns the model. The reference
    an FP8 model is compared with: on CPU both compute the very same products."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        want = dtype or _model_dtype(model)
        linear = nn.Linear(
            module.in_features, module.out_features, bias=False, device=module.weight.device
        )
        linear.weight = nn.Parameter(module.dequantized_weight(want), requires_grad=False)
        setattr(parent, child, linear)
    return model


def _model_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.dtype.is_floating_point and tensor.dtype.itemsize > 1:
            return tensor.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------
# GPU (CUDA) path. Not run on CPU machines; checked on the GPU (see the GPU issue).
# torch._scaled_mm with blockwise scales: A = activations [M, K] e4m3 with 1 x 128 group scales
# [M, K/128] (outer-dim-major), B = weight.t() [K, N] e4m3 with 128 x 128 block scales
# [K/128, N/128]; bf16 / fp16 out. Builds of torch (or cuBLAS) without blockwise scaling raise:
# the first failure turns the path off for the process (logged once) and the dequantising path
# serves instead.
# ---------------------------------------------------------------------------------------------

_SCALED_MM_BLOCK = (128, 128)
_SCALED_MM_ROWS = 16  # activation rows padded to a multiple of this (see _scaled_mm_quantized)
_scaled_mm_broken: str | None = None


def _cublas_shape(linear: Fp8Linear) -> bool:
    """Weights `_scaled_mm` computes correctly: 128 x 128 blocks, out a multiple of 128 and in
    a multiple of 512. The weight scales reach cuBLAS as [K/128, N/128] with a leading
    dimension of K/128 floats: on an H100 (torch 2.11, CUDA 13) K = 384 (3 scales, 12 bytes)
    gave results off by ~1e9 without any error, K = 1024 the right ones. The in_features of
    Kimi's projections (7168, 4096, 1536, 512) are multiples of 512."""
    return (
        linear.block_size == _SCALED_MM_BLOCK
        and linear.in_features % 512 == 0
        and linear.out_features % 128 == 0
    )


def _scaled_mm_applies(linear: Fp8Linear, x: torch.Tensor) -> bool:
    return (
        _scaled_mm_broken is None
        and _cublas_shape(linear)
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[-1] == linear.in_features
        and x.numel() > 0
    )


def _scaled_mm_forward(linear: Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
    """GPU: y = x W^T through FP8 tensor cores; None when this torch build refuses it."""
    from ..ops.moe.fp8 import quantize_fp8_rows  # Triton: GPU only

    rows = x.reshape(-1, linear.in_features)
    q, s = quantize_fp8_rows(rows.contiguous())
    y = _scaled_mm_quantized(linear, q, s, x.dtype)
    return None if y is None else y.reshape(*x.shape[:-1], linear.out_features)


def _scaled_mm_applies_quantized(linear: Fp8Linear, rows: torch.Tensor, out_dtype) -> bool:
    return (
        _scaled_mm_broken is None
        and _cublas_shape(linear)
        and out_dtype in (torch.bfloat16, torch.float16)
        and rows.numel() > 0
    )


def _scaled_mm_quantized(
    linear: Fp8Linear, q: torch.Tensor, group_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """GPU: `_scaled_mm` over pre-quantised activations q [M, K] e4m3 with group scales
    [M, K/128]; None when this torch build refuses it (the path is then off, as in forward)."""
    global _scaled_mm_broken
    m = q.shape[0]
    pad = -m % _SCALED_MM_ROWS
    q = q.contiguous()
    if pad:
        # The M-major scales' leading dimension is M: cuBLAS wants it 16-byte aligned (and
        # refuses M = 1 with CUBLAS_STATUS_NOT_SUPPORTED), so short batches are padded with
        # zero rows of scale 1, cut off below.
        # As bytes (0 is e4m3's zero): cat has no float8 kernels on every build.
        zeros = torch.zeros(pad, q.shape[1], dtype=torch.uint8, device=q.device)
        q = torch.cat([q.view(torch.uint8), zeros]).view(q.dtype)
        group_scales = torch.cat([group_scales, group_scales.new_ones(pad, group_scales.shape[1])])
    scale_a = group_scales.t().contiguous().t()  # [M, K/128], M-major
    scale_b = linear.weight_scale_inv.t()  # [K/128, N/128] for B = weight.t() [K, N]
    try:
        y = torch._scaled_mm(
            q, linear.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
        )
        return y[:m] if pad else y
    except (RuntimeError, NotImplementedError) as err:
        _scaled_mm_broken = str(err)
        logger.warning(
            "FP8 linear: torch._scaled_mm with block scales failed (%s); using the "
            "dequantising path from now on",
            err,
        )
        return None
