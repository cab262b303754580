"""The closed forms of `parallel.accounting` against hand-computed cases, the transformed tiny
model's tensors, the loader's footprint and the issue's formulas; docs/perf/parallel.md is the
benchmark's rendering of them (no number typed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.loader import weight_footprint
from tokenspeed.parallel.accounting import (
    CHECKPOINT,
    GB,
    Layout,
    Precision,
    comm_bytes_per_token,
    dep_layer_bytes,
    dep_rows_per_token,
    matrix_bytes,
    request_cache,
    requests_that_fit,
    table,
    tp_subgroup_layer_bytes,
    tp_subgroup_pair_bytes,
    tp_subgroup_projection_bytes,
    weight_bytes,
    weight_numel,
)
from tokenspeed.parallel.dep import apply_dep
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.tp_subgroup import apply_tp_subgroup

ROOT = Path(__file__).resolve().parents[2]
BF16 = Precision("bf16", routed="bf16")


def test_matrix_bytes_by_hand():
    assert matrix_bytes(3, 64, "bf16") == 384
    assert matrix_bytes(3, 64, "fp32") == 768
    assert matrix_bytes(3, 64, "mxfp4") == 3 * (32 + 2)  # codes + one scale per 32
    assert matrix_bytes(3, 64, "nvfp4") == 3 * (32 + 4) + 4  # + one fp8 per 16, fp32 global
    assert matrix_bytes(200, 300, "fp8") == 60_000 + 4 * 2 * 3  # fp32 per 128x128 block
    with pytest.raises(ValueError, match="unknown format"):
        matrix_bytes(1, 1, "int4")


@pytest.mark.parametrize(("preset", "experts"), [("tiny", "dense"), ("kimi-k3", "mxfp4")])
def test_replicated_weight_bytes_are_the_loaders_footprint(preset, experts):
    config = get_preset(preset)
    precision = BF16 if experts == "dense" else CHECKPOINT
    footprint = weight_footprint(config, torch.bfloat16, experts)
    assert weight_bytes(config, Layout("one"), precision) == footprint.nbytes
    if experts == "dense":
        assert weight_numel(config, Layout("one")) == footprint.num_params


def _groups(world: int, rank: int, *, ep: int = 1, tp: int = 1) -> ParallelGroups:
    dims = ParallelDims(world_size=world, ep=ep, tp=tp)
    groups = {}
    for kind in ("tp", "ep", "tep", "dcp", "dwdp"):
        size = getattr(dims, kind)
        first = rank // size * size
        groups[kind] = Group(None, tuple(range(first, first + size)), rank)
    return ParallelGroups(dims, rank, torch.device("cpu"), groups)


@pytest.mark.parametrize(
    ("world", "tp", "ep"), [(2, 2, 1), (4, 4, 1), (2, 1, 2), (4, 1, 4), (4, 2, 4)]
)
def test_per_rank_weights_are_the_transformed_models(world, tp, ep):
    config = get_preset("tiny")
    for rank in range(world):
        with torch.device("meta"):
            model = KimiForCausalLM(config)
        groups = _groups(world, rank, ep=ep, tp=tp)
        if ep > 1:
            apply_dep(model, groups)
        if tp > 1:
            apply_tp_subgroup(model, groups)
        numel = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
        assert weight_numel(config, Layout("x", tp=tp, ep=ep)) == numel


def test_tp_subgroup_bytes_match_the_issues_closed_form_and_hand_counts():
    for tp in (2, 4, 8):
        for h in (64, 7168):
            closed = ((tp - 1) + (tp - 1) / tp) * h * 2
            assert tp_subgroup_pair_bytes(h, tp) == closed
            assert tp_subgroup_projection_bytes(h, h, tp) == closed
    config = get_preset("tiny")  # H 64; KDA 4 heads x 16; MLA q_a 32, latent 48, v 4 x 16
    # Layer 0, KDA + dense MLP, T = 2: one gather of the hidden (64) for q/k/v/f_a/b/g, their
    # outputs 64 x 4 + 16 + 4 returned by half; o_proj gathers 64 and returns half of 64.
    assert tp_subgroup_layer_bytes(config, 0, 2) == (64 + 276 / 2 + 64 + 64 / 2) * 2
    # Without the shared gather each hidden reader gathers its own copy (6 of them).
    assert (
        tp_subgroup_layer_bytes(config, 0, 2, share_gather=False)
        == (6 * 64 + 276 / 2 + 64 + 64 / 2) * 2
    )
    # Layer 3, MLA + MoE: q_a/kv_a/g share the hidden gather (outputs 32 + 48 + 64), o_proj
    # (64 -> 64) like the issue's square form, shared experts: gate/up share one gather (2 x 32
    # out), down gathers 32 and returns 64.
    assert (
        tp_subgroup_layer_bytes(config, 3, 2)
        == (64 + 144 / 2 + tp_subgroup_pair_bytes(64, 2) / 2 + 64 + 64 / 2 + 32 + 64 / 2) * 2
    )
    assert tp_subgroup_layer_bytes(config, 3, 1) == 0


def test_dep_rows_and_bytes_against_the_issues_bound():
    tiny, k3 = get_preset("tiny"), get_preset("kimi-k3")  # K = 4 of 16; K = 16 of 896
    assert [dep_rows_per_token(tiny, r) for r in (1, 2, 4)] == [0, 1, 3]
    # Uniform routing: a given remote rank holds none of the K experts with C(E-E/R,K)/C(E,K).
    assert dep_rows_per_token(tiny, 2, expected=True) == pytest.approx(1 - 70 / 1820)
    for ep in (8, 16, 32):
        rows = dep_rows_per_token(k3, ep)
        assert rows <= k3.moe.top_k and dep_rows_per_token(k3, ep, expected=True) < rows
        dispatch, combine = dep_layer_bytes(k3, ep, metadata=False)
        assert dispatch + combine <= 2 * k3.moe.top_k * k3.moe.latent_size * 2
    # Equality when every expert is remote on distinct ranks: possible once R - 1 >= K.
    dispatch, combine = dep_layer_bytes(k3, 32, metadata=False)
    assert dispatch + combine == 2 * 16 * 3584 * 2
    # Metadata: K fp32 weights + K int32 ids a row, plus an fp32 scale with FP8 rows.
    assert dep_layer_bytes(k3, 32)[0] == 16 * (3584 * 2 + 8 * 16)
    assert dep_layer_bytes(k3, 32, payload_bytes=1)[0] == 16 * (3584 + 8 * 16 + 4)
    # A whole forward: 92 MoE layers.
    assert comm_bytes_per_token(k3, Layout("d", ep=32)) == 92 * sum(dep_layer_bytes(k3, 32))


def test_dep_expected_rows_match_sampled_routing():
    config = get_preset("tiny")
    gen = torch.Generator().manual_seed(0)
    tokens, ep, per = 20_000, 4, 4
    ids = torch.rand(tokens, 16, generator=gen).argsort(dim=1)[:, :4]
    ranks = ids // per
    owner = torch.randint(0, ep, (tokens, 1), generator=gen)
    hit = torch.zeros(tokens, ep, dtype=torch.bool).scatter_(1, ranks, True)
    remote = (hit.sum(1) - hit.gather(1, owner).squeeze(1).long()).float().mean().item()
    assert remote == pytest.approx(dep_rows_per_token(config, ep, expected=True), rel=0.01)


def test_request_cache_and_fit_by_hand():
    k3 = get_preset("kimi-k3")
    cache = request_cache(k3, 200_000)
    assert cache.mla == 200_000 * 576 * 24
    assert cache.drafter == 200_000 * 576
    assert cache.kda_checkpoints == 2 * 69 * (3 * 12288 * 3 + 96 * 128 * 128) * 2
    assert cache.live_kda == 69 * (3 * 12288 * 3 * 2 + 96 * 128 * 128 * 4)
    assert cache.total == cache.mla + cache.drafter + cache.kda_checkpoints
    assert requests_that_fit(200 * GB, 3 * GB) == 19  # (298 - 40 - 200) / 3 = 19.3
    assert requests_that_fit(270 * GB, 3 * GB) == 0


def test_k3_table_rows_come_from_the_closed_forms():
    k3 = get_preset("kimi-k3")
    rows = {(r.layout.name, r.precision.routed): r for r in table(k3)}
    dep32 = rows[("DEP32", "mxfp4")]
    assert dep32.weight_bytes == weight_bytes(k3, Layout("DEP32", ep=32), CHECKPOINT)
    assert dep32.requests == requests_that_fit(dep32.weight_bytes, request_cache(k3).total)
    assert rows[("replicated", "mxfp4")].requests == 0  # 1.5 TB of weights
    # The routed experts dominate: DEP divides them, the TP subgroups do not.
    assert dep32.weight_bytes < rows[("DEP16", "mxfp4")].weight_bytes < 300 * GB
    assert rows[("TP8 subgroups", "mxfp4")].weight_bytes > 1000 * GB


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "parallel_memory", ROOT / "benchmarks" / "parallel_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_benchmarks_rendering():
    page = (ROOT / "docs" / "perf" / "parallel.md").read_text()
    date = next(line for line in page.splitlines() if line.startswith("- Date: "))
    date = date.removeprefix("- Date: ").split(" ")[0]
    assert page == _benchmark().render(get_preset("kimi-k3"), date)
    assert len(page.splitlines()) <= 150
