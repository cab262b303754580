"""Refusals that keep transforms from composing wrongly, and the packing of DEP's dispatch rows.

No processes: the transforms check and slice before any collective, so each rank's model is
built here with the groups it would have (no process group handles).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.mla import GatedMla
from tokenspeed.model.layers.moe import MoE, use_mxfp4_experts
from tokenspeed.parallel import parallelize
from tokenspeed.parallel.dcp import DcpGatedMla, apply_dcp
from tokenspeed.parallel.dep import apply_dep, pack_rows, unpack_rows
from tokenspeed.parallel.dims import KINDS, ParallelDims, ParallelError
from tokenspeed.parallel.dwdp import DwdpExperts, apply_dwdp
from tokenspeed.parallel.fp8_payload import FP8, dequantize_rows, quantize_rows
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.linear import shard_linear_columns
from tokenspeed.parallel.plan import default_registry
from tokenspeed.parallel.shards import mark_shard, rank_slices
from tokenspeed.parallel.tp import apply_tp
from tokenspeed.parallel.tp_subgroup import apply_tp_subgroup


def _tiny() -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def _groups(dims: ParallelDims, rank: int = 0, **sizes: int) -> ParallelGroups:
    """This rank's groups of `dims`, or of the sizes given (for layouts dims refuses), without
    process groups."""
    groups = {}
    for kind in KINDS:
        size = sizes.get(kind, getattr(dims, kind))
        first = rank // size * size
        groups[kind] = Group(None, tuple(range(first, first + size)), rank)
    return ParallelGroups(dims, rank, torch.device("cpu"), groups, timedelta(seconds=7))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return before.keys() == after.keys() and all(
        before[k].shape == after[k].shape and torch.equal(before[k], after[k]) for k in before
    )


def test_tep_with_dwdp_is_refused_by_dims_and_plans():
    with pytest.raises(ParallelError, match=r"tep=2 .* dwdp=2"):
        ParallelDims(world_size=2, tep=2, dwdp=2)
    registry = default_registry()
    assert "dwdp" in registry["tep"].conflicts and "tep" in registry["dwdp"].conflicts


def test_a_tensor_is_marked_once():
    linear = nn.Linear(4, 4)
    mark_shard(linear, "weight", dim=0, start=0, stop=2)
    with pytest.raises(ParallelError, match=r"Linear.weight is already a shard"):
        mark_shard(linear, "weight", dim=1, start=0, stop=2)


def test_dwdp_refuses_experts_another_transform_split():
    dims = ParallelDims(world_size=2, dwdp=2)
    tep = _tiny()
    apply_tp(tep, _groups(dims, tep=2))  # experts keep their class, sliced by columns
    before = _state(tep)
    with pytest.raises(ParallelError, match=r"apply_dwdp: .*experts \['w1', 'w2', 'w3'\] are"):
        apply_dwdp(tep, _groups(dims))
    assert _unchanged(tep, before)
    dep = _tiny()
    apply_dep(dep, _groups(ParallelDims(world_size=2, ep=2)))
    with pytest.raises(ParallelError, match="already sharded by another transform"):
        apply_dwdp(dep, _groups(dims))


def test_tep_refuses_experts_dep_or_dwdp_split():
    dims = ParallelDims(world_size=2, tep=2)
    dep = _tiny()
    apply_dep(dep, _groups(ParallelDims(world_size=2, ep=2)))
    before = _state(dep)
    with pytest.raises(ParallelError, match=r"is a DepMoE"):
        apply_tp(dep, _groups(dims))
    assert _unchanged(dep, before)
    dwdp = _tiny()
    for module in dwdp.modules():
        if isinstance(module, MoE):
            module.experts.__class__ = DwdpExperts  # what apply_dwdp makes of them
    with pytest.raises(ParallelError, match=r"with DwdpExperts"):
        apply_tp(dwdp, _groups(dims))
    # Experts sliced by a transform that keeps the classes (a mark) are refused too.
    marked = _tiny()
    experts = marked.model.layers[1].mlp.experts
    mark_shard(experts, "w1", dim=0, start=0, stop=8)
    with pytest.raises(ParallelError, match=r"experts \['w1'\] are already sharded"):
        apply_tp(marked, _groups(dims))


def test_a_failing_plan_leaves_an_mxfp4_model_unchanged():
    """tp_subgroup would apply, then dwdp refuse the MXFP4 experts: every strategy's check runs
    before any applies, so nothing changes."""
    model = use_mxfp4_experts(_tiny())
    before = _state(model)
    dims = ParallelDims(world_size=2, tp=2, dwdp=2)
    with pytest.raises(ParallelError, match="apply_dwdp needs dense Experts"):
        parallelize(model, _groups(dims), ["tp_subgroup", "dwdp"])
    assert _unchanged(model, before)
    assert not rank_slices(model)


def test_a_plan_given_as_one_string_is_refused():
    with pytest.raises(ParallelError, match=r"got the string 'dep' \(write \['dep'\]\)"):
        parallelize(_tiny(), _groups(ParallelDims(world_size=2, ep=2)), "dep")


def test_dep_and_dcp_of_one_rank_leave_the_model_as_it_is():
    dims = ParallelDims(world_size=1)
    model = _tiny()
    before = _state(model)
    for apply in (apply_dep, apply_dcp):
        report = apply(model, _groups(dims))
        assert report.weight_bytes_before == report.weight_bytes_after
    assert _unchanged(model, before)
    assert all(type(m) is MoE for m in model.modules() if isinstance(m, MoE))
    assert all(type(m) is GatedMla for m in model.modules() if isinstance(m, GatedMla))
    assert "check_inputs" not in model.__dict__


def test_dcp_twice_is_refused():
    model = _tiny()
    groups = _groups(ParallelDims(world_size=2, dcp=2))
    apply_dcp(model, groups)
    assert any(isinstance(m, DcpGatedMla) for m in model.modules())
    with pytest.raises(ParallelError, match="apply_dcp was already applied"):
        apply_dcp(model, groups)


def test_tp_subgroup_refuses_a_projection_another_transform_sliced():
    model = _tiny()
    apply_tp(model, _groups(ParallelDims(world_size=2, tep=2)))  # q_proj rows, still nn.Linear
    with pytest.raises(ParallelError, match=r"q_proj is a Linear, not a whole nn.Linear"):
        apply_tp_subgroup(model, _groups(ParallelDims(world_size=2, tp=2)))


def test_a_column_shard_of_a_linear_with_a_bias_is_refused():
    with pytest.raises(ParallelError, match="bias"):
        shard_linear_columns(nn.Linear(8, 4, bias=True), 0, 4)


def test_the_dwdp_fetch_group_gets_the_layouts_timeout(monkeypatch):
    made = []

    def new_groups(size, backend, timeout=None):
        made.append((size, backend, timeout))
        return Group(None, tuple(range(size)), 0)

    monkeypatch.setattr("tokenspeed.parallel.dwdp.new_groups", new_groups)
    apply_dwdp(_tiny(), _groups(ParallelDims(world_size=2, dwdp=2)))
    apply_dwdp(_tiny(), _groups(ParallelDims(world_size=2, dwdp=2)), timeout=timedelta(3))
    assert made == [(2, "gloo", timedelta(seconds=7)), (2, "gloo", timedelta(3))]


@pytest.mark.parametrize("width", [29, 30, 31, 32])
@pytest.mark.parametrize("rows", [0, 1, 2, 5])
@pytest.mark.parametrize("payload", [FP8, torch.bfloat16])
def test_dispatch_rows_unpack_at_any_width_and_row_count(width, rows, payload):
    """DEP packs [payload | fp32 weights | int32 ids (| fp32 scale)] as bytes; a received block
    of 0 or 1 rows is a view whose parts start at byte offsets (the latent width W, W % 4 != 0,
    in FP8) that are no multiple of the fp32 itemsize: unpacking copies those."""
    gen = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=gen)
    weights = torch.rand(rows, 4, generator=gen)
    ids = torch.randint(-1, 4, (rows, 4), generator=gen, dtype=torch.int32)
    if payload == FP8:
        codes, scale = quantize_rows(x)
        parts = [codes, weights, ids, scale]
    else:
        parts = [x.to(payload), weights, ids]
    packed, widths = pack_rows(parts)
    # As received: a block of a larger buffer (the rows from one sender), or the whole of it.
    buffer = torch.cat([torch.zeros(3, packed.shape[1], dtype=torch.uint8), packed])
    for got in (packed.clone(), buffer[3:]):
        back = unpack_rows(got, widths, [p.dtype for p in parts])
        for a, b in zip(back, parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
        if payload == FP8:
            assert dequantize_rows(back[0], back[3], torch.float32).shape == x.shape


def test_dep_layers_never_take_the_one_device_fused_path(monkeypatch):
    """The fused GPU MoE runs every expert on one device; a DEP layer's routed step runs across
    ranks, so `MoE.forward` must take the step-by-step path (with `routed`) for it."""
    from tokenspeed.model.layers.moe import MoE
    from tokenspeed.model.ops import dispatch
    from tokenspeed.parallel.dep import DepMoE

    config = get_preset("tiny")
    torch.manual_seed(0)
    moe = MoE(config.hidden_size, config.moe, config.activation, 1e-6)
    x = torch.randn(5, config.hidden_size)
    want = moe(x)
    monkeypatch.setattr(dispatch, "fused_moe", lambda x: True)
    monkeypatch.setattr(moe, "_forward_fused", lambda x: pytest.fail("took the fused path"))
    moe.fused_routed = False
    assert torch.equal(moe(x), want)
    assert DepMoE.fused_routed is False and MoE.fused_routed is True


def test_a_bare_moe_is_refused_by_apply_tp():
    """apply_tp replaces MoE children by TepMoE; a bare MoE would keep its class and return
    partial sums without their all-reduce."""
    moe = next(m for m in _tiny().modules() if isinstance(m, MoE))
    before = moe.experts.w1.shape
    with pytest.raises(ParallelError, match="not a bare MoE"):
        apply_tp(moe, _groups(ParallelDims(world_size=2, tep=2)))
    assert moe.experts.w1.shape == before  # nothing sliced
