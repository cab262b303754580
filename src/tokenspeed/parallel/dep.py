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

from ..model.layers.moe import Experts, MoE, Mxfp4Experts
from .comm import CommLog
from .dims import ParallelError
from .fp8_payload import FP8, dequantize_rows, quantize_rows
from .groups import Group, ParallelGroups
from .report import TransformReport, tensor_bytes
from .shards import mark_shard, shard_of

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
    """[N, bytes] uint8 (possibly a column slice) -> [N, bytes / itemsize] dtype."""
    return b.contiguous().view(dtype)


class DepMoE(MoE):
    """An `MoE` whose routed experts are this rank's slice of the ep group's experts.

    Same submodules under the same names as `MoE` (`apply_dep` swaps the class of the built
    module): gate, experts (sliced), routed_expert_down_proj / up_proj / norm, shared_experts.
    """

    # Set by `apply_dep` (instance attributes, never module globals):
    dep_group: Group
    dep_log: CommLog | None
    dep_payload_dtype: torch.dtype | None
    dep_first_expert: int  # the global id of local expert 0
    dep_local_experts: int  # E / R
    dep_load: torch.Tensor | None  # int64 [E / R], made on the activations' device at first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        y = self._routed(h, weights, ids)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.routed_expert_up_proj is not None:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    # -- the routed path ------------------------------------------------------------------------

    def _routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h: [B, W] this rank's tokens; weights, ids: [B, K] global expert ids -> [B, W]."""
        group, per = self.dep_group, self.dep_local_experts
        ranks = group.size
        tokens, top_k = ids.shape
        dest = ids // per  # [B, K] the ep member holding each selected expert
        needs = torch.zeros(tokens, ranks, dtype=torch.bool, device=h.device)
        needs.scatter_(1, dest, True)
        # One row per (destination, token) pair, grouped by destination, tokens in order.
        to, token = needs.t().nonzero(as_tuple=True)
        send = needs.sum(0).tolist()
        mine = dest[token] == to.unsqueeze(1)  # [S, K] the slots held by the row's destination
        row_weights = torch.where(mine, weights[token].float(), 0.0)
        row_ids = torch.where(mine, ids[token] - to.unsqueeze(1) * per, -1).to(torch.int32)

        # DISPATCH: [payload | weights | ids (| scale)] as bytes, one all-to-all.
        act = h.dtype
        rows = h[token]
        payload = act if self.dep_payload_dtype is None else self.dep_payload_dtype
        if payload == FP8:
            codes, scale = quantize_rows(rows)
            parts = [_bytes(codes), _bytes(row_weights), _bytes(row_ids), _bytes(scale)]
        else:
            parts = [_bytes(rows.to(payload)), _bytes(row_weights), _bytes(row_ids)]
        widths = [rows.shape[1] * payload.itemsize, 4 * top_k, 4 * top_k, 4][: len(parts)]
        buf = torch.cat(parts, dim=1)
        recv = self._counts(send, h.device)
        if self.dep_log is not None and ranks > 1:
            remote = sum(send) - send[group.index]
            self.dep_log.record("dep.dispatch", remote * widths[0])
            self.dep_log.record("dep.dispatch.meta", remote * sum(widths[1:]))
        got = _all_to_all(buf, send, recv, group)
        edges = [0]
        for w in widths:
            edges.append(edges[-1] + w)
        cols = [got[:, a:b] for a, b in itertools.pairwise(edges)]
        got_weights = _from_bytes(cols[1], torch.float32)
        got_ids = _from_bytes(cols[2], torch.int32).long()
        if payload == FP8:
            got_rows = dequantize_rows(
                _from_bytes(cols[0], FP8), _from_bytes(cols[3], torch.float32), act
            )
        else:
            got_rows = _from_bytes(cols[0], payload).to(act)

        # Local experts, reduced locally: one partial sum per received row.
        partial = self._local_experts(got_rows, got_weights, got_ids).to(act)

        # COMBINE: partial sums back to their owners (rows come back in the order sent).
        if self.dep_log is not None and ranks > 1:
            returned = sum(recv) - recv[group.index]
            row = partial.shape[1] * partial.element_size()
            self.dep_log.record("dep.combine", returned * row)
        back = _from_bytes(_all_to_all(_bytes(partial), recv, send, group), act)
        out = torch.zeros(tokens, h.shape[1], dtype=torch.float32, device=h.device)
        out.index_add_(0, token, back.float())
        return out.to(act)

    def _counts(self, send: list[int], device: torch.device) -> list[int]:
        """How many rows each member sends this rank, given what this rank sends each."""
        group = self.dep_group
        if group.size == 1:
            return send
        if self.dep_log is not None:
            self.dep_log.record("dep.counts", 8 * (group.size - 1))
        mine = torch.tensor(send, dtype=torch.int64, device=device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=group.handle)
        return theirs.tolist()

    def _local_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [N, W]; weights [N, K] fp32; ids [N, K] local expert ids, -1 for slots held
        elsewhere -> [N, W] fp32, sum over each row's local experts (the torch reference
        `routed_experts` on the local slice, skipping the -1 slots). Counts the load."""
        experts = self.experts
        if isinstance(experts, Mxfp4Experts):
            w1, w2, w3 = experts.decoded(x.dtype)
        else:
            w1, w2, w3 = experts.w1, experts.w2, experts.w3
        valid = ids >= 0
        local = ids[valid]
        counts = torch.bincount(local, minlength=self.dep_local_experts)
        if self.dep_load is None or self.dep_load.device != counts.device:
            self.dep_load = torch.zeros_like(counts)
        self.dep_load += counts
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        for expert in local.unique().tolist():
            row, slot = (ids == expert).nonzero(as_tuple=True)
            t = x[row]
            y = experts.glu(t @ w1[expert].t(), t @ w3[expert].t()) @ w2[expert].t()
            out.index_add_(0, row, y.float() * weights[row, slot].unsqueeze(-1))
        return out


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Rows [sum(send[:j]), +send[j]) of x to member j; the rows received, grouped by sender."""
    if group.size == 1:
        return x
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.handle)
    return out


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


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
    Only slices tensors, so it works on a model on the meta device.
    """
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
    group = groups["ep"]
    ranks = group.size
    layers = _moe_layers(model)
    for name, moe in layers:
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
    before = tensor_bytes(model)
    for _, moe in layers:
        experts = moe.experts
        names = _EXPERT_TENSORS[type(experts)]
        per = getattr(experts, names[0]).shape[0] // ranks
        start, stop = group.index * per, (group.index + 1) * per
        for tensor in names:
            full = getattr(experts, tensor)
            part = full.detach()[start:stop].clone()
            if isinstance(full, nn.Parameter):
                part = nn.Parameter(part, requires_grad=full.requires_grad)
            setattr(experts, tensor, part)
            mark_shard(experts, tensor, dim=0, start=start, stop=stop)
        moe.__class__ = DepMoE
        moe.dep_group = group
        moe.dep_log = log
        moe.dep_payload_dtype = payload_dtype
        moe.dep_first_expert = start
        moe.dep_local_experts = per
        moe.dep_load = None
    return TransformReport("dep", before, tensor_bytes(model))


# -- expert load ---------------------------------------------------------------------------------


def _dep_layers(model: nn.Module) -> list[tuple[str, DepMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, DepMoE)]


def report_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's load: DEP layer name -> int64 [E / R] (token, expert) pairs computed by each
    local expert (global ids dep_first_expert + i), accumulated since `apply_dep` /
    `reset_load`. Local: no communication."""
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
