"""Triton grouped experts (`fused_experts`) against the torch references.

References: `reference.routed_experts` over the local experts (ids outside the layer's slice
count as absent). FP8: the same reference on the quantise-dequantise emulation (weights in
128 x 128 blocks, activations and the GLU output in 1 x 128 groups), so the kernel differs
only by accumulation order and roundings. MXFP4: the reference on the decoded weights.

CPU interpreter: tiny shapes in fp32 / fp16 (tolerance 1e-5 relative to the output scale;
fp16 1e-3). GPU: K3 widths (latent 3584, intermediate 3072, 56 local experts of 896, top-16)
in bf16 with relative RMS error <= 1e-2 and max error <= 5% of the output's max.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.model.ops.activation import silu_glu, situ_glu
from tokenspeed.model.ops.moe.align import align_pairs, count_pairs
from tokenspeed.model.ops.moe.combine import CombineTuning
from tokenspeed.model.ops.moe.experts import (
    ExpertWeights,
    GemmTile,
    MoeKernelConfig,
    default_config,
    fused_experts,
)
from tokenspeed.model.ops.moe.fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    quantize_fp8_blocks,
    quantize_fp8_rows_reference,
)
from tokenspeed.model.ops.moe.mxfp4 import decode_mxfp4, quantize_mxfp4
from tokenspeed.model.ops.moe.overlap import SideStream
from tokenspeed.model.ops.moe.reference import route, routed_experts
from tokenspeed.model.ops.norm import rms_norm

from .triton_interpreter import results_for


def make_glu(activation):
    if activation == "silu":
        return silu_glu
    return lambda g, u: situ_glu(g, u, 4.0, 25.0)


def local_reference(x, weights, ids, w1, w2, w3, glu, first=0):
    """routed_experts over experts [first, first + E): other ids contribute nothing."""
    num_local = w1.shape[0]
    local = (ids >= first) & (ids < first + num_local)
    return routed_experts(
        x, torch.where(local, weights, 0.0), torch.where(local, ids - first, 0), w1, w2, w3, glu
    )


def random_problem(
    tokens, top_k, experts, width, inter, seed, device="cpu", dtype=torch.float32, num_local=None
):
    gen = torch.Generator().manual_seed(seed)
    num_local = num_local or experts
    x = torch.randn(tokens, width, generator=gen)
    w1 = torch.randn(num_local, inter, width, generator=gen) / width**0.5
    w3 = torch.randn(num_local, inter, width, generator=gen) / width**0.5
    w2 = torch.randn(num_local, width, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    cast = [t.to(device, dtype) for t in (x, w1, w2, w3)]
    return (*cast, ids.to(device, torch.int32), weights.to(device))


def assert_close_scaled(got, want, rel):
    """max |got - want| <= rel * max |want| (outputs of sums of experts have one scale)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rel * scale, f"max error {err} > {rel} * {scale}"


# ---------------------------------------------------------------- interpreter checks


def _case_dense(dtype, activation, first=0, num_local=None, norm=False, config=None):
    def case():
        x, w1, w2, w3, ids, weights = random_problem(
            8, 3, 8, 32, 48, seed=1, dtype=dtype, num_local=num_local
        )
        experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3, first_expert=first)
        norm_w = torch.rand(32).to(dtype) + 0.5 if norm else None
        got = fused_experts(
            x,
            weights,
            ids,
            experts,
            activation=activation,
            linear_beta=25.0 if activation == "situ" else None,
            norm_weight=norm_w,
            config=config,
        )
        want = local_reference(x, weights, ids.long(), w1, w2, w3, make_glu(activation), first)
        if norm:
            want = rms_norm(want, norm_w, 1e-6)
        assert got.dtype == dtype
        assert_close_scaled(got, want, 1e-5 if dtype == torch.float32 else 1e-3)

    return case


def _case_padding_ids():
    x, w1, w2, w3, ids, weights = random_problem(6, 2, 4, 32, 32, seed=2)
    ids[::2, 1] = -1  # dropped slots (e.g. padding from a dispatcher)
    got = fused_experts(x, weights, ids, ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3))
    want = local_reference(x, weights, ids.long(), w1, w2, w3, silu_glu)
    assert_close_scaled(got, want, 1e-5)


def _case_fused_gate_up_views():
    # w1 / w3 as the two halves of one [E, 2I, L] gate_up tensor (transformers' layout): views
    # with an expert stride of 2 I L, read in place.
    x, w1, w2, w3, ids, weights = random_problem(8, 3, 8, 32, 48, seed=7)
    gate_up = torch.cat([w1, w3], dim=1)
    experts = ExpertWeights(format="dense", w1=gate_up[:, :48], w2=w2, w3=gate_up[:, 48:])
    assert not experts.w1.is_contiguous()
    got = fused_experts(x, weights, ids, experts, activation="situ", linear_beta=25.0)
    want = local_reference(x, weights, ids.long(), w1, w2, w3, make_glu("situ"))
    assert_close_scaled(got, want, 1e-5)


def _case_router_pipeline():
    # route_fused's counts/ranks feed fused_experts directly (no count launch).
    from tokenspeed.model.ops.moe.gate import route_fused

    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(10, 16, generator=gen)
    gate = torch.randn(8, 16, generator=gen)
    x, w1, w2, w3, _, _ = random_problem(10, 2, 8, 32, 32, seed=4)
    r = route_fused(hidden, gate, None, 3)
    got = fused_experts(
        x,
        r.weights,
        r.ids,
        ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3),
        counts=r.counts,
        ranks=r.ranks,
    )
    weights, ids = route(hidden, gate, None, 3)
    assert_close_scaled(got, routed_experts(x, weights, ids, w1, w2, w3, silu_glu), 1e-5)


def _case_align_layout():
    ids = torch.tensor([[3, 1], [1, 7], [3, 3], [0, 1], [5, 2]], dtype=torch.int32)
    counts, ranks = count_pairs(ids, first_expert=1, num_local=4)  # experts 1..4 are local
    assert counts.tolist() == [3, 1, 3, 0]
    layout = align_pairs(ids, ranks, counts, first_expert=1, block_m=4, max_pairs=10)
    assert layout.expert_start.tolist() == [0, 4, 8, 12]
    assert int(layout.num_blocks) == 3
    assert layout.block_expert.tolist()[:3] == [0, 1, 2]
    assert all(b == -1 for b in layout.block_expert.tolist()[3:])
    flat = ids.reshape(-1).tolist()
    for pair, row in enumerate(layout.pair_row.tolist()):
        if 1 <= flat[pair] <= 4:
            seg = layout.expert_start[flat[pair] - 1].item()
            assert seg <= row < seg + counts[flat[pair] - 1].item()
            assert layout.row_pair[row].item() == pair
        else:
            assert row == -1


def _case_align_many_programs():
    # 64 local experts of 128, 300 tokens x top-8: 2400 pairs over many align programs (each
    # takes 4096 // 64 = 64 pairs), so segments and blocks are labelled across programs.
    gen = torch.Generator().manual_seed(5)
    ids = torch.rand(300, 128, generator=gen).argsort(-1)[:, :8].int()
    counts, ranks = count_pairs(ids, first_expert=0, num_local=64)
    layout = align_pairs(ids, ranks, counts, first_expert=0, block_m=8, max_pairs=ids.numel())
    padded = (counts + 7) // 8 * 8
    start = torch.cumsum(padded, 0) - padded
    assert torch.equal(layout.expert_start, start.int())
    assert int(layout.num_blocks) == int(padded.sum()) // 8
    blocks = torch.repeat_interleave(torch.arange(64), padded // 8)
    assert torch.equal(layout.block_expert[: len(blocks)], blocks.int())
    assert (layout.block_expert[len(blocks) :] == -1).all()
    flat = ids.reshape(-1).long()
    local = flat < 64
    rows = layout.pair_row.long()
    assert (rows[~local] == -1).all()
    assert torch.equal(layout.row_pair[rows[local]].long(), torch.nonzero(local).flatten())
    seg = start[flat[local]]
    assert ((rows[local] >= seg) & (rows[local] < seg + counts[flat[local]])).all()


def _case_fp8():
    x, w1, w2, w3, ids, weights = random_problem(6, 2, 4, 128, 256, seed=5)
    (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
    experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
    got = fused_experts(x, weights, ids, experts, activation="situ", linear_beta=25.0)
    assert_close_scaled(got, fp8_reference(x, weights, ids, q1, s1, q2, s2, q3, s3, "situ"), 1e-5)


def _case_fp8_wide_down():
    # Down tile of 256 columns: two weight blocks per tile, so a [1, BN] row of scales (the
    # narrower tiles load one scalar per K step).
    x, w1, w2, w3, ids, weights = random_problem(6, 2, 4, 256, 128, seed=8)
    (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
    experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
    config = MoeKernelConfig(
        block_m=16,
        gate_up=GemmTile(128, 128, 4, 2),
        down=GemmTile(256, 128, 4, 2),
        waves=1,
        gluon=False,
    )
    got = fused_experts(x, weights, ids, experts, config=config)
    assert_close_scaled(got, fp8_reference(x, weights, ids, q1, s1, q2, s2, q3, s3, "silu"), 1e-5)


def _case_mxfp4():
    x, w1, w2, w3, ids, weights = random_problem(7, 2, 4, 64, 96, seed=6)
    (p1, c1), (p2, c2), (p3, c3) = (quantize_mxfp4(w) for w in (w1, w2, w3))
    experts = ExpertWeights(format="mxfp4", w1=p1, w2=p2, w3=p3, s1=c1, s2=c2, s3=c3)
    got = fused_experts(x, weights, ids, experts)
    want = routed_experts(
        x,
        weights,
        ids.long(),
        decode_mxfp4(p1, c1),
        decode_mxfp4(p2, c2),
        decode_mxfp4(p3, c3),
        silu_glu,
    )
    assert_close_scaled(got, want, 1e-5)


def _combine_reference(y, pair_row, weights, norm_w=None):
    out = torch.zeros(weights.shape[0], y.shape[1])
    for j in range(weights.shape[1]):  # slot order, as the kernel sums
        live = pair_row[:, j] >= 0
        out[live] += weights[live, j, None] * y[pair_row[live, j].long()]
    return out if norm_w is None else rms_norm(out, norm_w, 1e-6)


def _combine_tuning(block_l):
    return CombineTuning(block_l=block_l)


def _case_combine(norm, block_l=None):
    # 13 tokens, 600 columns (with block_l 512: two column programs, the second partial),
    # dropped slots (-1) and a token with no local pair at all.
    def case():
        from tokenspeed.model.ops.moe.combine import combine

        gen = torch.Generator().manual_seed(11)
        y = torch.randn(40, 600, generator=gen)
        pair_row = torch.randint(0, 40, (13, 3), generator=gen, dtype=torch.int32)
        pair_row[torch.rand(13, 3, generator=gen) < 0.4] = -1
        pair_row[5] = -1  # zeros (or zeros through the norm)
        weights = torch.rand(13, 3, generator=gen)
        norm_w = torch.rand(600, generator=gen) + 0.5 if norm else None
        got = combine(y, pair_row, weights, torch.float32, norm_w, tuning=_combine_tuning(block_l))
        want = _combine_reference(y, pair_row, weights, norm_w)
        assert_close_scaled(got, want, 1e-6)
        assert torch.equal(got[5], torch.zeros(600))
        if norm:
            with pytest.raises(ValueError, match="whole rows"):
                combine(y, pair_row, weights, torch.float32, norm_w, tuning=_combine_tuning(512))

    return case


def _case_fp8_quantize_rows_exact():
    # Bit for bit against the torch reference, over programs that straddle rows (37 x 3 groups
    # in tiles of 32 groups, the last partial); amax 0 rows and e4m3 rounding carries included.
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_rows

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(37, 384, generator=gen) * torch.logspace(-3, 3, 37)[:, None]
    x[4] = 0.0
    x[7, :128] = 31.3  # rounds up into the next binade
    q, s = quantize_fp8_rows(x)
    q_ref, s_ref = quantize_fp8_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def fp8_reference(x, weights, ids, q1, s1, q2, s2, q3, s3, activation, round_dtype=None):
    """The reference on FP8-emulated operands, in fp32; round_dtype mimics the kernel's
    rounding of the GEMM outputs (bf16 on GPU)."""
    glu = make_glu(activation)

    def rnd(t):
        return t if round_dtype is None else t.to(round_dtype).float()

    def glu_q(g, u):
        h = rnd(glu(rnd(g), rnd(u)))
        return dequantize_fp8_rows(*quantize_fp8_rows_reference(h))

    xq = dequantize_fp8_rows(*quantize_fp8_rows_reference(x))
    return routed_experts(
        xq,
        weights,
        ids.long(),
        dequantize_fp8_blocks(q1, s1),
        dequantize_fp8_blocks(q2, s2),
        dequantize_fp8_blocks(q3, s3),
        glu_q,
    )


CASES = {
    "dense-fp32-silu": _case_dense(torch.float32, "silu"),
    "dense-fp16-situ-local": _case_dense(torch.float16, "situ", first=2, num_local=4),
    "dense-fp32-situ-norm": _case_dense(torch.float32, "situ", norm=True),
    "dense-fp32-blockm32": _case_dense(
        torch.float32,
        "silu",
        config=MoeKernelConfig(
            block_m=32, gate_up=GemmTile(32, 32, 4, 2), down=GemmTile(32, 16, 4, 2), waves=1
        ),
    ),
    "padding-ids": _case_padding_ids,
    "fused-gate-up-views": _case_fused_gate_up_views,
    "router-pipeline": _case_router_pipeline,
    "align-layout": _case_align_layout,
    "align-many-programs": _case_align_many_programs,
    "fp8-situ": _case_fp8,
    "fp8-wide-down": _case_fp8_wide_down,
    "mxfp4-silu": _case_mxfp4,
    "combine": _case_combine(norm=False),
    "combine-column-programs": _case_combine(norm=False, block_l=512),
    "combine-norm": _case_combine(norm=True),
    "fp8-quantize-rows-exact": _case_fp8_quantize_rows_exact,
}


@pytest.fixture(scope="module")
def interpreter_results():
    return results_for(__name__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] is None, interpreter_results[case]


def test_expert_weights_validate_shapes():
    w = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="w2"):
        ExpertWeights(format="dense", w1=w, w2=torch.zeros(2, 16, 4), w3=w)
    with pytest.raises(ValueError, match="s1"):
        ExpertWeights(
            format="mxfp4",
            w1=torch.zeros(2, 32, 16, dtype=torch.uint8),
            w2=torch.zeros(2, 32, 16, dtype=torch.uint8),
            w3=torch.zeros(2, 32, 16, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match="contiguous rows"):
        ExpertWeights(
            format="dense",
            w1=w.transpose(1, 2).contiguous().transpose(1, 2),
            w2=torch.zeros(2, 16, 8),
            w3=w,
        )
    fused = torch.zeros(2, 16, 16)
    ExpertWeights(format="dense", w1=fused[:, :8], w2=torch.zeros(2, 16, 8), w3=fused[:, 8:])
    with pytest.raises(ValueError, match="same strides"):
        ExpertWeights(format="dense", w1=fused[:, :8], w2=torch.zeros(2, 16, 8), w3=w)


# ---------------------------------------------------------------- GPU (K3 widths)

K3 = {"experts": 896, "local": 56, "top_k": 16, "width": 3584, "inter": 3072}


def k3_problem(tokens, seed=0, first=0):
    """K3-sized local expert slice with routing over all 896 experts; about tokens local
    pairs (each token has 16 slots, 1/16 of the experts are local)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width, inter, n = K3["width"], K3["inter"], K3["local"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    x = rnd(tokens, width)
    w1, w3 = rnd(n, inter, width, scale=width**-0.5), rnd(n, inter, width, scale=width**-0.5)
    w2 = rnd(n, width, inter, scale=inter**-0.5)
    ids = torch.rand(tokens, K3["experts"], device="cuda", generator=gen).argsort(-1)
    ids = ids[:, : K3["top_k"]].int()
    weights = torch.rand(tokens, K3["top_k"], device="cuda", generator=gen)
    return x, w1, w2, w3, ids, weights


def rel_rms(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ----------------------------------------------------------------------------- tuning knobs


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: MoeKernelConfig(block_m=8), "block_m"),
        (lambda: MoeKernelConfig(block_m=48), "block_m"),
        (lambda: MoeKernelConfig(gate_up=(64, 128, 4, 4)), "gate_up"),
        (lambda: MoeKernelConfig(down="256x64"), "down"),
        (lambda: MoeKernelConfig(waves=0), "waves"),
        (lambda: MoeKernelConfig(gluon=1), "gluon"),
        (lambda: MoeKernelConfig(fast_math="yes"), "fast_math"),
        (lambda: MoeKernelConfig(combine={"block_l": 512}), "combine"),
        (lambda: GemmTile(24, 64, 4, 3), "block_n"),
        (lambda: GemmTile(64, 8, 4, 3), "block_k"),
        (lambda: GemmTile(64, 64, 3, 3), "num_warps"),
        (lambda: GemmTile(64, 64, 4, 0), "num_stages"),
        (lambda: CombineTuning(block_l=600), "block_l"),
        (lambda: CombineTuning(num_warps=6), "num_warps"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_tuning_rejects_bad_knobs_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_kernel_config_defaults_are_the_measured_ones():
    """Everything by shape (the tile table, fast math by format); the table pinned."""
    assert MoeKernelConfig() == MoeKernelConfig(
        block_m=None,
        gate_up=None,
        down=None,
        waves=None,
        gluon=None,
        fast_math=None,
        combine=CombineTuning(block_l=None, num_warps=None),
    )
    assert len(attrs.fields(MoeKernelConfig)) == 7  # a new knob needs its default pinned here
    assert len(attrs.fields(CombineTuning)) == 2

    def entry(fmt, rows):
        c = default_config(fmt, rows)
        assert c == MoeKernelConfig().resolve(fmt, rows) and c.combine == CombineTuning()
        tile = lambda t: (t.block_n, t.block_k, t.num_warps, t.num_stages)  # noqa: E731
        return c.block_m, tile(c.gate_up), tile(c.down), c.waves, c.gluon, c.fast_math

    assert entry("dense", 16) == (16, (64, 128, 4, 4), (64, 128, 4, 4), 2, False, False)
    assert entry("dense", 96) == (64, (128, 64, 8, 3), (256, 64, 8, 3), 1, False, False)
    assert entry("dense", 97) == (128, (64, 64, 8, 4), (256, 64, 8, 4), 1, False, False)
    assert entry("fp8", 16) == (16, (128, 128, 4, 3), (128, 128, 4, 3), 2, False, True)
    assert entry("fp8", 96) == (64, (128, 128, 8, 3), (256, 128, 8, 3), 1, True, True)
    assert entry("fp8", 1e9) == (64, (128, 128, 8, 4), (256, 128, 8, 4), 1, True, True)
    assert entry("mxfp4", 16) == (16, (64, 256, 4, 3), (64, 256, 4, 3), 2, False, False)
    assert entry("mxfp4", 96) == (32, (64, 128, 4, 3), (128, 128, 4, 3), 2, False, False)
    assert entry("mxfp4", 97) == (64, (128, 64, 4, 3), (128, 64, 4, 3), 2, False, False)
    # Given knobs win; the others still come by shape.
    given = MoeKernelConfig(block_m=32, fast_math=False, gluon=False).resolve("fp8", 1e9)
    assert (given.block_m, given.fast_math, given.gluon, given.waves) == (32, False, False, 1)
    assert given.down == GemmTile(256, 128, 8, 4)
    # The combine: whole rows; 8 warps from 4096 columns, 4 from 1024, else one per 256.
    assert CombineTuning().resolve(3584) == (4096, 8)
    assert CombineTuning().resolve(600) == (1024, 4)
    assert CombineTuning().resolve(300) == (512, 2)
    assert CombineTuning(block_l=512, num_warps=1).resolve(3584) == (512, 1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        MoeKernelConfig().block_m = 16


class _Recorder:
    """Stands in for a kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))


def _expert_launches(monkeypatch, fmt, config=None):
    """fused_experts on the CPU with its kernels recorded (the layout's launches stubbed)."""
    from tokenspeed.model.ops.moe import combine as combine_mod
    from tokenspeed.model.ops.moe import experts as moe_experts
    from tokenspeed.model.ops.moe.align import PairLayout

    def align(ids, ranks, counts, first, block_m, max_pairs):
        rows = torch.zeros(4 * block_m, dtype=torch.int32)
        one = torch.zeros(4, dtype=torch.int32)
        return PairLayout(ids.flatten(), rows, one, one, one, one[:1], block_m)

    launches = {name: _Recorder() for name in ("up", "down", "combine")}
    monkeypatch.setattr(moe_experts, "align_pairs", align)
    monkeypatch.setattr(moe_experts.gg, "_gate_up_kernel", launches["up"])
    monkeypatch.setattr(moe_experts.gg, "_down_kernel", launches["down"])
    monkeypatch.setattr(combine_mod, "_combine_kernel", launches["combine"])
    x, w1, w2, w3, ids, weights = random_problem(6, 2, 4, 256, 128, seed=8)
    if fmt == "fp8":
        (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
        experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
        monkeypatch.setattr(
            moe_experts, "quantize_fp8_rows", lambda t: (t, torch.ones(t.shape[0], 2))
        )
    else:
        experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3)
    counts = torch.zeros(4, dtype=torch.int32)
    fused_experts(
        x, weights, ids, experts, counts=counts, ranks=counts, config=config, activation="situ"
    )
    return {name: spy.launches[0][1] for name, spy in launches.items()}


@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_default_config_gives_the_table_launches(fmt, monkeypatch):
    """12 pairs over 4 experts: the table's decode entry (BLOCK_M 16, its tiles fitted to the
    tiny widths) and whole-row combines. (fast_math reaches the kernels only on the GPU, where
    test_fast_math_is_the_fp8_default_and_stays_close_to_exact checks it.)"""
    kw = _expert_launches(monkeypatch, fmt)
    up = default_config(fmt, 3).gate_up
    assert (kw["up"]["BM"], kw["up"]["num_warps"], kw["up"]["num_stages"]) == (
        16,
        up.num_warps,
        up.num_stages,
    )
    assert kw["down"]["BM"] == 16
    assert (kw["combine"]["BL"], kw["combine"]["num_warps"]) == (256, 1)


def test_kernel_config_reaches_the_launches(monkeypatch):
    config = MoeKernelConfig(
        block_m=32,
        gate_up=GemmTile(32, 32, 2, 2),
        down=GemmTile(16, 16, 1, 3),
        waves=1,
        combine=CombineTuning(block_l=128, num_warps=2),
    )
    kw = _expert_launches(monkeypatch, "dense", config)
    assert (kw["up"]["BM"], kw["up"]["BN"], kw["up"]["BK"]) == (32, 32, 32)
    assert (kw["up"]["num_warps"], kw["up"]["num_stages"]) == (2, 2)
    assert (kw["down"]["BM"], kw["down"]["BN"], kw["down"]["BK"]) == (32, 16, 16)
    assert (kw["down"]["num_warps"], kw["down"]["num_stages"]) == (1, 3)
    assert (kw["combine"]["BL"], kw["combine"]["num_warps"]) == (128, 2)
    with pytest.raises(TypeError, match="MoeKernelConfig"):
        fused_experts(torch.zeros(2, 64), None, None, None, config={"block_m": 16})


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256, 2048])
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_grouped_bf16_k3(tokens, activation):
    x, w1, w2, w3, ids, weights = k3_problem(tokens, seed=tokens)
    experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3, first_expert=0)
    got = fused_experts(
        x,
        weights,
        ids,
        experts,
        activation=activation,
        linear_beta=25.0 if activation == "situ" else None,
    )
    want = local_reference(x, weights, ids.long(), w1, w2, w3, make_glu(activation))
    assert rel_rms(got, want) <= 1e-2
    assert_close_scaled(got, want, 5e-2)


@pytest.mark.gpu
def test_grouped_bf16_k3_all_experts_local_with_norm():
    # Non-EP shape: 8 experts all local, top-2, heavy rows per expert (prefill tiles).
    x, w1, w2, w3, _, _ = k3_problem(1024, seed=3)
    w1, w2, w3 = w1[:8].contiguous(), w2[:8].contiguous(), w3[:8].contiguous()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.rand(1024, 8, device="cuda", generator=gen).argsort(-1)[:, :2].int()
    weights = torch.rand(1024, 2, device="cuda", generator=gen)
    norm_w = (torch.rand(K3["width"], device="cuda", generator=gen) + 0.5).bfloat16()
    got = fused_experts(
        x,
        weights,
        ids,
        ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3),
        activation="situ",
        linear_beta=25.0,
        norm_weight=norm_w,
    )
    want = rms_norm(
        local_reference(x, weights, ids.long(), w1, w2, w3, make_glu("situ")), norm_w, 1e-6
    )
    assert rel_rms(got, want) <= 1e-2
    assert_close_scaled(got, want, 5e-2)


@pytest.mark.gpu
def test_fp8_quantize_rows_bit_exact_k3():
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_rows

    x = k3_problem(4099, seed=23)[0]  # the K3 latent in bf16; 4099 x 28 groups: a partial tile
    q, s = quantize_fp8_rows(x)
    q_ref, s_ref = quantize_fp8_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
def test_combine_k3_matches_reference():
    from tokenspeed.model.ops.moe.combine import combine

    gen = torch.Generator(device="cuda").manual_seed(24)
    y = torch.randn(3000, K3["width"], device="cuda", generator=gen).bfloat16()
    pair_row = torch.randint(0, 3000, (2049, K3["top_k"]), device="cuda", generator=gen)
    pair_row[torch.rand(pair_row.shape, device="cuda", generator=gen) < 15 / 16] = -1
    weights = torch.rand(pair_row.shape, device="cuda", generator=gen)
    norm_w = torch.rand(K3["width"], device="cuda", generator=gen) + 0.5
    for nw, block_l in ((None, None), (None, 512), (norm_w, None)):
        got = combine(
            y, pair_row.int(), weights, torch.bfloat16, nw, tuning=_combine_tuning(block_l)
        )
        want = _combine_reference(
            y.float().cpu(), pair_row.cpu(), weights.cpu(), None if nw is None else nw.cpu()
        )
        assert rel_rms(got.cpu(), want) <= 4e-3  # one bf16 rounding (two with the norm)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 2048])
def test_grouped_fp8_k3(tokens):
    x, w1, w2, w3, ids, weights = k3_problem(tokens, seed=tokens + 1)
    (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
    experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
    got = fused_experts(x, weights, ids, experts, activation="situ", linear_beta=25.0)
    local = ids < K3["local"]
    w_local, ids_local = torch.where(local, weights, 0.0), torch.where(local, ids, 0)
    emulated = fp8_reference(
        x.float(), w_local, ids_local, q1, s1, q2, s2, q3, s3, "situ", round_dtype=torch.bfloat16
    )
    # Same quantisation: only accumulation order, and rare e4m3 rounding flips of h, differ.
    assert rel_rms(got, emulated) <= 2e-2
    # Against unquantised bf16 experts: the FP8 error budget (e4m3 has 3 mantissa bits).
    exact = local_reference(x, weights, ids.long(), w1, w2, w3, make_glu("situ"))
    assert rel_rms(got, exact) <= 0.15


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fast_math_is_the_fp8_default_and_stays_close_to_exact(fmt):
    x, w1, w2, w3, ids, weights = k3_problem(2048, seed=21)
    if fmt == "fp8":
        (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
        experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
    else:
        experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3)
    kw = dict(activation="situ", linear_beta=25.0)
    default = fused_experts(x, weights, ids, experts, **kw)
    fast = fused_experts(x, weights, ids, experts, config=MoeKernelConfig(fast_math=True), **kw)
    exact = fused_experts(x, weights, ids, experts, config=MoeKernelConfig(fast_math=False), **kw)
    assert torch.equal(default, fast if fmt == "fp8" else exact)
    assert not torch.equal(fast, exact)  # the switch reaches the kernels
    # bf16: the GLU's last fp32 bits move a few bf16 roundings of h; FP8: a few e4m3 codes.
    assert rel_rms(fast, exact) <= (1e-3 if fmt == "bf16" else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 2048])
def test_grouped_mxfp4_k3(tokens):
    x, w1, w2, w3, ids, weights = k3_problem(tokens, seed=tokens + 2)
    (p1, c1), (p2, c2), (p3, c3) = (quantize_mxfp4(w) for w in (w1, w2, w3))
    experts = ExpertWeights(format="mxfp4", w1=p1, w2=p2, w3=p3, s1=c1, s2=c2, s3=c3)
    got = fused_experts(x, weights, ids, experts, activation="situ", linear_beta=25.0)
    decoded = [decode_mxfp4(p, c, torch.bfloat16) for p, c in ((p1, c1), (p2, c2), (p3, c3))]
    want = local_reference(x, weights, ids.long(), *decoded, make_glu("situ"))
    assert rel_rms(got, want) <= 1e-2
    assert_close_scaled(got, want, 5e-2)


@pytest.mark.gpu
def test_grouped_deterministic_and_graph_capturable():
    x, w1, w2, w3, ids, weights = k3_problem(256, seed=9)
    experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3)

    def run(inp):
        return fused_experts(inp, weights, ids, experts, activation="situ", linear_beta=25.0)

    first, second = run(x), run(x)
    assert torch.equal(first, second)  # atomics reorder rows, never results
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(static_x)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(captured, first)


# ---------------------------------------------------------------- shared-expert overlap


def test_side_stream_serialises_when_disabled():
    calls = []
    side = SideStream(enabled=False)
    main_out, side_out = side.run(
        lambda: calls.append("main") or 1, lambda: calls.append("side") or 2
    )
    assert (main_out, side_out) == (1, 2)
    assert calls == ["side", "main"]


@pytest.mark.gpu
def test_side_stream_overlap_matches_serial_and_captures():
    x, w1, w2, w3, ids, weights = k3_problem(256, seed=12)
    experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3)
    shared_w = torch.randn(1024, K3["width"], device="cuda").bfloat16() * 0.02

    def routed():
        return fused_experts(x, weights, ids, experts, activation="situ", linear_beta=25.0)

    def shared():
        return (x @ shared_w.t()) @ shared_w

    # Same kernels either way; the tolerance only allows cuBLAS to pick another algorithm on
    # another stream or inside a graph. A missing join would read unfinished (garbage) rows.
    side = SideStream()
    a, b = side.run(routed, shared)
    torch.testing.assert_close(a + b, routed() + shared(), atol=1e-2, rtol=1.6e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ga, gb = side.run(routed, shared)
        out = ga + gb
    graph.replay()
    torch.testing.assert_close(out, a + b, atol=1e-2, rtol=1.6e-2)
