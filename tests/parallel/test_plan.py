"""`parallelize`: plans refused before anything changes, and the compositions TP subgroup + DEP
and DCP + DEP giving the single-process logits on CPU ranks (uneven requests, idle ranks)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel import (
    CommLog,
    ParallelDims,
    ParallelError,
    ParallelGroups,
    Registry,
    Strategy,
    TransformReport,
    default_registry,
    parallelize,
)
from tokenspeed.parallel.dcp import DcpGatedMla
from tokenspeed.parallel.dep import DepMoE
from tokenspeed.parallel.dims import KINDS
from tokenspeed.parallel.groups import Group
from tokenspeed.parallel.tp_subgroup import SubgroupLinear

from .harness import run_ranks

ATOL = 5e-5


def _tiny() -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def _local_groups(dims: ParallelDims, rank: int) -> ParallelGroups:
    """Groups without process groups: enough to check a plan (nothing communicates)."""
    groups = {kind: Group(None, dims.group_of(kind, rank), rank) for kind in KINDS}
    return ParallelGroups(dims, rank, torch.device("cpu"), groups)


@pytest.mark.parametrize(
    ("dims", "plan", "message"),
    [
        (ParallelDims(world_size=2, ep=2), ["dep", "dep"], r"names \['dep'\] more than once"),
        (ParallelDims(world_size=2, ep=2), ["dcp"], r"names 'dcp', but ParallelDims.dcp is 1"),
        (ParallelDims(world_size=2, ep=2), ["ring"], r"no strategy named 'ring'"),
        (
            ParallelDims(world_size=8, tp=8),
            ["tp_subgroup"],
            r"tp=8 does not divide the KDA heads \(4\)",
        ),
    ],
)
def test_a_bad_plan_is_refused_before_anything_changes(dims, plan, message):
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ParallelError, match=message):
        parallelize(model, _local_groups(dims, 0), plan)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_default_plan_applies_what_the_layout_sizes_in_order():
    dims = ParallelDims(world_size=4, tp=2, ep=4, dcp=2)
    model = _tiny()
    reports = parallelize(model, _local_groups(dims, 1))
    # Attention first (projections, then the MLA cache split), the experts last.
    assert [r.strategy for r in reports] == ["tp_subgroup", "dcp", "dep"]
    assert isinstance(model.model.layers[3].self_attn, DcpGatedMla)
    assert isinstance(model.model.layers[3].self_attn.o_proj, SubgroupLinear)
    assert isinstance(model.model.layers[1].mlp, DepMoE)


def test_a_users_strategy_registers_on_a_registry_of_its_own():
    calls = []

    def apply_mark(model, groups, *, log=None):
        calls.append(groups.rank)
        return TransformReport("mark", 0, 0)

    mine = default_registry().with_strategy(Strategy(name="mark", apply=apply_mark, order=5))
    assert "mark" in mine.names() and "mark" not in default_registry().names()
    dims = ParallelDims(world_size=2, ep=2)
    reports = parallelize(_tiny(), _local_groups(dims, 1), ["dep", "mark"], registry=mine)
    assert [r.strategy for r in reports] == ["mark", "dep"] and calls == [1]
    with pytest.raises(ParallelError, match="registered twice"):
        Registry((*mine.strategies, mine["mark"]))
    picky = mine.with_strategy(Strategy(name="solo", apply=apply_mark, order=50, conflicts={"dep"}))
    with pytest.raises(ParallelError, match=r"'solo' cannot be combined with \['dep'\]"):
        parallelize(_tiny(), _local_groups(dims, 0), ["dep", "solo"], registry=picky)


# Per layout: new tokens of each request per rank. DCP groups share their requests; one rank
# (TP + DEP) or one whole DCP group (DCP + DEP) has none at all.
LAYOUTS = {
    "tp+dep": (dict(tp=2, ep=4), {0: [5, 2], 1: [3], 2: [6, 1, 2], 3: []}),
    "dcp+dep": (dict(dcp=2, ep=4), {0: [7, 3], 1: [7, 3], 2: [], 3: []}),
    "tp+dep/2": (dict(tp=2, ep=2), {0: [4, 2], 1: []}),
    "dcp+dep/2": (dict(dcp=2, ep=2), {0: [6, 9], 1: [6, 9]}),
}


def _composed(rank, world, name):
    degrees, requests = LAYOUTS[name]
    groups = ParallelGroups.build(ParallelDims(world_size=world, **degrees))
    reference, model = _tiny(), _tiny()
    log = CommLog()
    reports = parallelize(model, groups, log=log)
    lens = requests[rank]
    gen = torch.Generator().manual_seed(7 + rank // max(degrees.get("dcp", 1), 1))
    diffs, states = [], {}
    steps = [(lens, False), ([2] * len(lens), True), ([1] * len(lens), True)]
    for seq_lens, extend in steps:
        if not seq_lens:  # idle: the empty forward keeps this rank's collectives in step
            out = model(
                torch.zeros(0, dtype=torch.long), ForwardBatch.build([]), model.empty_state(0)
            )
            assert out.logits.shape[0] == 0
            continue
        ids = torch.randint(3, 500, (sum(seq_lens),), generator=gen)
        logits = {}
        for key, net in (("ref", reference), ("par", model)):
            state = states[key] if extend else net.empty_state(len(seq_lens))
            batch = ForwardBatch.build(seq_lens, prefix_lens=state.num_tokens if extend else None)
            out = net(ids, batch, state)
            states[key], logits[key] = out.state, out.logits
        diffs.append((logits["par"] - logits["ref"]).abs().max().item())
    return [r.strategy for r in reports], diffs, dict(log.sent)


@pytest.mark.parametrize(
    ("name", "world"), [("tp+dep", 4), ("dcp+dep", 4), ("tp+dep/2", 2), ("dcp+dep/2", 2)]
)
def test_composed_strategies_give_the_single_process_logits(name, world):
    results = run_ranks(_composed, world, name, timeout=240)
    degrees, requests = LAYOUTS[name]
    for rank, (strategies, diffs, sent) in enumerate(results):
        assert strategies == (["tp_subgroup", "dep"] if "tp" in degrees else ["dcp", "dep"])
        assert len(diffs) == (3 if requests[rank] else 0)
        assert all(d < ATOL for d in diffs), (rank, diffs)
        if requests[rank] and world == 4:
            assert sent.get("dep.dispatch", 0) > 0


def _two_layouts(rank, world):
    """Two models with different layouts in one process, stepped in turns."""
    a_groups = ParallelGroups.build(ParallelDims(world_size=world, tp=world))
    b_groups = ParallelGroups.build(ParallelDims(world_size=world, ep=world))
    reference, a, b = _tiny(), _tiny(), _tiny()
    parallelize(a, a_groups)
    parallelize(b, b_groups)
    diffs = []
    for step in range(2):
        n = 3 + rank + step
        ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(rank + step))
        batch = ForwardBatch.build([n])
        want = reference(ids, batch, reference.empty_state(1)).logits
        for model in (a, b, a):
            diffs.append((model(ids, batch, model.empty_state(1)).logits - want).abs().max().item())
    return diffs, a_groups["tp"].handle is not b_groups["ep"].handle


def test_two_layouts_live_in_one_process():
    for diffs, distinct in run_ranks(_two_layouts, 2):
        assert distinct and len(diffs) == 6 and max(diffs) < ATOL
