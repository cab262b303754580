"""The Gluon FP8 down GEMM (Hopper only) against the Triton FP8 path and the references.

Gluon has no CPU interpreter, so the kernel tests need an sm_90 GPU; the shape checks and the
dispatch rule run everywhere. The Gluon kernel runs the same MMA shapes per 128-K step and the
same promotion formula as the Triton kernel, so it is held to the Triton path within 1e-3
relative RMS, and to the quantise-dequantise emulation within the FP8 tolerance of
test_moe_experts.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.model.ops.moe import experts as moe_experts
from tokenspeed.model.ops.moe.align import PairLayout
from tokenspeed.model.ops.moe.experts import ExpertWeights, fused_experts
from tokenspeed.model.ops.moe.fp8 import quantize_fp8_blocks
from tokenspeed.model.ops.norm import rms_norm

from .test_moe_experts import K3, fp8_reference, k3_problem, local_reference, make_glu, rel_rms

gluon_fp8 = pytest.importorskip("tokenspeed.model.ops.moe.gluon_fp8")
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel targets sm_90 (Hopper) only",
)
LARGE = moe_experts.default_config("fp8", 1e9)  # the large-batch entry: Gluon down GEMM on


def _fp8(w1, w2, w3):
    (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
    return ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)


def _layout(block_m):
    one = torch.zeros(1, dtype=torch.int32)
    return PairLayout(one, one, one, one, one, one, block_m)


def test_gluon_is_on_exactly_for_the_fp8_entries_with_block_m_64():
    for fmt in ("dense", "fp8", "mxfp4"):
        for rows in (1, 16, 64, 96, 1e9):
            config = moe_experts.default_config(fmt, rows)
            assert config.gluon == (fmt == "fp8" and config.block_m == gluon_fp8.BM)
    assert LARGE.gluon
    # CPU tensors never take the Gluon kernel, whatever the config says.
    experts = _fp8(torch.randn(2, 256, 512), torch.randn(2, 512, 256), torch.randn(2, 256, 512))
    assert not moe_experts._gluon_down(torch.zeros(1, 512), experts, LARGE, torch.bfloat16)


@pytest.mark.parametrize(
    ("block_m", "width", "inter", "why"),
    [(16, 512, 256, "BLOCK_M"), (64, 384, 256, "L % 256"), (64, 512, 192, "I % 128")],
)
def test_down_rejects_shapes_its_tiles_do_not_cover(block_m, width, inter, why):
    assert not gluon_fp8.applies(width, inter, block_m), why
    w2 = torch.zeros(2, width, inter).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="Gluon FP8 down GEMM"):
        gluon_fp8.down_fp8(None, None, _layout(block_m), w2, None, None, programs=1)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_gluon_matches_triton_fp8_and_emulation(activation):
    x, w1, w2, w3, ids, weights = k3_problem(4096, seed=11)
    experts = _fp8(w1, w2, w3)
    kw = dict(activation=activation, linear_beta=25.0 if activation == "situ" else None)
    assert moe_experts._gluon_down(x, experts, LARGE, torch.bfloat16)
    got = fused_experts(x, weights, ids, experts, config=LARGE, **kw)
    triton_path = fused_experts(
        x, weights, ids, experts, config=attrs.evolve(LARGE, gluon=False), **kw
    )
    assert rel_rms(got, triton_path) <= 1e-3
    local = ids < K3["local"]
    w_local, ids_local = torch.where(local, weights, 0.0), torch.where(local, ids, 0)
    emulated = fp8_reference(
        x.float(),
        w_local,
        ids_local,
        experts.w1,
        experts.s1,
        experts.w2,
        experts.s2,
        experts.w3,
        experts.s3,
        activation,
        round_dtype=torch.bfloat16,
    )
    assert rel_rms(got, emulated) <= 2e-2


@pytest.mark.gpu
@hopper
def test_gluon_all_local_with_norm_and_graph_replay():
    # Non-EP shape: 8 experts all local, top-2, ~256 rows per expert, latent RMSNorm fused.
    x, w1, w2, w3, _, _ = k3_problem(1024, seed=3)
    w1, w2, w3 = w1[:8].contiguous(), w2[:8].contiguous(), w3[:8].contiguous()
    experts = _fp8(w1, w2, w3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.rand(1024, 8, device="cuda", generator=gen).argsort(-1)[:, :2].int()
    weights = torch.rand(1024, 2, device="cuda", generator=gen)
    norm_w = (torch.rand(K3["width"], device="cuda", generator=gen) + 0.5).bfloat16()

    def run():
        return fused_experts(
            x,
            weights,
            ids,
            experts,
            activation="situ",
            linear_beta=25.0,
            norm_weight=norm_w,
            config=LARGE,
        )

    got = run()
    exact = rms_norm(
        local_reference(x, weights, ids.long(), w1, w2, w3, make_glu("situ")), norm_w, 1e-6
    )
    assert rel_rms(got, exact) <= 0.15
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.gpu
@hopper
def test_gluon_with_no_local_pairs_gives_zeros():
    # Every id is another rank's expert: no block in use, so no program has a tile.
    x, w1, w2, w3, ids, weights = k3_problem(256, seed=4)
    experts = _fp8(w1, w2, w3)
    got = fused_experts(x, weights, ids + K3["local"], experts, config=LARGE)
    torch.cuda.synchronize()
    assert not got.float().abs().sum().item()
