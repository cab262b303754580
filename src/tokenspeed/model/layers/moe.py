"""Mixture of experts with a sigmoid router, optionally at a latent width (K3's latent MoE)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ActivationConfig, MoeConfig
from ..ops import dispatch
from ..ops.dispatch import routed_experts
from ..ops.moe import route
from .mlp import GluMlp, make_glu
from .norm import RMSNorm


class Router(nn.Module):
    """Sigmoid router; weight [E, D] and e_score_correction_bias [E] stay fp32."""

    def __init__(self, hidden: int, config: MoeConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        c = self.config
        return route(
            x,
            self.weight,
            self.e_score_correction_bias,
            c.top_k,
            c.num_groups,
            c.topk_groups,
            c.renormalize,
            c.routed_scaling_factor,
        )


class Experts(nn.Module):
    """E gated experts stored stacked: w1 (gate), w3 (up): [E, I, D]; w2 (down): [E, D, I]."""

    def __init__(self, num_experts: int, width: int, intermediate: int, act: ActivationConfig):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.zeros(num_experts, width, intermediate))
        self.w3 = nn.Parameter(torch.zeros(num_experts, intermediate, width))
        self.glu = make_glu(act)
        self.act = act

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, weights, ids, self.w1, self.w2, self.w3, self.glu)

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.w1, self.w2, self.w3

    def kernel_weights(self):
        """`ops.moe.experts.ExpertWeights` over these tensors (views, no copies)."""
        from ..ops.moe.experts import ExpertWeights

        return ExpertWeights(format="dense", w1=self.w1, w2=self.w2, w3=self.w3)


def grouped_experts(experts, x, weights, ids, kernel_weights=None) -> torch.Tensor:
    """The grouped expert kernels (`dispatch.fused_experts`) with `experts`' activation: the
    weighted sum over each row's experts of `kernel_weights` (default: `experts`' own), ids
    outside them (-1) skipped, no latent norm. x: [T, W] half precision on the GPU (or under
    the Triton interpreter); weights, ids: [T, k]. Returns [T, W] in x's dtype. For layers
    that run experts over part of a stack (DEP's received rows, TEP's intermediate slice,
    DWDP's block and staging buffer)."""
    act = experts.act
    return dispatch.fused_experts(
        x.contiguous(),
        weights.float(),
        ids.to(torch.int32),
        experts.kernel_weights() if kernel_weights is None else kernel_weights,
        activation=act.kind,
        beta=act.situ_beta,
        linear_beta=act.situ_linear_beta if act.kind == "situ" else None,
    )


# (name, rows, columns) of each projection's [E, rows, columns] weight, for width D, inter I.
def _projections(width: int, intermediate: int) -> tuple[tuple[str, int, int], ...]:
    return (("w1", intermediate, width), ("w2", width, intermediate), ("w3", intermediate, width))


class Mxfp4Experts(nn.Module):
    """`Experts` stored as K3 checkpoints store them: MXFP4 (ops/moe/mxfp4.py), never upcast.

    Buffers per projection p in w1, w2, w3 ([E, rows, cols] as in `Experts`): `p_packed` uint8
    [E, rows, cols/2] (two E2M1 codes a byte) and `p_scale` uint8 [E, rows, cols/32] (E8M0).
    The Triton path reads them packed; the torch reference decodes one layer's experts per
    call (exact: every MXFP4 value is representable in bf16, fp16 and fp32).
    """

    def __init__(self, num_experts: int, width: int, intermediate: int, act: ActivationConfig):
        super().__init__()
        for dim in (width, intermediate):
            if dim % 32:
                raise ValueError(f"MXFP4 experts need widths that are multiples of 32, got {dim}")
        for name, rows, cols in _projections(width, intermediate):
            packed = torch.zeros(num_experts, rows, cols // 2, dtype=torch.uint8)
            # 127: a scale of 2^0, so a fresh module decodes to zeros, not to NaNs (255).
            scale = torch.full((num_experts, rows, cols // 32), 127, dtype=torch.uint8)
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)
        self.glu = make_glu(act)
        self.act = act

    @classmethod
    def quantize(cls, experts: Experts) -> Mxfp4Experts:
        """Round dense experts to MXFP4 (for tests and benchmarks; checkpoints ship packed)."""
        from ..ops.moe.mxfp4 import quantize_mxfp4

        e, inter, width = experts.w1.shape
        out = cls(e, width, inter, experts.act)
        for name in ("w1", "w2", "w3"):
            packed, scale = quantize_mxfp4(getattr(experts, name).detach())
            setattr(out, f"{name}_packed", packed)
            setattr(out, f"{name}_scale", scale)
        return out

    def decoded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) decoded to dtype, [E, rows, cols] as `Experts` holds them."""
        from ..ops.moe.mxfp4 import decode_mxfp4

        return tuple(
            decode_mxfp4(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), dtype)
            for n in ("w1", "w2", "w3")
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, weights, ids, *self.decoded(x.dtype), self.glu)

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(
            getattr(self, f"{n}_{k}") for n in ("w1", "w2", "w3") for k in ("packed", "scale")
        )

    def kernel_weights(self):
        from ..ops.moe.experts import ExpertWeights

        return ExpertWeights(
            format="mxfp4",
            w1=self.w1_packed,
            w2=self.w2_packed,
            w3=self.w3_packed,
            s1=self.w1_scale,
            s2=self.w2_scale,
            s3=self.w3_scale,
        )


def use_mxfp4_experts(model: nn.Module) -> nn.Module:
    """Give every MoE layer of `model` MXFP4 experts (fresh buffers on the default device, e.g.
    "meta" before a checkpoint is assigned); returns the model."""
    for module in model.modules():
        if isinstance(module, MoE) and not isinstance(module.experts, Mxfp4Experts):
            e, inter, width = module.experts.w1.shape
            module.experts = Mxfp4Experts(e, width, inter, module.experts.act)
    return model


def expert_format(model: nn.Module) -> str:
    """ "mxfp4" when the model's MoE layers hold `Mxfp4Experts`, else "dense" (never mixed)."""
    kinds = {type(m.experts) for m in model.modules() if isinstance(m, MoE)}
    if len(kinds) > 1:
        raise ValueError("the MoE layers mix dense and MXFP4 experts")
    return "mxfp4" if kinds == {Mxfp4Experts} else "dense"


class MoE(nn.Module):
    # A `SideStream` (ops.moe.overlap) shared by the model's MoE layers, set by
    # `KimiForCausalLM.overlap_shared_experts`; None runs the shared experts in line.
    side_stream = None

    """Routed experts (at the latent width when configured) plus shared experts on the hidden.

    Latent path: route on x; h = down(x); y = sum_k w_k expert_k(h); y = norm(y); y = up(y).
    The router always reads the full hidden x. x: [T, D] -> [T, D].
    """

    def __init__(self, hidden: int, config: MoeConfig, act: ActivationConfig, eps: float):
        super().__init__()
        width = config.latent_size or hidden
        self.gate = Router(hidden, config)
        self.experts = Experts(config.num_experts, width, config.expert_intermediate_size, act)
        self.routed_expert_down_proj = None
        self.routed_expert_up_proj = None
        self.routed_expert_norm = None
        if config.latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(hidden, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, hidden, bias=False)
            if config.latent_norm:
                self.routed_expert_norm = RMSNorm(width, eps)
        self.shared_experts = None
        if config.num_shared_experts:
            shared = config.expert_intermediate_size * config.num_shared_experts
            self.shared_experts = GluMlp(hidden, shared, act)

    # The fused GPU path runs every routed expert on this device (the latent norm fused into
    # its combine); a subclass whose `routed` step runs experts elsewhere turns it off.
    fused_routed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_routed and dispatch.fused_moe(x):
            return self._forward_fused(x)
        weights, ids = self.gate(x)
        h = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        y = self.routed(h, weights, ids)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.routed_expert_up_proj is not None:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for rows h [T, W] (weights, ids: [T, k]): every
        expert is here. A subclass that runs experts elsewhere overrides this one step; the
        latent norm after it needs the complete sum over each token's experts."""
        return self.experts(h, weights, ids)

    def _kernel_weights(self):
        """(router weight in its cheapest exact dtype, ExpertWeights) for the Triton path, made
        once per weight version (on the first eager step, before any graph capture)."""
        from ..ops.moe.gate import router_weight_for_kernel

        e = self.experts
        tensors = (self.gate.weight, *e.kernel_tensors())
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        cached = getattr(self, "_kernel_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, router_weight_for_kernel(self.gate.weight), e.kernel_weights())
            self._kernel_cache = cached
        return cached[1], cached[2]

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """Router kernel, grouped experts with the GLU and the latent norm fused, shared experts
        on the side stream."""
        router, experts = self._kernel_weights()
        c, act = self.gate.config, self.experts.act

        def routed() -> torch.Tensor:
            r = dispatch.route_fused(
                x,
                router,
                self.gate.e_score_correction_bias,
                c.top_k,
                c.num_groups,
                c.topk_groups,
                c.renormalize,
                c.routed_scaling_factor,
            )
            h = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
            norm = self.routed_expert_norm
            y = dispatch.fused_experts(
                h,
                r.weights,
                r.ids,
                experts,
                activation=act.kind,
                beta=act.situ_beta,
                linear_beta=act.situ_linear_beta if act.kind == "situ" else None,
                counts=r.counts,
                ranks=r.ranks,
                norm_weight=None if norm is None else norm.weight,
                norm_eps=1e-6 if norm is None else norm.eps,
            )
            if self.routed_expert_up_proj is not None:
                y = self.routed_expert_up_proj(y)
            return y

        if self.shared_experts is None:
            return routed()
        if self.side_stream is None:
            return routed() + self.shared_experts(x)
        y, shared = self.side_stream.run(routed, lambda: self.shared_experts(x))
        return y + shared
