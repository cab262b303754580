"""KDA output tail kernel (per-head RMSNorm x sigmoid gate, optional FP8 per-token quantisation)
vs the torch reference `gated_rms_norm` (+ `fp8_quantize_rows`).

CPU: the kernel under TRITON_INTERPRET=1 in one subprocess (the interpreter must be on before the
kernel module is imported), at tiny shapes. GPU (marked `gpu`): K3 shapes (H=96, V=128), bf16.

Run as a script (`python test_kda_tail.py CASE...`) it prints the error report of each case as
JSON; that is what the interpreter subprocess does.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tokenspeed.model.ops.interpret import interpreting
from tokenspeed.model.ops.kda.tail import (
    FP8_MAX,
    FP8_MIN_AMAX,
    KdaTailTuning,
    fp8_quantize_rows,
    kda_output_tail,
)
from tokenspeed.model.ops.norm import gated_rms_norm

EPS = 1e-5
INTERPRETED = interpreting()
# Half an ulp of the output dtype relative to the value (the interpreter truncates to bf16
# instead of rounding: a whole ulp there), plus fp32 slack relative to the largest value.
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_SLACK = 1e-6
# e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of the value; below the smallest
# normal (2^-6, in units of the scale) the spacing is the subnormal step 2^-9.
FP8_HALF_ULP, FP8_SUBNORMAL_STEP = 2.0**-4, 2.0**-9
# Codes may differ from torch's only where the fp32 values sit on a rounding boundary.
FP8_MIN_AGREEMENT = 0.99


def make_inputs(
    tokens=5, heads=3, v_dim=16, dtype=torch.float32, seed=0, device="cpu", gate_pad=0, zero_rows=()
):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(tokens, heads, v_dim, generator=gen) * 3
    o[list(zero_rows)] = 0.0
    wide = torch.randn(tokens, heads * v_dim + 2 * gate_pad, generator=gen) * 2
    gate = wide[:, gate_pad : gate_pad + heads * v_dim]
    weight = 1.0 + 0.1 * torch.randn(v_dim, generator=gen)
    return dict(o=o.to(dtype).to(device), gate=gate.to(dtype).to(device), weight=weight.to(device))


def reference(inp):
    """fp32 [T, H*V]."""
    y = gated_rms_norm(
        inp["o"].float().cpu(),
        inp["gate"].float().cpu().reshape(inp["o"].shape),
        inp["weight"].cpu(),
        EPS,
    )
    return y.reshape(y.shape[0], -1)


def out_report(inp, **kw):
    y = kda_output_tail(**inp, eps=EPS, **kw)
    ref = reference(inp)
    ulps = 2.0 if INTERPRETED and y.dtype == torch.bfloat16 else 1.0
    excess = (y.float().cpu() - ref).abs() - ulps * HALF_ULP[y.dtype] * ref.abs()
    return {
        "out": max(excess.max().item(), 0.0) / ref.abs().max().item(),
        "dtype_ok": y.dtype == inp["o"].dtype and tuple(y.shape) == tuple(ref.shape),
    }


def scaled_report(inp):
    """FP8 mode writing fp32: the scaled values before the e4m3 rounding, and the scales.

    The interpreter cannot check the e4m3 rounding itself: its fp32 -> fp8 conversion loses the
    carry into the exponent (31.35 becomes 16 instead of 32), so that part is GPU-only."""
    tokens, width = inp["o"].shape[0], inp["gate"].numel() // inp["o"].shape[0]
    out = torch.empty(tokens, width, device=inp["o"].device)
    _, scales = kda_output_tail(**inp, eps=EPS, fp8=True, out=out)
    ref = reference(inp)
    scales_ref = ref.abs().amax(-1, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    ref_scaled = (ref / scales_ref).clamp(-FP8_MAX, FP8_MAX)
    return {
        "out": (out.cpu() - ref_scaled).abs().max().item() / FP8_MAX,
        "scale": ((scales.cpu() - scales_ref).abs() / scales_ref).max().item(),
        "max_code": out.abs().max().item(),
        "dtype_ok": tuple(scales.shape) == (tokens, 1),
    }


def fp8_report(inp, **kw):
    q, scales = kda_output_tail(**inp, eps=EPS, fp8=True, **kw)
    ref = reference(inp)
    q_ref, scales_ref = fp8_quantize_rows(ref)
    q, scales = q.cpu(), scales.cpu()
    deq = q.float() * scales
    bound = FP8_HALF_ULP * ref.abs() + FP8_SUBNORMAL_STEP * scales_ref
    return {
        "scale": ((scales - scales_ref).abs() / scales_ref).max().item(),
        "within_half_ulp": bool(((deq - ref).abs() <= bound * (1 + 1e-5)).all()),
        "agreement": (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item(),
        "max_code": q.float().abs().max().item(),
        "finite": bool(torch.isfinite(deq).all() and torch.isfinite(scales).all()),
        "dtype_ok": q.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (ref.shape[0], 1),
    }


CPU_CASES = {
    "fp32": lambda: out_report(make_inputs(seed=1)),
    "bf16": lambda: out_report(make_inputs(dtype=torch.bfloat16, seed=2)),
    "fp16-strided-gate": lambda: out_report(make_inputs(dtype=torch.float16, seed=3, gate_pad=3)),
    "fp8-scaled-fp32-in": lambda: scaled_report(make_inputs(tokens=6, heads=4, seed=4)),
    "fp8-scaled-bf16-in-zero-row": lambda: scaled_report(
        make_inputs(tokens=4, dtype=torch.bfloat16, seed=5, zero_rows=(2,))
    ),
}


@pytest.fixture(scope="module")
def interpreted():
    # Imported here, not at the top: the interpreter child runs this file as a plain script.
    from .triton_interpreter import run_script

    return run_script(__file__, *sorted(CPU_CASES))


def _check(r):
    """Every key a report carries must be within its bound."""
    assert r["dtype_ok"], r
    if "out" in r:  # normalised output (or scaled-value) error
        assert r["out"] <= FP32_SLACK, r
    if "scale" in r:
        assert r["scale"] <= FP32_SLACK, r
        assert r["max_code"] == FP8_MAX, r  # each row's largest value maps onto the top code
    if "agreement" in r:  # real e4m3 codes
        assert r["within_half_ulp"] and r["finite"], r
        assert r["agreement"] >= FP8_MIN_AGREEMENT, r


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_tail_matches_reference(interpreted, case):
    _check(interpreted[case])


def test_rejects_bad_shapes():
    inp = make_inputs()
    with pytest.raises(ValueError, match="gate"):
        kda_output_tail(inp["o"], inp["gate"][:, :-1], inp["weight"], EPS)
    with pytest.raises(ValueError, match="power of two"):
        kda_output_tail(
            inp["o"].reshape(5, -1)[:, :36], inp["gate"][:, :36], inp["weight"][:12], EPS
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 1000])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_k3_matches_reference(tokens, fp8):
    inp = make_inputs(
        tokens=tokens,
        heads=96,
        v_dim=128,
        dtype=torch.bfloat16,
        seed=tokens,
        device="cuda",
        gate_pad=64,
        # a zero row among others (a lone zero row has no top code to reach)
        zero_rows=(0,) if fp8 and tokens > 1 else (),
    )
    _check(fp8_report(inp) if fp8 else out_report(inp))


@pytest.mark.parametrize("field,value", [("num_warps", 3), ("num_warps", 64), ("use_pdl", 1)])
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KdaTailTuning(**{field: value})


def test_tuning_defaults_and_launch(monkeypatch):
    """Defaults: warps by shape (K3: 96 heads x 128 -> 16), PDL where supported; a given
    tuning reaches the launch."""
    from tokenspeed.model.ops.kda import tail

    assert KdaTailTuning() == KdaTailTuning(num_warps=None, use_pdl=None)
    assert KdaTailTuning().warps(96, 128) == 16 and KdaTailTuning().warps(3, 16) == 1
    seen = {}

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(kw)

    monkeypatch.setattr(tail, "_kda_tail_kernel", Spy())
    inp = make_inputs()
    kda_output_tail(**inp, eps=EPS, tuning=KdaTailTuning(num_warps=4, use_pdl=False))
    assert seen["num_warps"] == 4 and seen["USE_PDL"] is False
    kda_output_tail(**inp, eps=EPS)
    assert seen["num_warps"] == 1 and seen["USE_PDL"] is False


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny shapes; threads only contend on a small CI machine
    print(json.dumps({name: CPU_CASES[name]() for name in sys.argv[1:]}))
