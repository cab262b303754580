"""DEP: attention data parallel, routed experts expert parallel (`apply_dep`).

Every rank runs attention, the router, the latent down projection and the shared experts on its
own requests (all replicated). The routed experts of each MoE layer are split over the
`groups["ep"]` ranks: member i of the group keeps experts [i E / R, (i + 1) E / R). Per MoE
layer and per rank:

1. route on the full hidden x (router replicated): weights, ids [B, K];
   h = routed_expert_down_proj(x) (latent [B, W], replicated; h = x without a latent);
2. DISPATCH (all-to-all): each token goes ONCE to each rank that owns at least one of its K
   experts, however many of them live there, with its (weights, ids) restricted to that rank's
   experts (other slots: weight 0, id -1);
3. each rank runs its local experts on the rows it received and REDUCES LOCALLY: one partial
   sum (fp32 accumulation) per received row;
4. COMBINE (all-to-all): the partial sums go back to the token's owner and are summed there;
5. routed_expert_norm (it needs the full sum over all of a token's experts, which is why the
   single-device kernels' norm fused into the combine cannot be used here), up projection,
   plus the shared experts.

Uneven token counts, zero included: a rank with no tokens still joins the count exchange and
both all-to-alls of every MoE layer, in layer order (`MoE` forwards on [0, D] inputs).

Payload precision: the dispatched token rows travel in `payload_dtype` (None: the activations'
dtype; torch.bfloat16; torch.float8_e4m3fn with one fp32 scale per row sent beside it and
dequantised on arrival). The combine always travels in the activations' dtype: bf16 in bf16
serving; the fp32 test models combine in fp32 (exactness checks).

Accounting (`CommLog`, bytes this rank sends to OTHER ranks; rows to itself are not counted):
"dep.dispatch": token rows in the payload dtype (W elements a row);
"dep.dispatch.meta": their routing metadata, K fp32 weights + K int32 local ids a row, plus the
    fp32 scale a row with FP8 (it travels in the same all-to-all as the rows);
"dep.combine": partial sums, W elements a row in the activations' dtype;
"dep.counts": the row counts agreed before the dispatch (R int64 per layer).
Per rank and MoE layer, dispatched rows = combined rows = sum over its B tokens of the number
of remote ranks holding one of the token's experts <= B K, with equality exactly when every
selected expert is remote and a token's K experts sit on K distinct ranks.

Expert load: each DEP layer counts, per local expert, the (token, expert) pairs it computed,
accumulated over calls: `report_load` (this rank), `gather_load` and `load_imbalance` (the
whole ep group, one all_gather), `reset_load`.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from ..model.layers.moe import Experts, MoE, Mxfp4Experts, grouped_experts
from ..model.ops import dispatch
from .comm import CommLog, all_to_all_rows, exchange_counts
from .dims import ParallelError
from .fp8_payload import FP8, dequantize_rows, quantize_rows
from .groups import Group, ParallelGroups
from .linear import shard_tensor
from .report import TransformReport, tensor_bytes
from .shards import shard_of

PAYLOAD_DTYPES = (None, torch.bfloat16, FP8)

# The stacked expert tensors of each experts kind, all [E, ...]: sharded along dim 0.
_EXPERT_TENSORS = {
    Experts: ("w1", "w2", "w3"),
    Mxfp4Experts: tuple(f"{p}_{k}" for p in ("w1", "w2", "w3") for k in ("packed", "scale")),
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N, C * itemsize] uint8 (a view when t is contiguous)."""
    return t.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, bytes] uint8 (possibly a column slice) -> [N, bytes / itemsize] dtype. A slice that
    stays a view of the packed rows (N <= 1 counts as contiguous) may start at a byte offset,
    or step rows by a stride, that is no multiple of the itemsize; it is copied to a buffer
    of its own first."""
    b = b.contiguous()
    if b.storage_offset() % dtype.itemsize or b.stride(0) % dtype.itemsize:
        b = torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b)
    return b.view(dtype)


def pack_rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[N, C_i] tensors of any dtypes -> ([N, sum bytes_i] uint8, [bytes_0, bytes_1, ...])."""
    raw = [_bytes(p) for p in parts]
    return torch.cat(raw, dim=1), [r.shape[1] for r in raw]


def unpack_rows(
    packed: torch.Tensor, widths: list[int], dtypes: list[torch.dtype]
) -> list[torch.Tensor]:
    """The inverse of `pack_rows`: [N, sum widths] uint8 -> the [N, C_i] parts in `dtypes`."""
    edges = [0, *itertools.accumulate(widths)]
    return [
        _from_bytes(packed[:, a:b], dtype)
        for (a, b), dtype in zip(itertools.pairwise(edges), dtypes, strict=True)
    ]


class DepMoE(MoE):
    """An `MoE` whose routed experts are this rank's slice of the ep group's experts.

    Same submodules under the same names as `MoE` (`apply_dep` swaps the class of the built
    module): gate, experts (sliced), routed_expert_down_proj / up_proj / norm, shared_experts.
    """

    fused_routed = False  # the routed step runs across ranks: never the one-device kernels

    # Set by `apply_dep` (instance attributes, never module globals):
    dep_group: Group
    dep_log: CommLog | None
    dep_payload_dtype: torch.dtype | None
    dep_local_experts: int  # E / R
    dep_load: torch.Tensor | None  # int64 [E / R], made on the activations' device at first use

    # -- the routed path ------------------------------------------------------------------------

    def routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h: [B, W] this rank's tokens; weights, ids: [B, K] global expert ids -> [B, W]."""
        group, per = self.dep_group, self.dep_local_experts
        ranks = group.size
        tokens = ids.shape[0]
        dest = ids // per  # [B, K] the ep member holding each selected expert
        needs = torch.zeros(tokens, ranks, dtype=torch.bool, device=h.device)
        needs.scatter_(1, dest, True)
        # One row per (destination, token) pair, grouped by destination, tokens in order.
        to, token = needs.t().nonzero(as_tuple=True)
        mine = dest[token] == to.unsqueeze(1)  # [S, K] the slots held by the row's destination
        row_weights = torch.where(mine, weights[token].float(), 0.0)
        row_ids = torch.where(mine, ids[token] - to.unsqueeze(1) * per, -1).to(torch.int32)

        # The row counts: exchanged as a tensor, then one host sync for both directions.
        send_counts = needs.sum(0)
        if self.dep_log is not None and ranks > 1:
            self.dep_log.record("dep.counts", 8 * (ranks - 1))
        both = torch.cat([send_counts, exchange_counts(send_counts, group)]).tolist()
        send, recv = both[:ranks], both[ranks:]

        # DISPATCH: [payload | weights | ids (| scale)] as bytes, one all-to-all.
        act = h.dtype
        rows = h[token]
        payload = act if self.dep_payload_dtype is None else self.dep_payload_dtype
        if payload == FP8:
            codes, scale = quantize_rows(rows)
            parts = [codes, row_weights, row_ids, scale]
        else:
            parts = [rows.to(payload), row_weights, row_ids]
        buf, widths = pack_rows(parts)
        if self.dep_log is not None and ranks > 1:
            remote = sum(send) - send[group.index]
            self.dep_log.record("dep.dispatch", remote * widths[0])
            self.dep_log.record("dep.dispatch.meta", remote * sum(widths[1:]))
        got, _ = all_to_all_rows(buf, send, group, recv_counts=recv)
        got_parts = unpack_rows(got, widths, [p.dtype for p in parts])
        got_weights, got_ids = got_parts[1], got_parts[2].long()
        if payload == FP8:
            got_rows = dequantize_rows(got_parts[0], got_parts[3], act)
        else:
            got_rows = got_parts[0].to(act)

        # Local experts, reduced locally: one partial sum per received row.
        partial = self._local_experts(got_rows, got_weights, got_ids).to(act)

        # COMBINE: partial sums back to their owners (rows come back in the order sent).
        if self.dep_log is not None and ranks > 1:
            returned = sum(recv) - recv[group.index]
            row = partial.shape[1] * partial.element_size()
            self.dep_log.record("dep.combine", returned * row)
        back, _ = all_to_all_rows(_bytes(partial), recv, group, recv_counts=send)
        out = torch.zeros(tokens, h.shape[1], dtype=torch.float32, device=h.device)
        out.index_add_(0, token, _from_bytes(back, act).float())
        return out.to(act)

    def _local_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [N, W]; weights [N, K] fp32; ids [N, K] local expert ids, -1 for slots held
        elsewhere -> [N, W] fp32, sum over each row's local experts. Counts the load. On a GPU
        in half precision: the one-device grouped expert kernels over the received rows (a -1
        slot is not local to them, so they skip it as an MoE skips another rank's experts);
        elsewhere the torch reference `routed_experts` on the local slice."""
        # The load without a host sync: slot -1 counts into a bin that is dropped.
        bins = torch.zeros(self.dep_local_experts + 1, dtype=torch.int64, device=ids.device)
        bins.index_add_(0, ids.reshape(-1) + 1, torch.ones_like(ids.reshape(-1)))
        if self.dep_load is None or self.dep_load.device != bins.device:
            self.dep_load = torch.zeros_like(bins[1:])
        self.dep_load += bins[1:]
        if dispatch.fused_moe(x) and x.shape[0]:
            return self._local_experts_fused(x, weights, ids)
        return self._local_experts_reference(x, weights, ids)

    def _local_experts_fused(self, x, weights, ids) -> torch.Tensor:
        return grouped_experts(self.experts, x, weights, ids).float()

    def _local_experts_reference(self, x, weights, ids) -> torch.Tensor:
        experts = self.experts
        if isinstance(experts, Mxfp4Experts):
            w1, w2, w3 = experts.decoded(x.dtype)
        else:
            w1, w2, w3 = experts.w1, experts.w2, experts.w3
        local = ids[ids >= 0]
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        for expert in local.unique().tolist():
            row, slot = (ids == expert).nonzero(as_tuple=True)
            t = x[row]
            y = experts.glu(t @ w1[expert].t(), t @ w3[expert].t()) @ w2[expert].t()
            out.index_add_(0, row, y.float() * weights[row, slot].unsqueeze(-1))
        return out


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_dep(
    model: nn.Module, groups: ParallelGroups, *, payload_dtype: torch.dtype | None = None
) -> None:
    """Refuse what `apply_dep` cannot transform (see its preconditions), changing nothing."""
    if payload_dtype not in PAYLOAD_DTYPES:
        raise ParallelError(
            f"apply_dep: payload_dtype must be None, torch.bfloat16 or torch.float8_e4m3fn, "
            f"got {payload_dtype!r}"
        )
    dims = groups.dims
    if dims.tep > 1 or dims.dwdp > 1:
        raise ParallelError(
            f"apply_dep: ep does not combine with tep={dims.tep} or dwdp={dims.dwdp}"
        )
    ranks = groups["ep"].size
    if ranks == 1:
        return
    for name, moe in _moe_layers(model):
        if isinstance(moe, DepMoE):
            raise ParallelError(f"apply_dep: {name} is already expert parallel")
        kind = type(moe.experts)
        if kind not in _EXPERT_TENSORS:
            raise ParallelError(
                f"apply_dep: {name}.experts is a {kind.__name__}; DEP shards `Experts` and "
                "`Mxfp4Experts` only"
            )
        for tensor in _EXPERT_TENSORS[kind]:
            if shard_of(moe.experts, tensor) is not None:
                raise ParallelError(
                    f"apply_dep: {name}.experts.{tensor} is already sharded (apply_tp or "
                    "apply_dwdp came first?)"
                )
        experts = getattr(moe.experts, _EXPERT_TENSORS[kind][0]).shape[0]
        if experts % ranks:
            raise ParallelError(
                f"apply_dep: ep={ranks} does not divide the {experts} routed experts of {name}"
            )


def apply_dep(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    log: CommLog | None = None,
    payload_dtype: torch.dtype | None = None,
) -> TransformReport:
    """Make every MoE layer of `model` expert parallel over `groups["ep"]` (attention, router,
    latent projections and shared experts stay replicated and data parallel).

    Member i of the ep group (R ranks) keeps experts [i E / R, (i + 1) E / R) of each layer:
    the stacked w1 / w2 / w3 (or the MXFP4 `*_packed` / `*_scale` buffers) sliced along dim 0
    and marked with `mark_shard`. Each `MoE` becomes a `DepMoE` (same parameter names); per MoE
    layer and step it exchanges row counts (R int64) and runs two all-to-alls, dispatch and
    combine (see the module docstring for what they carry and how `log` counts them).

    Preconditions: R divides the number of routed experts; the routed experts are whole
    (`apply_tp` / `apply_dwdp` not applied: they shard the same tensors another way; `apply_dep`
    not applied already). Combines with `apply_tp_subgroup` in either order (it shards the
    shared experts and attention projections, which DEP leaves alone). Every rank of the ep
    group must run the same number of forwards, an idle rank an empty one.
    payload_dtype: None (activations' dtype), torch.bfloat16 or torch.float8_e4m3fn.
    Only slices tensors, so it works on a model on the meta device. With an ep group of one
    rank nothing changes (the report says so): the model keeps its single-device path.
    """
    check_dep(model, groups, payload_dtype=payload_dtype)
    group = groups["ep"]
    before = tensor_bytes(model)
    if group.size == 1:  # nothing to split: the model keeps its single-device path
        return TransformReport("dep", before, before)
    for _, moe in _moe_layers(model):
        experts = moe.experts
        names = _EXPERT_TENSORS[type(experts)]
        per = getattr(experts, names[0]).shape[0] // group.size
        start, stop = group.index * per, (group.index + 1) * per
        for tensor in names:
            shard_tensor(experts, tensor, dim=0, start=start, stop=stop)
        moe.__class__ = DepMoE
        moe.dep_group = group
        moe.dep_log = log
        moe.dep_payload_dtype = payload_dtype
        moe.dep_local_experts = per
        moe.dep_load = None
    return TransformReport("dep", before, tensor_bytes(model))


# -- expert load ---------------------------------------------------------------------------------


def _dep_layers(model: nn.Module) -> list[tuple[str, DepMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, DepMoE)]


def report_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's load: DEP layer name -> int64 [E / R] (token, expert) pairs computed by each
    local expert (local expert i of ep member m is global expert m E / R + i), accumulated
    since `apply_dep` / `reset_load`. Local: no communication."""
    out = {}
    for name, m in _dep_layers(model):
        load = m.dep_load
        out[name] = (
            torch.zeros(m.dep_local_experts, dtype=torch.int64) if load is None else load.cpu()
        )
    return out


def reset_load(model: nn.Module) -> None:
    for _, m in _dep_layers(model):
        m.dep_load = None


def gather_load(model: nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """The ep group's load: layer name -> int64 [E] pairs per global expert. Collective: every
    member of the ep group calls it (one all_gather of all layers at once)."""
    group = groups["ep"]
    layers = _dep_layers(model)
    if not layers:
        return {}
    local = torch.stack(list(report_load(model).values())).to(groups.device)  # [L, E / R]
    if group.size == 1:
        full = local
    else:
        parts = [torch.empty_like(local) for _ in range(group.size)]
        dist.all_gather(parts, local, group=group.handle)
        full = torch.cat(parts, dim=1)  # [L, E], member order = expert order
    return {name: row.cpu() for (name, _), row in zip(layers, full, strict=True)}


def load_imbalance(model: nn.Module, groups: ParallelGroups) -> dict[str, float]:
    """Layer name -> max / mean over the ep members of the pairs each computed (1.0: perfectly
    balanced, or no load yet). Collective, like `gather_load`."""
    ranks = groups["ep"].size
    out = {}
    for name, load in gather_load(model, groups).items():
        per_rank = load.view(ranks, -1).sum(1).double()
        mean = per_rank.mean().item()
        out[name] = 1.0 if mean == 0 else per_rank.max().item() / mean
    return out
