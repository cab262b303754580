"""Norms and activations against their formulas."""

import torch

from tokenspeed.model.ops.activation import silu_glu, situ_glu
from tokenspeed.model.ops.norm import gated_rms_norm, l2_norm, rms_norm


def test_rms_norm():
    x, w = torch.randn(4, 8), torch.rand(8)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(rms_norm(x, w, 1e-5), want, atol=1e-6)


def test_gated_rms_norm_runs_in_fp32():
    x, g, w = torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.rand(8)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(g)
    assert torch.allclose(gated_rms_norm(x, g, w, 1e-5), want, atol=1e-6)
    out = gated_rms_norm(x.bfloat16(), g.bfloat16(), w, 1e-5)
    assert out.dtype == torch.bfloat16


def test_l2_norm_adds_eps_inside_the_root():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    got = l2_norm(x, eps=1e-6)
    assert torch.allclose(got[0], torch.tensor([0.6, 0.8]), atol=1e-6)
    assert torch.equal(got[1], torch.zeros(2))


def test_silu_glu_and_situ_limits():
    g, u = torch.randn(50), torch.randn(50)
    assert torch.allclose(silu_glu(g, u), g * torch.sigmoid(g) * u)
    # Without the up cap, SiTU's gate branch is a soft-capped SiLU.
    big = torch.tensor([1e4])
    assert torch.allclose(situ_glu(big, torch.ones(1), 4.0, None), torch.tensor([4.0]))
