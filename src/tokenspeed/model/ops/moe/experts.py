"""Routed experts on the GPU: count + align (metadata), grouped gate/up GEMM with the GLU in its
epilogue, grouped down GEMM, weighted combine (+ the latent RMSNorm), all in Triton.

`fused_experts` has the contract of `reference.routed_experts` restricted to the experts a
layer owns (all of them by default; a slice for expert parallelism), optionally followed by
`ops.norm.rms_norm`. Static shapes and no host synchronisation, so it can be captured in a
CUDA graph; the intermediates are sized by `max_pairs`, a static bound on the local pairs.

Launches: [count] (skipped when the router already counted), align, [FP8 activation
quantisation], gate/up, down, combine. With FP8 on Hopper the down GEMM of the BLOCK_M 64
tiles is the Gluon kernel of gluon_fp8.py.

Math: the gate/up epilogue (the GLU's exp, tanh and divisions, and with FP8 the quantisation
of h) is IEEE-exact (libdevice, `div_rn`: the GLU as torch computes it on the same gate/up
values) unless `MoeKernelConfig.fast_math`, the default for FP8 experts only: their h is
quantised anyway, and the exact epilogue costs ~20% of the FP8 gate/up GEMM at 16384 tokens
and an exp-based fast one another ~15% (docs/perf/moe.md, bullet "Fast math for FP8"). The
activations' FP8 quantisation stays exact either way: one e4m3 code moved in x moves many
codes of h, which a reference quantisation no longer tracks.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import triton.language as tl

from ..interpret import interpreting
from ..tuning import boolean, instance_of, integer, tuning_or_default, warp_count
from . import grouped_gemm as gg
from ._launch import cdiv, next_power_of_2, num_sms
from .align import align_pairs, capacity_blocks, count_pairs
from .combine import CombineTuning, combine
from .fp8 import FP8_DTYPE, quantize_fp8_rows
from .fp8 import GROUP as FP8_GROUP
from .mxfp4 import GROUP as MX_GROUP

try:  # Gluon (Triton's explicit-layout dialect) ships with Triton >= 3.4
    from . import gluon_fp8
except (ImportError, AttributeError):  # pragma: no cover - a Triton without this Gluon API
    gluon_fp8 = None

_FORMATS = {"dense": gg.DENSE, "fp8": gg.FP8, "mxfp4": gg.MXFP4}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@attrs.frozen(kw_only=True)
class ExpertWeights:
    """Stacked weights of the E experts a layer runs (global ids first_expert .. +E-1).

    format "dense": w1 (gate), w3 (up): [E, I, L]; w2 (down): [E, L, I]; bf16/fp16/fp32.
    format "fp8": same shapes in float8_e4m3fn; s1, s3: fp32 [E, I/128, L/128]; s2: fp32
        [E, L/128, I/128] (one scale per 128 x 128 block); L, I multiples of 128.
    format "mxfp4": w1, w3: uint8 [E, I, L/2]; w2: uint8 [E, L, I/2] (packed E2M1); s1, s3:
        uint8 [E, I, L/32]; s2: uint8 [E, L, I/32] (E8M0), the checkpoint layout as stored.
    Rows (the last dim) contiguous; w1 and w3 (s1 and s3) with the same strides, so they may be
    views of one fused gate_up tensor. Checked here, never copied per call.
    """

    format: str = attrs.field(validator=attrs.validators.in_(tuple(_FORMATS)))
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    s3: torch.Tensor | None = None
    first_expert: int = 0

    def __attrs_post_init__(self) -> None:
        e, i = self.w1.shape[:2]
        width = self.w2.shape[1]
        packed = 2 if self.format == "mxfp4" else 1
        want = {
            "w1": (e, i, width // packed),
            "w3": (e, i, width // packed),
            "w2": (e, width, i // packed),
        }
        if self.format == "fp8":
            g = FP8_GROUP
            want |= {
                "s1": (e, i // g, width // g),
                "s3": (e, i // g, width // g),
                "s2": (e, width // g, i // g),
            }
            if width % g or i % g:
                raise ValueError(f"fp8 experts need L, I multiples of {g}, got {width}, {i}")
        elif self.format == "mxfp4":
            g = MX_GROUP
            want |= {"s1": (e, i, width // g), "s3": (e, i, width // g), "s2": (e, width, i // g)}
            if width % g or i % g:
                raise ValueError(f"mxfp4 experts need L, I multiples of {g}, got {width}, {i}")
        for name, shape in want.items():
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise ValueError(f"{self.format} experts: {name} must be {shape}, got {got}")
            # The kernels address rows through the tensor's own strides (so w1 / w3 may be the
            # two halves of a checkpoint's fused [E, 2I, L] gate_up tensor, views, no copies),
            # but each row must be contiguous.
            if t.stride(-1) != 1:
                raise ValueError(f"{self.format} experts: {name} must have contiguous rows")
        for a, b in (("w1", "w3"), ("s1", "s3")):
            ta, tb = getattr(self, a), getattr(self, b)
            if ta is not None and ta.stride() != tb.stride():
                # One stride pair serves both in the gate/up kernel.
                raise ValueError(
                    f"{self.format} experts: {a} and {b} must have the same strides, got "
                    f"{ta.stride()} and {tb.stride()}"
                )
        dtypes = {"dense": None, "fp8": FP8_DTYPE, "mxfp4": torch.uint8}
        if dtypes[self.format] is not None and self.w1.dtype != dtypes[self.format]:
            raise ValueError(f"{self.format} experts: weights must be {dtypes[self.format]}")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1]

    @property
    def width(self) -> int:
        return self.w2.shape[1]


@attrs.frozen
class GemmTile:
    """Tiles of one grouped GEMM: block_n output columns (of each of gate and up for the
    gate/up GEMM), block_k the K step, the kernel's warps and pipeline stages (for the Gluon
    FP8 down GEMM: its TMA ring's depth). Shrunk to small problems by `_fit`."""

    block_n: int = attrs.field(validator=integer(low=16, pow2=True))
    block_k: int = attrs.field(validator=integer(low=16, pow2=True))
    num_warps: int = attrs.field(validator=warp_count())
    num_stages: int = attrs.field(validator=integer())


@attrs.frozen(kw_only=True)
class MoeKernelConfig:
    """The tuning knobs of `fused_experts` (its gate/up, down and combine launches); the
    defaults are the measured ones (H200, `benchmarks/moe.py --sweep`, docs/perf/moe.md). None
    means "by shape": `resolve` fills the tiles from the table by weight format and expected
    rows per expert (`default_config`), and fast_math by format. The router (`gate.py`) has
    its own `RouterTuning`: it is another call, made before the experts' and with other shapes.

    block_m: rows per segment block, the segment alignment, shared by both GEMMs; gate_up,
    down: the two GEMMs' `GemmTile`s; waves: persistent programs per SM; gluon: FP8 on Hopper,
    the down GEMM in Gluon (gluon_fp8.py) where its tiles apply (block_m 64, bf16 out, latent
    width a multiple of 256), the Triton kernel otherwise; fast_math: PTX tanh.approx and
    approximate divisions in the gate/up epilogue instead of libdevice and IEEE-exact ones
    (None: for FP8 experts only, whose h is quantised anyway; this one changes the result);
    combine: the weighted combine's `CombineTuning`.
    """

    block_m: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    gate_up: GemmTile | None = attrs.field(default=None, validator=instance_of(GemmTile))
    down: GemmTile | None = attrs.field(default=None, validator=instance_of(GemmTile))
    waves: int | None = attrs.field(default=None, validator=integer())
    gluon: bool | None = attrs.field(default=None, validator=boolean())
    fast_math: bool | None = attrs.field(default=None, validator=boolean())
    combine: CombineTuning = attrs.field(
        factory=CombineTuning, validator=instance_of(CombineTuning)
    )

    def resolve(self, fmt: str, rows_per_expert: float) -> MoeKernelConfig:
        """These knobs with every by-shape default filled in for a weight format ("dense",
        "fp8", "mxfp4") and an expected number of rows per expert: what `fused_experts`
        launches with."""
        entry = _table_entry(fmt, rows_per_expert)
        return attrs.evolve(
            self,
            block_m=self.block_m or entry.block_m,
            gate_up=self.gate_up or entry.gate_up,
            down=self.down or entry.down,
            waves=self.waves or entry.waves,
            gluon=entry.gluon if self.gluon is None else self.gluon,
            fast_math=fmt == "fp8" if self.fast_math is None else self.fast_math,
        )


def _entry(block_m: int, gate_up: GemmTile, down: GemmTile, waves: int = 1, gluon=False):
    return MoeKernelConfig(block_m=block_m, gate_up=gate_up, down=down, waves=waves, gluon=gluon)


# Rows per expert -> tiles, by format (BLOCK_N counts the columns of each of gate and up).
# Decode (<= 16 rows) streams weights: BLOCK_M 16, long K steps, deep pipelines, two
# persistent programs per SM; beyond that two warpgroups per tile (8 warps) on wgmma, which
# keeps the gate and up accumulators out of local memory, and from ~100 rows BLOCK_M 128 for
# bf16. bf16 and FP8 are from `benchmarks/moe.py --sweep` on the H200 at 64, 256, 2048 and
# 16384 tokens (56 local experts; docs/perf/moe.md): 1.05-1.27x at decode, 1.2-1.5x at 2048
# and 1.67x (bf16) / 3.0x (FP8) at 16384 over the previous table.
_TABLE = {
    "dense": (
        (16, _entry(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4), waves=2)),
        (96, _entry(64, GemmTile(128, 64, 8, 3), GemmTile(256, 64, 8, 3))),
        (None, _entry(128, GemmTile(64, 64, 8, 4), GemmTile(256, 64, 8, 4))),
    ),
    "fp8": (
        (16, _entry(16, GemmTile(128, 128, 4, 3), GemmTile(128, 128, 4, 3), waves=2)),
        # BLOCK_M 64: the down GEMM in Gluon on Hopper (1.07x / 1.15x the Triton kernel at
        # 2048 / 16384 tokens, docs/perf/moe.md, bullet "FP8 in Gluon (down GEMM)").
        (96, _entry(64, GemmTile(128, 128, 8, 3), GemmTile(256, 128, 8, 3), gluon=True)),
        (None, _entry(64, GemmTile(128, 128, 8, 4), GemmTile(256, 128, 8, 4), gluon=True)),
    ),
    # MXFP4: two persistent programs per SM, so that one's in-register decode overlaps the
    # other's loads and MMAs: 1.36-1.51x one program at 64, 2048 and 16384 tokens (H200 sweep,
    # docs/perf/moe.md, bullet "MXFP4"); the tiles themselves were the best of the sweep.
    "mxfp4": (
        (16, _entry(16, GemmTile(64, 256, 4, 3), GemmTile(64, 256, 4, 3), waves=2)),
        (96, _entry(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3), waves=2)),
        (None, _entry(64, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3), waves=2)),
    ),
}


def _table_index(fmt: str, rows_per_expert: float) -> int:
    for index, (bound, _) in enumerate(_TABLE[fmt]):
        if bound is None or rows_per_expert <= bound:
            return index
    raise AssertionError("unreachable")


def _table_entry(fmt: str, rows_per_expert: float) -> MoeKernelConfig:
    return _TABLE[fmt][_table_index(fmt, rows_per_expert)][1]


# What `fused_experts` launches with, by (config, format, table entry): `resolve` depends on the
# rows per expert only through the table entry, and resolving (attrs.evolve, every field's
# validator) and fitting the tiles cost host time on each eager call otherwise.
_DEFAULT_CONFIG = MoeKernelConfig()  # a call with no config (built once: validators again)


@functools.lru_cache(maxsize=256)
def _resolve_entry(config: MoeKernelConfig, fmt: str, entry: int) -> MoeKernelConfig:
    bound = _TABLE[fmt][entry][0]  # rows per expert that select this entry (bounds ascend)
    return config.resolve(fmt, math.inf if bound is None else bound)


def _resolved(config: MoeKernelConfig, fmt: str, rows_per_expert: float) -> MoeKernelConfig:
    """`config.resolve(fmt, rows_per_expert)`, computed once per (config, format, entry)."""
    return _resolve_entry(config, fmt, _table_index(fmt, rows_per_expert))


def default_config(fmt: str, rows_per_expert: float) -> MoeKernelConfig:
    """The measured knobs for a format and an expected number of rows per expert: the tile
    table's entry, fast_math by format, the combine's defaults (`MoeKernelConfig().resolve`)."""
    return MoeKernelConfig().resolve(fmt, rows_per_expert)


@functools.lru_cache(maxsize=256)
def _fit(tile: GemmTile, n: int, k: int, fmt: str, fixed_n: int | None) -> GemmTile:
    """Shrink a tile to small problems (tests) within each format's constraints."""
    bn = fixed_n or min(tile.block_n, max(16, next_power_of_2(n)))
    if fmt == "fp8":
        bk = FP8_GROUP  # one activation scale and one weight scale per K step
    elif fmt == "mxfp4":
        bk = max(MX_GROUP, min(tile.block_k, next_power_of_2(k)))
    else:
        bk = min(tile.block_k, max(16, next_power_of_2(k)))
    return attrs.evolve(tile, block_n=bn, block_k=bk)


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    """A GPU's compute capability, looked up once per device."""
    return _device_capability(device.index if device.index is not None else 0)


def _gluon_down(x: torch.Tensor, experts: ExpertWeights, cfg: MoeKernelConfig, compute) -> bool:
    """Whether this call's FP8 down GEMM runs the Gluon kernel (sm_90 only)."""
    if not (cfg.gluon and gluon_fp8 is not None and experts.format == "fp8"):
        return False
    if not x.is_cuda or interpreting() or _capability(x.device)[0] != 9:
        return False
    return (
        compute == torch.bfloat16
        and experts.w2.is_contiguous()
        and gluon_fp8.applies(experts.width, experts.intermediate, cfg.block_m)
    )


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,
    *,
    activation: str = "silu",
    beta: float = 4.0,
    linear_beta: float | None = None,
    x_scale: torch.Tensor | None = None,
    max_pairs: int | None = None,
    pairs_hint: int | None = None,
    counts: torch.Tensor | None = None,
    ranks: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    config: MoeKernelConfig | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the local experts, [T, L].

    x: [T, L] activations (bf16/fp16/fp32), or FP8 e4m3 with x_scale [T, L/128] (FP8
    experts only; e.g. from an FP8 dispatch); weights: [T, k] fp32; ids: [T, k] global expert
    ids (-1 or any non-local id: ignored). activation: "silu" (silu(g) * u) or "situ"
    (beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta); linear_beta None: u).
    max_pairs: static bound on local pairs (default T*k); pairs_hint: expected local pairs,
    picks the tiles (default max_pairs). counts, ranks: from `route_fused` (skips a launch).
    norm_weight: fuse `rms_norm(out, norm_weight, norm_eps)` into the combine (only valid when
    this call sees all of a token's experts). config: the launch knobs and the epilogue's
    fast_math (`MoeKernelConfig`; None: the measured defaults, by format and pairs_hint).
    Returns out_dtype (default x's, bf16 for FP8 x).
    """
    if config is None:
        config = _DEFAULT_CONFIG
    config = tuning_or_default(config, MoeKernelConfig, "config")
    if activation not in ("silu", "situ"):
        raise ValueError(f"activation must be 'silu' or 'situ', got {activation!r}")
    tokens, top_k = ids.shape
    fmt, num_local = experts.format, experts.num_experts
    width, inter = experts.width, experts.intermediate
    if x.shape != (tokens, width) or weights.shape != (tokens, top_k):
        raise ValueError(
            f"x {tuple(x.shape)}, weights {tuple(weights.shape)} and ids "
            f"{tuple(ids.shape)} disagree with experts of width {width}"
        )
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    x_is_fp8 = x.dtype == FP8_DTYPE
    if x_is_fp8 and (fmt != "fp8" or x_scale is None):
        raise ValueError("FP8 activations need FP8 experts and x_scale")
    compute = out_dtype or (torch.bfloat16 if x_is_fp8 else x.dtype)
    if fmt != "fp8" and x.dtype != compute:
        raise ValueError(f"x is {x.dtype}; dense/mxfp4 experts compute in x's dtype")
    max_pairs = tokens * top_k if max_pairs is None else max_pairs
    if counts is None or ranks is None:
        counts, ranks = count_pairs(ids, experts.first_expert, num_local)
    cfg = _resolved(config, fmt, (pairs_hint or max_pairs) / num_local)
    layout = align_pairs(ids, ranks, counts, experts.first_expert, cfg.block_m, max_pairs)
    rows = layout.capacity_rows
    device = x.device

    xs = x_scale
    if fmt == "fp8" and not x_is_fp8:
        x, xs = quantize_fp8_rows(x)
    if fmt == "fp8":
        h = torch.empty(rows, inter, dtype=FP8_DTYPE, device=device)
        hs = torch.empty(rows, inter // FP8_GROUP, dtype=torch.float32, device=device)
    else:
        h = torch.empty(rows, inter, dtype=compute, device=device)
        hs = h  # unused
    y = torch.empty(rows, width, dtype=compute, device=device)
    wfmt = _FORMATS[fmt]
    interpret = interpreting()
    exact = x.is_cuda and not interpret and not cfg.fast_math
    programs = num_sms(x) * cfg.waves
    max_blocks = capacity_blocks(max_pairs, num_local, cfg.block_m)
    s1, s2, s3 = experts.s1, experts.s2, experts.s3
    dummy = torch.empty(1, dtype=torch.float32, device=device)  # pointers never read

    up = _fit(cfg.gate_up, inter, width, fmt, FP8_GROUP if fmt == "fp8" else None)
    grid = (max(1, min(programs, max_blocks * cdiv(inter, up.block_n))),)
    gg._gate_up_kernel[grid](
        x,
        xs if xs is not None else dummy,
        experts.w1,
        experts.w3,
        s1 if s1 is not None else dummy,
        s3 if s3 is not None else dummy,
        h,
        hs,
        layout.row_pair,
        layout.block_expert,
        layout.expert_start,
        layout.counts,
        layout.num_blocks,
        width,
        inter,
        top_k,
        x.stride(0),
        xs.stride(0) if xs is not None else 0,
        experts.w1.stride(0),
        experts.w1.stride(1),
        s1.stride(0) if s1 is not None else 0,
        s1.stride(1) if s1 is not None else 0,
        h.stride(0),
        hs.stride(0),
        float(beta),
        float(linear_beta or 1.0),
        WFMT=wfmt,
        ACT=gg.SITU if activation == "situ" else gg.SILU,
        CAP_UP=linear_beta is not None,
        OUT_FP8=fmt == "fp8",
        ROUND=_TL_DTYPES[compute],
        EXACT=exact,
        INTERPRET=interpret,
        BM=cfg.block_m,
        BN=up.block_n,
        BK=up.block_k,
        num_warps=up.num_warps,
        num_stages=up.num_stages,
    )
    if _gluon_down(x, experts, cfg, compute):
        gluon_fp8.down_fp8(
            h, hs, layout, experts.w2, s2, y, programs=programs, stages=cfg.down.num_stages
        )
        return combine(y, layout.pair_row, weights, compute, norm_weight, norm_eps, cfg.combine)
    down = _fit(cfg.down, width, inter, fmt, None)
    grid = (max(1, min(programs, max_blocks * cdiv(width, down.block_n))),)
    gg._down_kernel[grid](
        h,
        hs,
        experts.w2,
        s2 if s2 is not None else dummy,
        y,
        layout.block_expert,
        layout.expert_start,
        layout.counts,
        layout.num_blocks,
        width,
        inter,
        h.stride(0),
        hs.stride(0),
        experts.w2.stride(0),
        experts.w2.stride(1),
        s2.stride(0) if s2 is not None else 0,
        s2.stride(1) if s2 is not None else 0,
        y.stride(0),
        WFMT=wfmt,
        BM=cfg.block_m,
        BN=down.block_n,
        BK=down.block_k,
        num_warps=down.num_warps,
        num_stages=down.num_stages,
    )
    return combine(y, layout.pair_row, weights, compute, norm_weight, norm_eps, cfg.combine)
