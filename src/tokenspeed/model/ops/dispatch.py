"""The one place that picks an implementation for each op the layers call.

The torch references run everywhere; on CUDA the Triton kernels (and fla-core's chunked KDA for
prefill, when installed) take over. A kernel is used only when its package imports, so a CPU
install without Triton, or a GPU without fla, still runs (on the references).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from .interpret import interpreting
from .moe import routed_experts as _routed_loop
from .moe import routed_experts_dense as _routed_dense
from .moe import routed_experts_grouped as _routed_grouped


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def triton_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton fast paths apply to tensors like x: CUDA tensors with Triton
    installed, or any tensor under Triton's interpreter (`interpret.interpreting`; how CPU
    tests run the whole model through the kernels)."""
    return (x.is_cuda or interpreting()) and _has("triton")


def fla_prefill(x: torch.Tensor) -> bool:
    """Whether fla-core's chunked KDA runs the prefill of tensors like x: half-precision models
    on CUDA with fla installed (fla's chunked kernels do not run under the interpreter). fp32
    models keep the reference (fla's tensor-core dots round fp32 inputs to TF32)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _has("fla")


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Routed experts. On CUDA the paths are graph-safe: grouped GEMMs in half precision, every
    expert on every token in fp32 (small test models); elsewhere the per-expert loop."""
    if x.is_cuda:
        if x.dtype in (torch.bfloat16, torch.float16):
            return _routed_grouped(x, weights, ids, w1, w2, w3, glu)
        return _routed_dense(x, weights, ids, w1, w2, w3, glu)
    return _routed_loop(x, weights, ids, w1, w2, w3, glu)


def kda_decode(*args, **kwargs) -> torch.Tensor:
    """The fused Triton KDA decode/verify step (see `ops.kda.decode.kda_decode`)."""
    from .kda.decode import kda_decode as kernel

    return kernel(*args, **kwargs)


def kda_conv_prefill(*args, **kwargs) -> torch.Tensor:
    """fla-core's varlen short conv over the conv-state pool (`ops.kda.prefill`)."""
    from .kda.prefill import kda_conv_prefill as kernel

    return kernel(*args, **kwargs)


def kda_prefill(*args, **kwargs) -> torch.Tensor:
    """fla-core's chunked KDA over the slot pool (see `ops.kda.prefill.kda_prefill`)."""
    from .kda.prefill import kda_prefill as kernel

    return kernel(*args, **kwargs)


def kda_output_tail(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """Per-head gated RMSNorm of KDA's output: the Triton tail on CUDA, the reference else.
    o, gate: [T, H, V] -> [T, H * V]."""
    if triton_kernels(o):
        from .kda.tail import kda_output_tail as kernel

        return kernel(o, gate, weight, eps)
    from .norm import gated_rms_norm

    return gated_rms_norm(o, gate, weight, eps).flatten(1)


def kda_output_tail_fp8(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton tail's FP8 form, for an FP8 o_proj (`Fp8Linear.forward_quantized`): (q
    [T, H * V] float8_e4m3fn, scales [T, 1] fp32, one per token) where the Triton tail runs
    (CUDA, or the interpreter); None elsewhere (the caller keeps the reference tail)."""
    if not triton_kernels(o):
        return None
    from .kda.tail import kda_output_tail as kernel

    return kernel(o, gate, weight, eps, fp8=True)


def half_kernels(x: torch.Tensor) -> bool:
    """Triton fast paths that use tensor-core dots: half-precision tensors on CUDA only (fp32
    would run them in TF32; fp32 models keep the exact references)."""
    return triton_kernels(x) and x.dtype in (torch.bfloat16, torch.float16)


def _tile_dims(*dims: int) -> bool:
    """Widths the MLA kernels tile with tensor-core dots: powers of two, at least 16."""
    return all(d >= 16 and d & (d - 1) == 0 for d in dims)


def mla_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None,
    plan=None,
    page_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed paged MLA decode of n queries per request, times sigmoid(gate) when given.
    q: [B*n, H, Dn+Dr] -> [B*n, H, Dv]. On CUDA in half precision: the split-KV kernel (Gluon on
    Hopper, else Triton) with the runner's split plan (or uniform splits without one); else the
    reference. page_scales: [NP, P] fp32 row scales of float8_e4m3fn pages (the reference
    dequantises the rows to q's dtype)."""
    nope = w_uk.shape[1]
    if half_kernels(q) and _tile_dims(w_uk.shape[2], q.shape[-1] - nope, w_uv.shape[1], nope):
        from .mla.decode import decode_parallelism, mla_decode_paged_split, uniform_split_count

        if plan is None:
            sms = (
                torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
            )
            budget = decode_parallelism(sms, q.shape[1], q.shape[0] // page_table.shape[0])
            return mla_decode_paged_split(
                q,
                pages,
                page_table,
                context_lens,
                w_uk,
                w_uv,
                scale,
                gate=gate,
                uniform_splits=uniform_split_count(page_table.shape[0], budget),
                page_scales=page_scales,
            )
        return mla_decode_paged_split(
            q,
            pages,
            page_table,
            context_lens,
            w_uk,
            w_uv,
            scale,
            plan,
            gate=gate,
            page_scales=page_scales,
        )
    from .mla import dequantize_rows, mla_decode_paged

    if page_scales is not None:
        pages = dequantize_rows(pages, page_scales, q.dtype)
    o = mla_decode_paged(q, pages, page_table, context_lens, w_uk, w_uv, scale)
    if gate is not None:
        o = o * torch.sigmoid(gate.view(o.shape).float()).to(o.dtype)
    return o


def mla_prefill_paged(
    q,
    pages,
    page_table,
    cu_seqlens_q,
    context_lens,
    kv_b_weight,
    v_head_dim,
    scale,
    page_scales=None,
) -> torch.Tensor | None:
    """Prefill / extend over paged rows with the Triton kernel, or None where it does not
    apply (the caller then gathers the rows and runs the reference). page_scales: [NP, P] fp32
    row scales of float8_e4m3fn pages."""
    nope = kv_b_weight.shape[0] // q.shape[1] - v_head_dim
    if not (half_kernels(q) and _tile_dims(nope, q.shape[-1] - nope, v_head_dim)):
        return None
    from .mla.prefill import mla_prefill_paged as kernel

    if page_scales is not None:
        return kernel(
            q,
            pages,
            page_table,
            cu_seqlens_q,
            context_lens,
            kv_b_weight,
            v_head_dim,
            scale,
            page_scales=page_scales,
        )
    return kernel(q, pages, page_table, cu_seqlens_q, context_lens, kv_b_weight, v_head_dim, scale)


def attn_res_mix_norm(
    bank, query, mix_weight, mix_eps, norm_weight, norm_eps, *, delta=None, accumulate=True
):
    """Fused AttnRes mix + RMSNorm with the partial-entry update (see ops.attn_res.fused)."""
    from .attn_res.fused import attn_res_mix_norm as kernel

    return kernel(
        bank, query, mix_weight, mix_eps, norm_weight, norm_eps, delta=delta, accumulate=accumulate
    )


def fused_moe(x: torch.Tensor) -> bool:
    """Whether the Triton router + grouped-expert kernels run the MoE for tensors like x."""
    return half_kernels(x)


def route_fused(*args, **kwargs):
    from .moe.gate import route_fused as kernel

    return kernel(*args, **kwargs)


def fused_experts(*args, **kwargs):
    from .moe.experts import fused_experts as kernel

    return kernel(*args, **kwargs)
