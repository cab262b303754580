"""`apply_tp`: plain tensor parallelism of attention and experts (TEP), the baseline DEP is
compared with.

Every rank of a `tep` group runs the same tokens (attention is not data parallel). Member r of
T holds heads [r * H/T, (r+1) * H/T) of every attention layer and intermediate columns
[r * I/T, (r+1) * I/T) of every expert (routed, shared, dense), so each layer costs two
all-reduces of the whole batch:

    attention  heads local; o_proj row parallel (its input columns of the local heads) and one
               all-reduce of [N, hidden]                                ("tep.attn.all_reduce")
    MLP        dense: gate/up rows, down columns, one all-reduce of [N, hidden];
               MoE: router replicated, w1/w3 rows and w2 columns of every expert, shared
               experts likewise, one all-reduce of the partial sums    ("tep.mlp.all_reduce")

The MoE all-reduce carries the routed experts' partial sum and the shared experts' partial sum
together. Without a latent width both are [N, hidden]: they are added first and reduced as one
[N, hidden]. With K3's latent MoE the latent norm needs the complete routed sum, so the
reduction comes before norm and up-projection: one all-reduce of [N, latent + hidden] (the
routed latent partial | the shared partial, concatenated), then norm, up-projection (replicated)
and the shared sum added. Without a latent norm the up-projection is linear and is applied to
the partial sum, so the reduction is again one [N, hidden].

`CommLog` records a ring all-reduce as 2 (T-1)/T of the tensor's bytes sent per rank.

State shapes: sharding by heads changes this rank's KDA state (recurrent [B, H/T, K, V], conv
[B, 3 * H/T * K, W-1]); the MLA latent rows are per token, not per head, and stay whole (every
member keeps the same rows). So the transform evolves the configs the layers and the model read
(`attrs.evolve` on the frozen configs): each KDA / MLA layer's `config` and the model's
`config` (KimiForCausalLM and KimiModel) describe this rank's local heads and intermediate
sizes; `model.empty_state(...)` and the input checks then size the state for the rank.

Shard marks: every sliced tensor is marked (`mark_shard`); KDA's `conv_weight` holds [start,
stop) of each of the three stacked q | k | v blocks (`blocks=3`). Embedding, LM head, norms,
routers, q_a / kv_a / g_a / f_a projections stay whole on every member.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from ..model.config import ModelConfig
from ..model.layers.kda import KdaAttention
from ..model.layers.mla import GatedMla
from ..model.layers.mlp import GluMlp
from ..model.layers.moe import Experts, MoE, grouped_experts
from ..model.ops import dispatch
from .comm import CommLog, all_reduce_
from .dims import ParallelError
from .groups import Group, ParallelGroups
from .linear import (
    RowParallelLinear,
    as_parameter,
    shard_linear_columns,
    shard_linear_rows,
    shard_tensor,
    take,
)
from .report import TransformReport, tensor_bytes
from .shards import mark_shard, mark_source_config, rank_slices
from .tp_subgroup import SubgroupLinear

ATTN = "tep.attn.all_reduce"
MLP = "tep.mlp.all_reduce"


def _span(total: int, group: Group, what: str) -> tuple[int, int]:
    """This member's [start, stop) of `total` split evenly over the group."""
    if total % group.size:
        raise ParallelError(f"tep={group.size} does not divide the {what} ({total})")
    part = total // group.size
    return group.index * part, (group.index + 1) * part


def _shard_kda(attn: KdaAttention, group: Group, log: CommLog | None) -> None:
    c = attn.config
    dim, proj = c.head_dim, c.projection_size
    first, last = _span(c.num_heads, group, f"KDA heads of {type(attn).__name__}")
    start, stop = first * dim, last * dim
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj"):
        shard_linear_rows(getattr(attn, name), start, stop)
    if c.full_rank_output_gate:
        shard_linear_rows(attn.g_proj, start, stop)
    else:
        shard_linear_rows(attn.g_b_proj, start, stop)  # g_a_proj (hidden -> head_dim) whole
    shard_linear_rows(attn.b_proj, first, last)
    shard_tensor(attn, "A_log", dim=0, start=first, stop=last)
    shard_tensor(attn, "dt_bias", dim=0, start=start, stop=stop)
    # Conv taps of the stacked q | k | v channels: the local heads' rows of each third.
    conv = attn.conv_weight
    local = torch.cat(
        [take(conv, 0, block * proj + start, block * proj + stop) for block in (0, 1, 2)]
    )
    attn.conv_weight = as_parameter(local, conv)
    mark_shard(attn, "conv_weight", dim=0, start=start, stop=stop, blocks=3)
    attn.o_proj = RowParallelLinear(attn.o_proj, start, stop, group, log, ATTN)
    attn.config = attrs.evolve(c, num_heads=last - first)


def _shard_mla(attn: GatedMla, group: Group, log: CommLog | None) -> None:
    c = attn.config
    first, last = _span(c.num_heads, group, f"MLA heads of {type(attn).__name__}")
    q = attn.q_proj if c.q_lora_rank is None else attn.q_b_proj  # q_a_proj, its norm: whole
    shard_linear_rows(q, first * c.qk_head_dim, last * c.qk_head_dim)
    kv = c.qk_nope_head_dim + c.v_head_dim  # kv_a_proj_with_mqa and its norm: whole
    shard_linear_rows(attn.kv_b_proj, first * kv, last * kv)
    if c.output_gate:
        shard_linear_rows(attn.g_proj, first * c.v_head_dim, last * c.v_head_dim)
    o_start, o_stop = first * c.v_head_dim, last * c.v_head_dim
    attn.o_proj = RowParallelLinear(attn.o_proj, o_start, o_stop, group, log, ATTN)
    attn.config = attrs.evolve(c, num_heads=last - first)
    attn.__dict__.pop("_absorbed_cache", None)


def _shard_glu(mlp: GluMlp, group: Group, what: str, log: CommLog | None, reduce: bool) -> None:
    """gate / up rows and down columns of this member's intermediate slice. reduce: down is
    row parallel with its all-reduce (a dense MLP); else its output stays a partial sum (the
    shared experts, reduced with the routed experts by `TepMoE`)."""
    start, stop = _span(mlp.gate_proj.out_features, group, what)
    shard_linear_rows(mlp.gate_proj, start, stop)
    shard_linear_rows(mlp.up_proj, start, stop)
    if reduce:
        mlp.down_proj = RowParallelLinear(mlp.down_proj, start, stop, group, log, MLP)
    else:
        shard_linear_columns(mlp.down_proj, start, stop)


def _shard_experts(experts: Experts, group: Group, what: str) -> None:
    """w1 / w3 [E, I, D] rows and w2 [E, D, I] columns of this member's intermediate slice."""
    start, stop = _span(experts.w1.shape[1], group, what)
    shard_tensor(experts, "w1", dim=1, start=start, stop=stop)
    shard_tensor(experts, "w3", dim=1, start=start, stop=stop)
    shard_tensor(experts, "w2", dim=2, start=start, stop=stop)


class TepMoE(MoE):
    """A `MoE` whose experts hold an intermediate slice: routed and shared partial sums are
    reduced over the `tep` group in one all-reduce (see the module docstring). It adopts the
    children of the MoE it replaces, so parameter names are unchanged."""

    def __init__(self, moe: MoE, group: Group, log: CommLog | None):
        nn.Module.__init__(self)
        self.gate = moe.gate
        self.experts = moe.experts
        self.routed_expert_down_proj = moe.routed_expert_down_proj
        self.routed_expert_up_proj = moe.routed_expert_up_proj
        self.routed_expert_norm = moe.routed_expert_norm
        self.shared_experts = moe.shared_experts
        self.group = group
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        down, up, norm = (
            self.routed_expert_down_proj,
            self.routed_expert_up_proj,
            self.routed_expert_norm,
        )
        h = x if down is None else down(x)
        if dispatch.fused_moe(h) and h.shape[0]:
            # The grouped expert kernels on this rank's intermediate slice, without the latent
            # norm (it needs the full sum, after the all-reduce).
            y = grouped_experts(self.experts, h, weights, ids)
        else:
            y = self.experts(h, weights, ids)  # partial sum
        shared = None if self.shared_experts is None else self.shared_experts(x)  # partial
        if norm is None:
            if up is not None:
                y = up(y)  # linear: the up-projection of the partial sums adds up
            if shared is not None:
                y = y + shared
            return all_reduce_(y, self.group, self.log, MLP)
        width = y.shape[-1]
        both = y if shared is None else torch.cat([y, shared], dim=-1)
        all_reduce_(both, self.group, self.log, MLP)
        y = up(norm(both[:, :width]))
        return y if shared is None else y + both[:, width:]


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """`config` as a member of a `tep` group of `size` ranks sees it: its heads and
    intermediate widths (what `apply_tp` sets on the model; the front end sizes a rank's cache
    from it before any rank is built)."""
    changes = {}
    if config.kda_layers:
        changes["kda"] = attrs.evolve(config.kda, num_heads=config.kda.num_heads // size)
    if config.mla_layers:
        changes["mla"] = attrs.evolve(config.mla, num_heads=config.mla.num_heads // size)
    if config.moe is not None:
        inter = config.moe.expert_intermediate_size // size
        changes["moe"] = attrs.evolve(config.moe, expert_intermediate_size=inter)
    if "dense" in config.mlp_kinds:
        changes["dense_intermediate_size"] = config.dense_intermediate_size // size
    return config.evolve(**changes)


def check_tp(model: nn.Module, groups: ParallelGroups) -> None:
    """Refuse what `apply_tp` cannot transform (see its preconditions), changing nothing."""
    size = groups["tep"].size
    if size > 1:
        _check(model, size)


def _check(model: nn.Module, size: int) -> None:
    """Refuse a model this group cannot split, before changing anything."""
    for prefix, module in model.named_modules():
        if isinstance(module, RowParallelLinear | TepMoE):
            raise ParallelError(f"apply_tp was already applied ({prefix} is a {type(module)})")
        if isinstance(module, SubgroupLinear):
            raise ParallelError(
                f"apply_tp cannot follow apply_tp_subgroup ({prefix} is already sharded)"
            )
        checks = []
        if isinstance(module, KdaAttention | GatedMla):
            checks.append(("heads", module.config.num_heads))
        elif isinstance(module, GluMlp):
            checks.append(("intermediate size", module.gate_proj.out_features))
        elif isinstance(module, MoE):
            if type(module) is not MoE or type(module.experts) is not Experts:
                raise ParallelError(
                    f"apply_tp shards dense experts only, of a single-device MoE; {prefix} is a "
                    f"{type(module).__name__} with {type(module.experts).__name__} (MXFP4, or "
                    "another transform, apply_dep / apply_dwdp, split them already)"
                )
            marked = sorted(rank_slices(module.experts))
            if marked:
                raise ParallelError(
                    f"apply_tp: {prefix}.experts {marked} are already sharded by another transform"
                )
            checks.append(("expert intermediate size", module.experts.w1.shape[1]))
        for what, count in checks:
            if count % size:
                raise ParallelError(f"tep={size} does not divide the {what} of {prefix} ({count})")


def apply_tp(
    model: nn.Module, groups: ParallelGroups, *, log: CommLog | None = None
) -> TransformReport:
    """Shard attention by heads and every expert by intermediate columns over this rank's `tep`
    group (`groups["tep"]`, size T); see the module docstring for what each layer communicates.

    Preconditions: a model built for one device (no other transform applied: TEP does not
    combine with tp / ep / dcp, `ParallelDims` refuses it; DWDP would shard experts again);
    T divides the KDA and MLA heads, every expert intermediate size and the dense MLP's;
    dense (not MXFP4) experts. Only slices tensors (works on the meta device).

    At run time every member runs the same batch (same tokens, same requests) and gets the full
    logits; the state it passes is sized for its local heads (`model.empty_state`, see the
    module docstring); the routed experts run the grouped expert kernels on a GPU in half
    precision (the reference elsewhere) without the latent norm, which needs the full sum
    and follows the all-reduce.
    """
    group = groups["tep"]
    before = tensor_bytes(model)
    if group.size == 1:
        return TransformReport("tep", before, before)
    if isinstance(model, MoE):
        # Its experts would be sharded but the module itself never swapped for a `TepMoE`
        # (only children are replaced): partial sums without their all-reduce.
        raise ParallelError(
            "apply_tp transforms a model that contains MoE layers, not a bare MoE: wrap it "
            "(e.g. in nn.Sequential) so that it can be replaced by a TepMoE"
        )
    _check(model, group.size)
    full = getattr(model, "config", None)
    for prefix, module in list(model.named_modules()):
        if isinstance(module, KdaAttention):
            _shard_kda(module, group, log)
        elif isinstance(module, GatedMla):
            _shard_mla(module, group, log)
        elif isinstance(module, MoE):
            _shard_experts(module.experts, group, f"expert intermediate size of {prefix}")
        elif isinstance(module, GluMlp):
            shared = prefix.endswith("shared_experts")
            _shard_glu(module, group, f"intermediate size of {prefix}", log, reduce=not shared)
    # Replace the MoE modules after the walk (named_modules must not see a changing tree).
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE) and not isinstance(child, TepMoE):
                setattr(parent, name, TepMoE(child, group, log))
    if isinstance(full, ModelConfig):
        mark_source_config(model, full)  # the checkpoint's: per-rank loading checks against it
        local = local_config(full, group.size)
        for module in model.modules():
            if getattr(module, "config", None) is full:
                module.config = local
    return TransformReport("tep", before, tensor_bytes(model))
