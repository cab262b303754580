"""Sigmoid router and routed experts against per-token formulas written here."""

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.model.ops.moe import route, routed_experts


def _expected_route(x, weight, bias, top_k, groups, topk_groups, renorm, scaling):
    ids, weights = [], []
    experts = weight.shape[0]
    per = experts // groups
    for t in range(x.shape[0]):
        s = torch.sigmoid(weight @ x[t]).tolist()
        b = [s[e] + float(bias[e]) for e in range(experts)]
        group_score = [
            sum(sorted(b[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(groups)
        ]
        kept = sorted(range(groups), key=lambda g: (-group_score[g], g))[:topk_groups]
        allowed = [e for e in range(experts) if e // per in kept]
        chosen = sorted(allowed, key=lambda e: (-b[e], e))[:top_k]
        w = torch.tensor([s[e] for e in chosen])
        if renorm:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w * scaling)
    return torch.stack(weights), torch.tensor(ids)


@pytest.mark.parametrize("groups,topk_groups", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("renorm", [True, False])
def test_router_selection_and_weights(groups, topk_groups, renorm):
    gen = torch.Generator().manual_seed(groups)
    x = torch.randn(20, 24, generator=gen)
    weight = torch.randn(16, 24, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.3
    w, ids = route(x, weight, bias, 4, groups, topk_groups, renorm, 2.5)
    w_ref, ids_ref = _expected_route(x, weight, bias, 4, groups, topk_groups, renorm, 2.5)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, atol=1e-6)


def test_ties_go_to_the_lower_expert_index():
    x = torch.zeros(3, 8)  # every score is sigmoid(0) = 0.5
    w, ids = route(x, torch.randn(6, 8), torch.zeros(6), top_k=3)
    assert ids.tolist() == [[0, 1, 2]] * 3
    assert torch.allclose(w, torch.full((3, 3), 1 / 3))


def test_bias_changes_selection_but_not_weights():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0])
    w, ids = route(x, weight, bias, top_k=2, renormalize=False)
    assert (ids[:, 0] == 5).all()
    assert torch.allclose(w[:, 0], torch.sigmoid(x @ weight[5]))


def test_routed_experts_weighted_sum():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 10, generator=gen)
    w1, w3 = torch.randn(5, 6, 10, generator=gen), torch.randn(5, 6, 10, generator=gen)
    w2 = torch.randn(5, 10, 6, generator=gen)
    ids = torch.randint(0, 5, (7, 2), generator=gen)
    weights = torch.rand(7, 2, generator=gen)

    def glu(g, u):
        return F.silu(g) * u

    got = routed_experts(x, weights, ids, w1, w2, w3, glu)
    want = torch.stack(
        [
            sum(
                weights[t, j] * (w2[e] @ glu(w1[e] @ x[t], w3[e] @ x[t]))
                for j, e in enumerate(ids[t].tolist())
            )
            for t in range(7)
        ]
    )
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop(dtype):
    from tokenspeed.model.ops.moe import routed_experts_grouped

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, 16, generator=gen)
    w1, w3 = torch.randn(6, 8, 16, generator=gen), torch.randn(6, 8, 16, generator=gen)
    w2 = torch.randn(6, 16, 8, generator=gen)
    ids = torch.randint(0, 5, (13, 3), generator=gen)  # expert 5 gets no tokens
    weights = torch.rand(13, 3, generator=gen)

    def glu(g, u):
        return F.silu(g) * u

    args = [t.to(dtype) for t in (x,)] + [weights, ids] + [t.to(dtype) for t in (w1, w2, w3)]
    got = routed_experts_grouped(*args, glu)
    want = routed_experts(*args, glu)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_dense_experts_equal_the_loop():
    from tokenspeed.model.ops.moe import routed_experts_dense

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 12, generator=gen)
    w1, w3 = torch.randn(5, 7, 12, generator=gen), torch.randn(5, 7, 12, generator=gen)
    w2 = torch.randn(5, 12, 7, generator=gen)
    ids = torch.tensor([[0, 3], [1, 2], [4, 0], [3, 1]] * 2 + [[2, 4]])
    weights = torch.rand(9, 2, generator=gen)

    def glu(g, u):
        return F.silu(g) * u

    got = routed_experts_dense(x, weights, ids, w1, w2, w3, glu)
    assert torch.allclose(got, routed_experts(x, weights, ids, w1, w2, w3, glu), atol=1e-5)
