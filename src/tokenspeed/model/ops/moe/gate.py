"""Fused sigmoid router (Triton): scores, bias-corrected (grouped) top-k, weights, and the
per-expert pair counts the grouped expert GEMMs need.

Same contract as `reference.route`; two launches (and a memset of the counters), no host
synchronisation:

1. `_logits_kernel`: logits = x W^T in fp32 accumulation, split over K into S partial sums
   [S, T, E] so that decode-sized batches still spread the 13-26 MB router weight over all SMs.
2. `_topk_kernel`: per token, sums the S partials in a fixed order, s = sigmoid(logits),
   selects by s + bias (grouped when configured), renormalises the unbiased s of the chosen
   experts, scales them, and counts every (token, slot) pair whose expert is local (atomics on
   int32 counters; each pair's atomic return value is its rank inside its expert's segment).

Selection order: every candidate is packed into one int64 key (order-preserving bits of its
fp32 score above `2^31 - 1 - expert`), so one max-reduction finds the best score and, among
equal scores, the lowest expert index: the tie-breaking of the reference's stable sort.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..interpret import interpreting
from ..tuning import integer, tuning_or_default, warp_count
from ._launch import cdiv, next_power_of_2, num_sms

_KEY_MIN = tl.constexpr(-(2**63))  # below every real key: padding lanes and taken experts


class RouterOutput(NamedTuple):
    """Router results (all on x's device, static shapes).

    weights: [T, k] fp32, best expert first; ids: [T, k] int32 global expert ids;
    counts: [num_local] int32 pairs per local expert; ranks: [T, k] int32 position of each
    pair inside its expert's segment (arbitrary but unique order), -1 when not local.
    """

    weights: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    ranks: torch.Tensor


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    E,
    D,
    k_per_split,
    stride_xt,
    stride_we,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x: [T, D]; w: [E, D] (K contiguous); out: [S, T, E] fp32 partial logits over split s."""
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_t * BT + tl.arange(0, BT)
    cols = pid_e * BE + tl.arange(0, BE)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, D)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < k_hi
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xt + ks[None, :],
            mask=(rows < T)[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_we + ks[:, None],
            mask=(cols < E)[None, :] & kmask[:, None],
            other=0.0,
        )
        if LOW_PRECISION:
            # bf16/fp16 operands: products are exact in the fp32 accumulator.
            acc = tl.dot(a, b.to(a.dtype), acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    out = out_ptr + pid_s.to(tl.int64) * T * E + rows[:, None].to(tl.int64) * E + cols[None, :]
    tl.store(out, acc, mask=(rows < T)[:, None] & (cols < E)[None, :])


@triton.jit
def _order_key(value, index):
    """int64 key ordered by (value, -index): order-preserving fp32 bits above 2^31-1-index."""
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value packed in an `_order_key` key."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _sigmoid(x, EXACT: tl.constexpr):
    # EXACT: libdevice expf and IEEE division, the operations torch's CUDA sigmoid uses, so
    # equal logits give equal scores as in the reference.
    if EXACT:
        return tl.math.div_rn(x * 0.0 + 1.0, 1.0 + libdevice.exp(-x))
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _topk_kernel(
    part_ptr,
    bias_ptr,
    w_out_ptr,
    id_out_ptr,
    counts_ptr,
    ranks_ptr,
    T,
    scaling,
    first_expert,
    num_local,
    E: tl.constexpr,
    S: tl.constexpr,
    G: tl.constexpr,
    EG: tl.constexpr,
    G2: tl.constexpr,
    EG2: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    K: tl.constexpr,
    K2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    EXACT: tl.constexpr,
    BT: tl.constexpr,
):
    """part: [S, T, E] fp32 partial logits; bias: [E]. Writes weights [T, K] fp32, ids [T, K]
    int32, ranks [T, K] int32 and adds to counts [num_local] int32.

    The tile is [BT tokens, G2 groups, EG2 experts per group] (powers of two, padded); expert
    id = group * EG + j.
    """
    pid = tl.program_id(0)
    tok = pid * BT + tl.arange(0, BT)
    tmask = tok < T
    grp = tl.arange(0, G2)
    j = tl.arange(0, EG2)
    eid = (grp[:, None] * EG + j[None, :])[None, :, :]  # [1, G2, EG2]
    valid = tmask[:, None, None] & ((grp[:, None] < G) & (j[None, :] < EG))[None, :, :]

    logits = tl.zeros([BT, G2, EG2], dtype=tl.float32)
    base = tok[:, None, None].to(tl.int64) * E + eid
    split_stride = tl.cast(T, tl.int64) * E
    for s in tl.static_range(S):  # fixed order: results do not depend on scheduling
        logits += tl.load(part_ptr + s * split_stride + base, mask=valid, other=0.0)
    score = _sigmoid(logits, EXACT)
    choice = score
    if HAS_BIAS:
        choice = score + tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    key = tl.where(valid, _order_key(choice, eid), _KEY_MIN)

    if G > 1:
        # A group scores the sum of its two best biased scores; keep the best TOPK_GROUPS
        # groups (ties -> lower group) and give the others -inf, as the reference does.
        first = tl.max(key, axis=2)  # [BT, G2]
        second = tl.max(tl.where(key == first[:, :, None], _KEY_MIN, key), axis=2)
        group_score = _key_value(first) + _key_value(second)
        gkey = tl.where((grp < G)[None, :], _order_key(group_score, grp[None, :]), _KEY_MIN)
        keep = grp[None, :] < 0  # all False, [BT, G2]
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(gkey, axis=1)
            hit = gkey == best[:, None]
            keep = keep | hit
            gkey = tl.where(hit, _KEY_MIN, gkey)
        dropped = _order_key(tl.full([BT, G2, EG2], float("-inf"), tl.float32), eid)
        key = tl.where(keep[:, :, None], key, tl.where(valid, dropped, _KEY_MIN))

    slot = tl.arange(0, K2)
    weights = tl.zeros([BT, K2], dtype=tl.float32)
    ids = tl.zeros([BT, K2], dtype=tl.int32)
    for r in tl.static_range(K):
        best = tl.max(tl.max(key, axis=2), axis=1)  # [BT]
        hit = key == best[:, None, None]  # exactly one lane per token
        w = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)
        key = tl.where(hit, _KEY_MIN, key)
        index = (0x7FFFFFFF - (best & 0x7FFFFFFF)).to(tl.int32)
        weights = tl.where(slot[None, :] == r, w[:, None], weights)
        ids = tl.where(slot[None, :] == r, index[:, None], ids)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling

    out_mask = tmask[:, None] & (slot[None, :] < K)
    offs = tok[:, None].to(tl.int64) * K + slot[None, :]
    tl.store(w_out_ptr + offs, weights, mask=out_mask)
    tl.store(id_out_ptr + offs, ids, mask=out_mask)
    local = ids - first_expert
    is_local = out_mask & (local >= 0) & (local < num_local)
    rank = tl.atomic_add(counts_ptr + local, 1, mask=is_local)
    tl.store(ranks_ptr + offs, tl.where(is_local, rank, -1), mask=out_mask)


def router_weight_for_kernel(weight: torch.Tensor) -> torch.Tensor:
    """The router weight in the cheapest dtype that keeps it exact: a bf16 copy when every
    value is representable in bf16 (checkpoints store bf16), else the weight itself.

    Call once at load time, not per step (it compares the whole tensor).
    """
    if weight.dtype == torch.float32:
        low = weight.to(torch.bfloat16)
        if torch.equal(low.float(), weight):
            return low
    return weight


@attrs.frozen(kw_only=True)
class RouterTuning:
    """The tuning knobs of the router's logits GEMM (`router_logits`, `route_fused`); None
    means "by shape", filled in by `resolve`. Separate from `MoeKernelConfig`: the router is
    its own call on the full hidden width, made before (and without knowing) the experts'.

    block_t: tokens per program (None: 16 up to 16 tokens, 32 up to 32, else 64); block_e:
    experts per program (None: 32 up to 16 tokens, 64 up to 64, else 128); block_k: the K step
    (None: 128 for 16-bit weights, 64 for fp32); splits: partial sums over K (None: doubled
    until the grid covers the GPU twice, keeping >= 4 K steps per split, so that decode-sized
    batches still spread the 13-26 MB weight over all SMs; then as many as needed at whole K
    steps); num_warps: 4; num_stages: the pipeline depth (None: 4 for 16-bit weights, 3 for
    fp32). block_k and splits set the fp32 summation order of the logits, so their last bits
    (and possibly a near-tied selection); the others do not change the result.
    """

    block_t: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    block_e: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    block_k: int | None = attrs.field(default=None, validator=integer(low=16, pow2=True))
    splits: int | None = attrs.field(default=None, validator=integer())
    num_warps: int = attrs.field(default=4, validator=warp_count(optional=False))
    num_stages: int | None = attrs.field(default=None, validator=integer())

    def resolve(
        self, tokens: int, experts: int, dim: int, low: bool, sms: int
    ) -> tuple[int, int, int, int, int, int, int]:
        """(block_t, block_e, block_k, splits, k_per_split, num_warps, num_stages) of a logits
        launch over [tokens, dim] x [experts, dim]^T (low: 16-bit weights) on `sms` SMs."""
        bt = self.block_t or (16 if tokens <= 16 else 32 if tokens <= 32 else 64)
        be = self.block_e or (32 if tokens <= 16 else 64 if tokens <= 64 else 128)
        bk = self.block_k or (128 if low else 64)
        splits = self.splits
        if splits is None:
            tiles = cdiv(tokens, bt) * cdiv(experts, be)
            splits = 1
            # Split K until the grid covers the GPU twice, keeping >= 4 K-steps per split.
            while tiles * splits < 2 * sms and dim // (2 * splits) >= 4 * bk:
                splits *= 2
        k_per_split = cdiv(cdiv(dim, splits), bk) * bk
        splits = cdiv(dim, k_per_split)
        stages = self.num_stages or (4 if low else 3)
        return bt, be, bk, splits, k_per_split, self.num_warps, stages


def router_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: str | None = None,
    tuning: RouterTuning | None = None,
) -> torch.Tensor:
    """Partial router logits [S, T, E] fp32 whose sum over S (in order) is x W^T.

    x: [T, D] (bf16/fp16/fp32); weight: [E, D]. bf16/fp16 weights with an x of the same
    dtype use a 16-bit dot (exact products, fp32 accumulation). Otherwise operands are fp32
    and `precision` is Triton's input_precision: default "tf32x3" on GPU (about fp32
    accuracy, on tensor cores) and "ieee" under the interpreter. tuning: the launch knobs
    (`RouterTuning`; None: by shape).
    """
    tuning = tuning_or_default(tuning, RouterTuning)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("router_logits needs x and weight contiguous along D")
    tokens, dim = x.shape
    experts = weight.shape[0]
    low = weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
    if precision is None:
        precision = "ieee" if interpreting() or not x.is_cuda else "tf32x3"
    bt, be, bk, splits, k_per_split, warps, stages = tuning.resolve(
        tokens, experts, dim, low, num_sms(x)
    )
    out = torch.empty(splits, tokens, experts, dtype=torch.float32, device=x.device)
    grid = (cdiv(tokens, bt), cdiv(experts, be), splits)
    _logits_kernel[grid](
        x,
        weight,
        out,
        tokens,
        experts,
        dim,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        BT=bt,
        BE=be,
        BK=bk,
        LOW_PRECISION=low,
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def route_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    *,
    first_expert: int = 0,
    num_local: int | None = None,
    logits: torch.Tensor | None = None,
    precision: str | None = None,
    tuning: RouterTuning | None = None,
) -> RouterOutput:
    """`reference.route` plus the local pair counts, in two Triton launches.

    x: [T, D]; weight: [E, D] (fp32, or its bf16 copy from `router_weight_for_kernel`);
    bias: [E] or None. first_expert / num_local: the experts this rank runs (default all);
    counts and ranks cover only pairs whose expert lies in [first_expert, first_expert +
    num_local). logits: optional precomputed [T, E] or [S, T, E] fp32 logits (then x and
    weight are not read): with logits from `x.float() @ weight.float().t()` the selections
    equal the reference's bit for bit on the same device. tuning: the logits launch's knobs
    (`RouterTuning`; None: by shape).
    Preconditions: top_k <= E / num_groups * topk_groups, E % num_groups == 0, E/groups >= 2.
    """
    experts = weight.shape[0]
    tokens = x.shape[0]
    if num_local is None:
        num_local = experts - first_expert
    if num_local < 1 or first_expert < 0:
        raise ValueError(f"no local experts: first_expert {first_expert}, num_local {num_local}")
    if experts % num_groups or (num_groups > 1 and experts // num_groups < 2):
        raise ValueError(f"{num_groups} groups do not split {experts} experts into pairs")
    if top_k > experts // num_groups * topk_groups:
        raise ValueError(f"top_k {top_k} exceeds the experts of {topk_groups} kept groups")
    if logits is None:
        logits = router_logits(x, weight, precision, tuning)
    elif logits.dim() == 2:
        logits = logits.unsqueeze(0)
    if logits.shape[1:] != (tokens, experts) or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [S, {tokens}, {experts}]")
    logits = logits.contiguous()
    device = x.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    ranks = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    counts = torch.zeros(num_local, dtype=torch.int32, device=device)
    per_group = experts // num_groups
    g2, eg2 = next_power_of_2(num_groups), next_power_of_2(per_group)
    bt = max(1, min(16, 2048 // (g2 * eg2)))
    exact = device.type == "cuda" and not interpreting()
    bias_arg = bias.float().contiguous() if bias is not None else weights
    _topk_kernel[(cdiv(tokens, bt),)](
        logits,
        bias_arg,
        weights,
        ids,
        counts,
        ranks,
        tokens,
        float(scaling),
        first_expert,
        num_local,
        E=experts,
        S=logits.shape[0],
        G=num_groups,
        EG=per_group,
        G2=g2,
        EG2=eg2,
        TOPK_GROUPS=topk_groups,
        K=top_k,
        K2=next_power_of_2(top_k),
        HAS_BIAS=bias is not None,
        RENORM=renormalize,
        EXACT=exact,
        BT=bt,
        num_warps=4 if bt * g2 * eg2 <= 2048 else 8,
    )
    return RouterOutput(weights, ids, counts, ranks)
