"""`apply_tp_subgroup`: projections and shared experts column-parallel within groups of T ranks,
attention and its cache data parallel.

Every rank keeps its own requests (attention, KDA state and MLA latents stay local). A selected
projection W [out, in] is split by output features: member r of the `tp` group holds rows
[r * out/T, (r+1) * out/T). Its forward

    x [t_r, in] --all-gather (uneven t, zero allowed)--> x_all [sum t, in]
                --x_all @ W_r^T-->                        [sum t, out/T]
                --all-to-all (rows of member j to j)-->   [T, t_r, out/T] (one block per member)
                --columns in member order-->              [t_r, out]

gives every rank the complete output of its own tokens, computed with 1/T of the weight.

Accounting (what `CommLog` records; gloo pads an uneven gather to the longest member, the log
counts the payload): for one projection in -> out and t_r tokens on member r,

    all-gather  (T - 1) * t_r * in * bytes           (x sent to every other member)
    all-to-all  (sum_j t_j - t_r) * out/T * bytes    (the others' tokens' columns of this shard)

With equal counts t on every member and in = out = H that is ((T-1) + (T-1)/T) * H * bytes per
local token per projection, the issue's closed form (it assumes equal counts, a square
projection and a gather of its own; `o_proj` of the tiny preset is one, 64 -> 64).

Projections that read the same tensor (q/k/v/f_a/b/g of a KDA layer, q(_a)/kv_a/g of an MLA layer,
gate/up of the shared experts) share one all-gather per forward by default (`share_gather`):
the gather term is then paid once per layer input, not once per projection.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layers.kda import KdaAttention
from ..model.layers.mla import GatedMla
from ..model.layers.mlp import GluMlp
from .comm import CommLog, all_gather_rows, all_to_all_rows
from .dims import ParallelError
from .groups import Group, ParallelGroups
from .linear import shard_tensor
from .report import TransformReport, tensor_bytes
from .shards import shard_of

GATHER = "tp_subgroup.all_gather"
ALL_TO_ALL = "tp_subgroup.all_to_all"

# The nn.Linear children of each attention layer that may be selected, and those of them that
# read the layer's input (the hidden state after the input norm).
KDA_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_proj",
    "g_a_proj",
    "g_b_proj",
    "o_proj",
)
KDA_READS_HIDDEN = frozenset(
    {"q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj"}
)
# kv_b_proj is not selectable: attention reads its weight directly (absorbed form).
MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "g_proj", "o_proj")
MLA_READS_HIDDEN = frozenset({"q_proj", "q_a_proj", "kv_a_proj_with_mqa", "g_proj"})
# Pseudo-names for the GluMlp blocks (all three linears each): the shared experts of MoE layers
# and the dense MLP of dense layers.
MLP_BLOCKS = ("shared_experts", "dense_mlp")

# Every input projection that reads the hidden state, both output projections, and the shared
# experts. The low-rank second stages (f_b, g_b, q_b) stay local: they are small, read a
# rank-sized input, and sharding them would add a gather of their input for little weight; the
# dense MLP of the first layer(s) stays local too (select "dense_mlp" to shard it).
DEFAULT_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "b_proj",
    "g_proj",
    "g_a_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "shared_experts",
)


def return_columns(
    y: torch.Tensor, counts: list[int], group: Group, log: CommLog | None, name: str = ALL_TO_ALL
) -> torch.Tensor:
    """y [sum t, o]: this member's o output columns for every member's tokens (member order) ->
    [t_r, T * o]: every member's columns for this member's tokens, in member order. The counts
    are known from the gather, so the all-to-all needs no exchange of sizes."""
    size, mine = group.size, counts[group.index]
    width = y.shape[1]
    if size == 1:
        return y
    if sum(counts) == 0:  # every member idle (all know it from the gather): nothing to send
        return y.new_empty((0, size * width))
    out, _ = all_to_all_rows(y, counts, group, log, name, recv_counts=[mine] * size)
    return out.view(size, mine, width).transpose(0, 1).reshape(mine, size * width)


def _gather(x: torch.Tensor, group: Group, log: CommLog | None):
    """x [..., in] -> (the group's rows [sum t, in] in member order, [t_0, t_1, ...])."""
    return all_gather_rows(x.reshape(-1, x.shape[-1]), group, log, GATHER)


class SharedGather:
    """One all-gather of a layer input for the `readers` projections that read it.

    The first reader of a tensor gathers it; the others get the same result while they are
    given the same tensor object (the caller's, before any reshape), unmodified (same
    `_version`); after the last reader the result is dropped, so no gathered activations
    outlive the layer. Which reader comes first does not matter: every member runs the same
    layer code, so all gather at the same point.
    """

    def __init__(self, readers: int):
        self.readers = readers
        self._clear()

    def _clear(self) -> None:
        self._source = None
        self._version = -1
        self._result = None
        self._uses = 0

    @property
    def holding(self) -> bool:
        """Whether a gathered input is kept for readers still to come."""
        return self._result is not None

    def gather(self, x: torch.Tensor, group: Group, log: CommLog | None):
        source = None if self._source is None else self._source()
        if source is x and x._version == self._version:
            result = self._result
            self._uses += 1
            if self._uses == self.readers:
                self._clear()
            return result
        result = _gather(x, group, log)
        self._source, self._version = weakref.ref(x), x._version
        self._result, self._uses = result, 1
        return result


class SubgroupLinear(nn.Module):
    """A column-parallel shard of an nn.Linear over a `tp` group, returning complete outputs for
    this rank's own tokens (see the module docstring). Owns `weight` (rows [start, stop) of the
    single-device weight, marked) and `bias` under the names of the linear it replaces."""

    def __init__(
        self,
        linear: nn.Linear,
        group: Group,
        log: CommLog | None,
        share: SharedGather | None = None,
    ):
        super().__init__()
        size, index = group.size, group.index
        width = linear.out_features // size
        start, stop = index * width, (index + 1) * width
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        shard_tensor(self, "weight", dim=0, start=start, stop=stop)
        if self.bias is not None:
            shard_tensor(self, "bias", dim=0, start=start, stop=stop)
        self.group = group
        self.log = log
        self.share = share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.share is not None:  # keyed on the caller's tensor (a reshape is a new object)
            x_all, counts = self.share.gather(x, self.group, self.log)
        else:
            x_all, counts = _gather(x, self.group, self.log)
        y = return_columns(F.linear(x_all, self.weight, self.bias), counts, self.group, self.log)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(holds {self.weight.shape[0]}), group={self.group.ranks}"
        )


def _selection(projections: Iterable[str]) -> dict[str, set[str]]:
    """Selected names per kind ("kda", "mla", "mlp"); a name may be qualified by a kind."""
    if isinstance(projections, str):
        projections = (projections,)
    known = {"kda": set(KDA_PROJECTIONS), "mla": set(MLA_PROJECTIONS), "mlp": set(MLP_BLOCKS)}
    chosen: dict[str, set[str]] = {kind: set() for kind in known}
    for item in projections:
        kind, _, name = item.rpartition(".")
        if kind and kind not in known:
            raise ParallelError(f"tp_subgroup: unknown layer kind {kind!r} in {item!r}")
        kinds = [kind] if kind else [k for k in known if name in known[k]]
        if not kinds or any(name not in known[k] for k in kinds):
            raise ParallelError(
                f"tp_subgroup: {item!r} is not a selectable projection; KDA: {KDA_PROJECTIONS}, "
                f"MLA: {MLA_PROJECTIONS} (kv_b_proj stays local), MLP blocks: {MLP_BLOCKS}; "
                "qualify a name with 'kda.' or 'mla.' to pick one kind"
            )
        for k in kinds:
            chosen[k].add(name)
    return chosen


def _plan(model: nn.Module, chosen: dict[str, set[str]]) -> list[tuple[str, nn.Module, list]]:
    """[(qualified prefix, parent module, [(child name, reads the parent's input?)])]."""
    plan = []
    for prefix, module in model.named_modules():
        if isinstance(module, KdaAttention):
            names = [(n, n in KDA_READS_HIDDEN) for n in KDA_PROJECTIONS if n in chosen["kda"]]
        elif isinstance(module, GatedMla):
            names = [(n, n in MLA_READS_HIDDEN) for n in MLA_PROJECTIONS if n in chosen["mla"]]
        elif isinstance(module, GluMlp):
            block = "shared_experts" if prefix.endswith("shared_experts") else "dense_mlp"
            if block not in chosen["mlp"]:
                continue
            names = [("gate_proj", True), ("up_proj", True), ("down_proj", False)]
        else:
            continue
        present = [(n, reads) for n, reads in names if getattr(module, n, None) is not None]
        if present:
            plan.append((prefix, module, present))
    return plan


def check_tp_subgroup(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    projections: Iterable[str] = DEFAULT_PROJECTIONS,
) -> None:
    """Refuse what `apply_tp_subgroup` cannot transform (see its preconditions), changing
    nothing."""
    chosen = _selection(projections)
    size = groups["tp"].size
    if size == 1:
        return
    plan = _plan(model, chosen)
    if not plan:
        raise ParallelError(f"tp_subgroup: no projection of the model matches {projections!r}")
    for prefix, module, names in plan:
        for name, _ in names:
            linear = getattr(module, name)
            if not isinstance(linear, nn.Linear) or shard_of(linear, "weight") is not None:
                raise ParallelError(
                    f"tp_subgroup: {prefix}.{name} is a {type(linear).__name__}, not a whole "
                    "nn.Linear (already transformed?)"
                )
            if linear.out_features % size:
                raise ParallelError(
                    f"tp_subgroup={size} does not divide the {linear.out_features} output "
                    f"features of {prefix}.{name} ({linear.in_features} -> "
                    f"{linear.out_features})"
                )


def apply_tp_subgroup(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    log: CommLog | None = None,
    projections: Iterable[str] = DEFAULT_PROJECTIONS,
    share_gather: bool = True,
) -> TransformReport:
    """Make the selected projections of every KDA and MLA layer, and the linears of the shared
    experts, column-parallel over this rank's `tp` group (`groups["tp"]`, size T).

    projections: names of nn.Linear children of the attention layers (KDA: `KDA_PROJECTIONS`,
    MLA: `MLA_PROJECTIONS`; "kda.o_proj" picks one kind), plus "shared_experts" and
    "dense_mlp" for those GluMlp blocks (all three of their linears). Default:
    `DEFAULT_PROJECTIONS`. Names a layer does not have (g_a_proj beside a full-rank gate) are
    skipped. share_gather: one all-gather per layer input for the projections reading it.

    Preconditions: the model is built for one device (its projections are plain nn.Linear: not
    already transformed by this or by `apply_tp`); every selected projection's output width is
    divisible by T (refused otherwise, naming it). Combines with `apply_dep` (routed experts),
    `apply_dcp` and `apply_dwdp` in any order: it touches only the projections and the shared
    experts' GluMlp. Only slices tensors, so it works on a model on the meta device.

    At run time every member of the group must run every step, in the same order, with zero
    tokens if it has none (`ForwardBatch` of no requests): each selected projection is a
    collective. Per layer and forward it communicates, per gather group of projections, one
    all-gather of the input rows ("tp_subgroup.all_gather"), and per projection one all-to-all
    of its output columns ("tp_subgroup.all_to_all"); see the module docstring for the bytes.
    """
    check_tp_subgroup(model, groups, projections=projections)
    group = groups["tp"]
    before = tensor_bytes(model)
    if group.size == 1:
        return TransformReport("tp_subgroup", before, before)
    plan = _plan(model, _selection(projections))
    for _, module, names in plan:
        readers = [n for n, reads in names if reads]
        shared = SharedGather(len(readers)) if share_gather and len(readers) > 1 else None
        for name, reads in names:
            share = shared if reads else None
            setattr(module, name, SubgroupLinear(getattr(module, name), group, log, share))
    return TransformReport("tp_subgroup", before, tensor_bytes(model))
