"""Fused Triton router against `reference.route`.

CPU: interpreter checks on exactly representable inputs (x and W on small dyadic grids, so
every logit is exact whatever the summation order, with many exact ties), where the
selections must equal the reference's; weights to 1e-6.
GPU: the same at K3 widths (7168 hidden, 896 experts, top-16), for bf16 and fp32 router
weights and grouped selection; random inputs where only near-ties may differ; CUDA graphs.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.model.ops.moe.gate import RouterTuning, route_fused, router_weight_for_kernel
from tokenspeed.model.ops.moe.reference import route

from .triton_interpreter import results_for


def dyadic_inputs(tokens, experts, dim, seed, device="cpu", dtype=torch.float32):
    """x in {-4..4}/8, W in {-4..4}/64, bias in {-8..8}/64: logits are exact in fp32 for any
    summation order (<= 17 significant bits), and repeated values give exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (tokens, dim), generator=gen) / 8
    w = torch.randint(-4, 5, (experts, dim), generator=gen) / 64
    w[1::7] = w[0]  # identical expert rows: exact logit ties
    bias = torch.randint(-8, 9, (experts,), generator=gen) / 64
    bias[1::7] = bias[0]
    return x.to(device, dtype), w.to(device), bias.to(device)


def check_against_reference(x, w, bias, top_k, groups, topk_groups, renorm, scaling, **kw):
    out = route_fused(x, w, bias, top_k, groups, topk_groups, renorm, scaling, **kw)
    ref_w, ref_ids = route(x, w.float(), bias, top_k, groups, topk_groups, renorm, scaling)
    assert torch.equal(out.ids.long(), ref_ids), (out.ids, ref_ids)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-6, rtol=1e-5)
    return out


def check_counts(out, first, num_local):
    ids = out.ids.reshape(-1).long()
    ranks = out.ranks.reshape(-1)
    local = (ids >= first) & (ids < first + num_local)
    want = torch.bincount(ids[local] - first, minlength=num_local)
    assert torch.equal(out.counts.long().cpu(), want.cpu())
    assert (ranks[~local] == -1).all()
    # Inside each expert the ranks are a permutation of 0..count-1.
    expert, rank = ids[local] - first, ranks[local].long()
    order = torch.argsort(expert * (ids.numel() + 1) + rank)
    start = torch.cumsum(want, 0) - want
    expected = torch.arange(order.numel(), device=ids.device) - start[expert[order]]
    assert torch.equal(rank[order], expected)


# ---------------------------------------------------------------- interpreter checks


def _case_selection(groups, topk_groups, renorm):
    def case():
        x, w, bias = dyadic_inputs(20, 32, 24, seed=groups)
        check_against_reference(x, w, bias, 4, groups, topk_groups, renorm, 2.5)

    return case


def _case_top16():
    x, w, _ = dyadic_inputs(6, 96, 16, seed=5)
    out = check_against_reference(x, w, None, 16, 1, 1, True, 1.0)
    check_counts(out, 0, 96)


def _case_all_ties():
    x = torch.zeros(3, 8)
    out = check_against_reference(x, torch.randn(16, 8), torch.zeros(16), 3, 4, 2, True, 1.0)
    assert out.ids.tolist() == [[0, 1, 2]] * 3


def _case_local_counts():
    x, w, bias = dyadic_inputs(12, 32, 16, seed=7)
    out = check_against_reference(x, w, bias, 6, 1, 1, True, 1.0, first_expert=8, num_local=12)
    check_counts(out, 8, 12)


def _case_precomputed_logits():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 20, generator=gen), torch.randn(24, 20, generator=gen)
    bias = torch.randn(24, generator=gen) * 0.1
    logits = x @ w.t()
    out = route_fused(x, w, bias, 5, logits=logits)
    ref_w, ref_ids = route(x, w, bias, 5)
    assert torch.equal(out.ids.long(), ref_ids)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-6, rtol=1e-5)


def _case_fp16_weight():
    x, w, bias = dyadic_inputs(10, 32, 32, seed=9)
    out = route_fused(x.half(), w.half(), bias, 4)
    ref_w, ref_ids = route(x, w, bias, 4)
    assert torch.equal(out.ids.long(), ref_ids)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-6, rtol=1e-5)


def _case_tuned_logits():
    # Three K splits of 16-wide steps, 16 x 16 tiles: exact dyadic logits in another order.
    x, w, bias = dyadic_inputs(20, 32, 48, seed=11)
    tuning = RouterTuning(block_t=16, block_e=16, block_k=16, splits=3, num_warps=2)
    check_against_reference(x, w, bias, 4, 4, 2, True, 1.0, tuning=tuning)


CASES = {
    "tuned-logits-splits-3": _case_tuned_logits,
    "selection-g1": _case_selection(1, 1, True),
    "selection-g4-keep2-norenorm": _case_selection(4, 2, False),
    "selection-g8-keep3": _case_selection(8, 3, True),
    "top16-of-96": _case_top16,
    "all-ties": _case_all_ties,
    "local-counts-and-ranks": _case_local_counts,
    "precomputed-logits": _case_precomputed_logits,
    "fp16-weight": _case_fp16_weight,
}


@pytest.fixture(scope="module")
def interpreter_results():
    return results_for(__name__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_router_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] is None, interpreter_results[case]


def test_router_weight_copy_is_bf16_only_when_exact():
    exact = torch.randn(8, 16).bfloat16().float()
    assert router_weight_for_kernel(exact).dtype == torch.bfloat16
    assert torch.equal(router_weight_for_kernel(exact).float(), exact)
    inexact = exact + 1e-4
    assert router_weight_for_kernel(inexact) is inexact


def test_router_rejects_bad_groups_and_logits():
    x, w = torch.zeros(2, 8), torch.zeros(12, 8)
    with pytest.raises(ValueError, match="groups"):
        route_fused(x, w, None, 2, num_groups=5)
    with pytest.raises(ValueError, match="top_k"):
        route_fused(x, w, None, 7, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="logits"):
        route_fused(x, w, None, 2, logits=torch.zeros(3, 12))


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_t", 8),
        ("block_e", 48),
        ("block_k", 0),
        ("splits", 0),
        ("num_warps", 3),
        ("num_stages", 0),
    ],
    ids=str,
)
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterTuning(**{field: value})


def test_tuning_defaults_by_shape():
    """K3's router (896 experts, 7168 wide, bf16 weight) on 132 SMs: decode batches split K
    in 8 (>= 4 K steps of 128 each; 16 of 64-wide steps for an fp32 weight), prefill batches
    not at all."""
    assert RouterTuning() == RouterTuning(
        block_t=None, block_e=None, block_k=None, splits=None, num_warps=4, num_stages=None
    )
    assert len(attrs.fields(RouterTuning)) == 6  # a new knob needs its default pinned here
    assert RouterTuning().resolve(16, 896, 7168, True, 132) == (16, 32, 128, 8, 896, 4, 4)
    assert RouterTuning().resolve(64, 896, 7168, True, 132) == (64, 64, 128, 8, 896, 4, 4)
    assert RouterTuning().resolve(16384, 896, 7168, True, 132) == (64, 128, 128, 1, 7168, 4, 4)
    assert RouterTuning().resolve(16, 896, 7168, False, 132) == (16, 32, 64, 16, 448, 4, 3)
    # Given splits are rounded to whole K steps: 3 splits of 7168 take 2432 columns each.
    given = RouterTuning(splits=3, num_stages=2, block_t=32).resolve(16, 896, 7168, True, 132)
    assert given == (32, 32, 128, 3, 2432, 4, 2)


def test_tuning_reaches_the_launch(monkeypatch):
    from tokenspeed.model.ops.moe import gate

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, kw))

    monkeypatch.setattr(gate, "_logits_kernel", Spy())
    x, w = torch.zeros(20, 1024), torch.zeros(48, 1024)
    gate.router_logits(x, w)  # 4 stand-in SMs: one tile in 4 K splits covers them twice
    grid, kw = seen[-1]
    assert grid == (1, 1, 4) and (kw["BT"], kw["BE"], kw["BK"]) == (32, 64, 64)
    assert (kw["num_warps"], kw["num_stages"]) == (4, 3)
    tuning = RouterTuning(block_t=16, block_e=16, block_k=32, splits=4, num_warps=8, num_stages=2)
    out = gate.router_logits(x, w, tuning=tuning)
    grid, kw = seen[-1]
    assert out.shape == (4, 20, 48) and grid == (2, 3, 4)
    assert (kw["BT"], kw["BE"], kw["BK"], kw["num_warps"], kw["num_stages"]) == (16, 16, 32, 8, 2)
    with pytest.raises(TypeError, match="RouterTuning"):
        gate.router_logits(x, w, tuning={"splits": 2})


# ---------------------------------------------------------------- GPU (K3 widths)

K3 = {"experts": 896, "dim": 7168, "top_k": 16}


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups,topk_groups", [(1, 1), (8, 4)])
def test_router_k3_exact_inputs_identical(weight_dtype, groups, topk_groups):
    # Exact logits -> the selections (with many exact ties) must equal the reference's.
    x, w, bias = dyadic_inputs(
        1024, K3["experts"], K3["dim"], seed=11, device="cuda", dtype=torch.bfloat16
    )
    out = check_against_reference(
        x, w.to(weight_dtype), bias, K3["top_k"], groups, topk_groups, True, 2.5
    )
    check_counts(out, 0, K3["experts"])


@pytest.mark.gpu
def test_router_k3_random_inputs():
    # Different fp32 summation orders may flip only near-ties: tokens whose reference
    # biased scores at places k and k+1 differ by < 1e-4. With the reference's own logits
    # (`logits=`), every selection must be identical.
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, K3["dim"], device="cuda", generator=gen).bfloat16()
    w = (torch.randn(K3["experts"], K3["dim"], device="cuda", generator=gen) * 0.02).float()
    bias = torch.randn(K3["experts"], device="cuda", generator=gen) * 0.05
    ref_w, ref_ids = route(x, w, bias, K3["top_k"])
    logits = x.float() @ w.t()
    same = route_fused(x, w, bias, K3["top_k"], logits=logits)
    assert torch.equal(same.ids.long(), ref_ids)
    torch.testing.assert_close(same.weights, ref_w, atol=1e-6, rtol=1e-5)

    out = route_fused(x, router_weight_for_kernel(w), bias, K3["top_k"])
    choice = (torch.sigmoid(logits) + bias).sort(-1, descending=True).values
    margin = choice[:, K3["top_k"] - 1] - choice[:, K3["top_k"]]
    differ = (out.ids.long().sort(-1).values != ref_ids.sort(-1).values).any(-1)
    assert not (differ & (margin > 1e-4)).any()
    assert differ.float().mean() < 0.01
    rows = ~differ
    torch.testing.assert_close(out.weights[rows], ref_w[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_router_cuda_graph_replay():
    x, w, bias = dyadic_inputs(
        64, K3["experts"], K3["dim"], seed=2, device="cuda", dtype=torch.bfloat16
    )
    w = w.bfloat16()
    eager = route_fused(x, w, bias, K3["top_k"])
    static_x = x.clone()
    route_fused(static_x, w, bias, K3["top_k"])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_fused(static_x, w, bias, K3["top_k"])
    static_x.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(captured.ids, eager.ids.flip(0))
    assert torch.equal(captured.counts, eager.counts)  # counts are zeroed inside the graph
