"""KDA prefill adapters (over fla's `chunk_kda` and varlen `causal_conv1d`) vs the torch
references.

CPU: fla's `chunk_kda` cannot run under TRITON_INTERPRET=1 (its kernels need interpreter patches),
so the CPU case swaps it, inside an interpreter subprocess, for fla's own `fused_recurrent_kda`,
which takes the same in-kernel gate / L2-norm / beta-sigmoid flags with the same meaning. That
checks everything the adapter does (flag mapping, gate forms, varlen layout, slot gather and
scatter) against our references. fla's conv kernel runs in the interpreter as it is, with its
autotuner pinned to one config (the interpreter cannot time configs). GPU (marked `gpu`): the
real kernels at K3 shapes.

Run as a script (`python test_kda_prefill.py CASE...`) it prints the error report of each case as
JSON; that is what the interpreter subprocess does.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

from tokenspeed.model.ops.conv import causal_conv
from tokenspeed.model.ops.kda import kda_chunked, kda_gate
from tokenspeed.model.ops.kda.prefill import kda_conv_prefill, kda_prefill, use_safe_gate
from tokenspeed.model.ops.norm import l2_norm

FP32_TOL = 1e-5
# GPU, bf16 inputs: fla rounds the normalised q/k, its intra-chunk matrices and the per-chunk
# states to bf16 (2^-8 relative each), so compare by relative RMS error as fla's own tests do
# (they use 0.005 for fp16, which has 3 more mantissa bits than bf16).
GPU_RMS_RATIO = 0.02


def make_inputs(
    lens=(4, 1, 9, 3),
    heads=2,
    k_dim=16,
    v_dim=16,
    pool=7,
    slots=None,
    dtype=torch.float32,
    seed=0,
    device="cpu",
):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    if slots is None:
        slots = torch.randperm(pool, generator=gen)[: len(lens)]
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lens).cumsum(0)
    inp = dict(
        q=torch.randn(tokens, heads, k_dim, generator=gen).to(dtype),
        k=torch.randn(tokens, heads, k_dim, generator=gen).to(dtype),
        v=torch.randn(tokens, heads, v_dim, generator=gen).to(dtype),
        f=torch.randn(tokens, heads, k_dim, generator=gen).to(dtype),
        beta=torch.randn(tokens, heads, generator=gen).to(dtype),
        a_log=torch.rand(heads, generator=gen),
        dt_bias=torch.randn(heads * k_dim, generator=gen),
        recurrent_state=torch.randn(pool, heads, k_dim, v_dim, generator=gen),
        slots=torch.as_tensor(slots, dtype=torch.int32),
        cu_seqlens=cu,
    )
    return {k: v.to(device) for k, v in inp.items()}


def reference(inp, gate, lower_bound=-5.0):
    """Per sequence in fp32: l2_norm, kda_gate, sigmoid, kda_chunked from the slot's state.
    Returns (o [T, H, V] fp32, updated pool)."""
    pool = inp["recurrent_state"].clone()
    cu = inp["cu_seqlens"].tolist()
    outs = []
    for i, slot in enumerate(inp["slots"].long().tolist()):
        seg = slice(cu[i], cu[i + 1])
        q, k = l2_norm(inp["q"][seg][None]), l2_norm(inp["k"][seg][None])
        g = kda_gate(inp["f"][seg][None].float(), inp["a_log"], inp["dt_bias"], gate, lower_bound)
        beta = torch.sigmoid(inp["beta"][seg][None].float())
        o, final = kda_chunked(
            q, k, inp["v"][seg][None].float(), g, beta, initial_state=pool[slot : slot + 1]
        )
        outs.append(o[0])
        pool[slot] = final[0]
    return torch.cat(outs), pool


def run_adapter(inp, gate, **kw):
    pool = inp["recurrent_state"].clone()
    o = kda_prefill(**{**inp, "recurrent_state": pool}, gate=gate, **kw)
    return o, pool


def report(inp, o, pool, o_ref, pool_ref, metric, pool_key="recurrent_state"):
    """Output and used-slot errors by `metric`; whether the other slots of `inp[pool_key]` kept
    their contents."""
    used = sorted(set(inp["slots"].long().tolist()))
    others = [s for s in range(pool.shape[0]) if s not in used]
    return {
        "out": metric(o.float(), o_ref),
        "state": metric(pool[used], pool_ref[used]),
        "others_untouched": torch.equal(pool[others], inp[pool_key][others]),
    }


def max_abs(a, b):
    return (a - b).abs().max().item()


def rms_ratio(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def cpu_case(gate, flat_f=False):
    """The adapter with fla's chunk_kda replaced by fla's fused_recurrent_kda (interpreter)."""
    import fla.ops.kda

    seen = {}

    def stand_in(q, k, v, g, beta, *, safe_gate=False, cu_seqlens_cpu=None, **kw):
        seen["safe_gate"] = safe_gate
        return fla.ops.kda.fused_recurrent_kda(q, k, v, g, beta, **kw)

    fla.ops.kda.chunk_kda = stand_in
    inp = make_inputs(seed=1 if gate == "softplus" else 2)
    if flat_f:
        inp["f"] = inp["f"].flatten(1)
    o, pool = run_adapter(inp, gate)
    o_ref, pool_ref = reference({**inp, "f": inp["f"].reshape(inp["q"].shape)}, gate)
    return {**report(inp, o, pool, o_ref, pool_ref, max_abs), "safe_gate": seen["safe_gate"]}


def make_conv_inputs(
    lens=(4, 1, 9, 2, 3),
    channels=24,
    width=4,
    pool=7,
    slots=None,
    dtype=torch.float32,
    seed=0,
    device="cpu",
):
    """Lengths include sequences shorter than the W-1 window (their new window keeps part of
    the old one)."""
    gen = torch.Generator().manual_seed(seed)
    if slots is None:
        slots = torch.randperm(pool, generator=gen)[: len(lens)]
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lens).cumsum(0)
    inp = dict(
        qkv=torch.randn(sum(lens), channels, generator=gen).to(dtype),
        weight=torch.randn(channels, width, generator=gen).to(dtype),
        conv_state=torch.randn(pool, channels, width - 1, generator=gen).to(dtype),
        slots=torch.as_tensor(slots, dtype=torch.int32),
        cu_seqlens=cu,
    )
    return {k: v.to(device) for k, v in inp.items()}


def conv_reference(inp):
    """`causal_conv` (+ SiLU) of each sequence from its slot's window, in fp32."""
    pool = inp["conv_state"].float().clone()
    cu = inp["cu_seqlens"].tolist()
    outs = []
    for i, slot in enumerate(inp["slots"].long().tolist()):
        y, window = causal_conv(
            inp["qkv"][cu[i] : cu[i + 1]].float(), inp["weight"].float(), pool[slot]
        )
        outs.append(y)
        pool[slot] = window
    return torch.cat(outs), pool


def run_conv_adapter(inp, **kw):
    pool = inp["conv_state"].clone()
    y = kda_conv_prefill(**{**inp, "conv_state": pool}, **kw)
    return y, pool


def cpu_conv_case():
    """fla's varlen conv in the interpreter, its autotuner pinned to one config."""
    import fla.modules.causal_conv1d.ops as conv_ops

    tuner = conv_ops.causal_conv1d_fwd_kernel
    while not hasattr(tuner, "configs"):
        tuner = tuner.fn
    tuner.configs = tuner.configs[:1]
    inp = make_conv_inputs(seed=5)
    y, pool = run_conv_adapter(inp, cu_seqlens_cpu=inp["cu_seqlens"])
    return report(inp, y, pool, *conv_reference(inp), max_abs, pool_key="conv_state")


CPU_CASES = {
    "softplus": lambda: cpu_case("softplus"),
    "lower_bound": lambda: cpu_case("lower_bound"),
    "lower_bound-flat-f": lambda: cpu_case("lower_bound", flat_f=True),
    "conv": cpu_conv_case,
}


@pytest.fixture(scope="module")
def interpreted():
    # Imported here, not at the top: the interpreter child runs this file as a plain script.
    from .triton_interpreter import run_script

    return run_script(__file__, *sorted(CPU_CASES))


def test_interpreted_conv_adapter_matches_reference(interpreted):
    r = interpreted["conv"]
    assert r["out"] <= FP32_TOL and r["state"] <= FP32_TOL, r
    assert r["others_untouched"], r


@pytest.mark.parametrize("case", sorted(set(CPU_CASES) - {"conv"}))
def test_interpreted_adapter_matches_reference(interpreted, case):
    r = interpreted[case]
    assert r["out"] <= FP32_TOL and r["state"] <= FP32_TOL, r
    assert r["others_untouched"], r
    # fla's bounded-gate fast path exactly for the lower-bound form with bound -5.
    assert r["safe_gate"] == case.startswith("lower_bound"), r


def test_safe_gate_rule():
    assert use_safe_gate("lower_bound", -5.0) and use_safe_gate("lower_bound", -1.0)
    assert not use_safe_gate("lower_bound", -6.0) and not use_safe_gate("softplus", -5.0)


def test_conv_rejects_bad_shapes():
    inp = make_conv_inputs()
    with pytest.raises(ValueError, match="windows"):
        kda_conv_prefill(**{**inp, "conv_state": inp["conv_state"][..., :2]})
    with pytest.raises(ValueError, match="windows"):
        kda_conv_prefill(**{**inp, "qkv": inp["qkv"][None]})
    with pytest.raises(ValueError, match="slots"):
        kda_conv_prefill(**{**inp, "slots": inp["slots"][:2]})


def test_rejects_bad_shapes():
    inp = make_inputs()
    with pytest.raises(ValueError, match="gate form"):
        kda_prefill(**inp, gate="tanh")
    with pytest.raises(ValueError, match="slots"):
        kda_prefill(**{**inp, "slots": inp["slots"][:2]})
    with pytest.raises(ValueError, match="fp32"):
        kda_prefill(**{**inp, "recurrent_state": inp["recurrent_state"].half()})


# ---- GPU, K3 shapes, the real chunk_kda ------------------------------------------------------

K3 = dict(heads=96, k_dim=128, v_dim=128)
GPU_LENS = (1, 63, 64, 65, 300, 700)
GPU_SLOTS = [9, 0, 4, 7, 2, 11]


def _gpu_reference(inp, gate):
    """fp32 reference on the GPU with TF32 off (the chunked reference uses matmuls)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return reference(inp, gate)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("gate", "safe_gate"), [("softplus", False), ("lower_bound", True), ("lower_bound", False)]
)
def test_gpu_k3_matches_reference(gate, safe_gate):
    inp = make_inputs(
        lens=GPU_LENS, pool=12, slots=GPU_SLOTS, dtype=torch.bfloat16, seed=3, device="cuda", **K3
    )
    o, pool = run_adapter(inp, gate, safe_gate=safe_gate)
    o_ref, pool_ref = _gpu_reference(inp, gate)
    r = report(inp, o, pool, o_ref, pool_ref, rms_ratio)
    assert o.dtype == torch.bfloat16 and o.shape == (sum(GPU_LENS), 96, 128)
    assert r["out"] <= GPU_RMS_RATIO and r["state"] <= GPU_RMS_RATIO, r
    assert r["others_untouched"], r


@pytest.mark.gpu
def test_gpu_conv_k3_matches_reference():
    """K3's q|k|v channels (3 x 96 x 128), bf16 inputs and windows (as the cache keeps them):
    fla convolves in fp32 and rounds once, so the output is within bf16 rounding of the fp32
    reference, and the new windows are exact copies of the last inputs."""
    inp = make_conv_inputs(
        lens=GPU_LENS,
        channels=3 * 96 * 128,
        pool=12,
        slots=GPU_SLOTS,
        dtype=torch.bfloat16,
        seed=6,
        device="cuda",
    )
    y, pool = run_conv_adapter(inp, cu_seqlens_cpu=inp["cu_seqlens"].cpu())
    y_ref, pool_ref = conv_reference(inp)
    r = report(inp, y, pool, y_ref, pool_ref, rms_ratio, pool_key="conv_state")
    assert y.dtype == torch.bfloat16 and y.shape == inp["qkv"].shape
    assert r["out"] <= 0.01, r
    assert r["state"] == 0.0 and r["others_untouched"], r


@pytest.mark.gpu
def test_gpu_adapter_equals_chunk_kda_called_directly():
    """The adapter adds only the slot gather / scatter: bit-identical to fla called directly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.kda import chunk_kda
    inp = make_inputs(
        lens=GPU_LENS, pool=12, slots=GPU_SLOTS, dtype=torch.bfloat16, seed=4, device="cuda", **K3
    )
    o, pool = run_adapter(inp, "lower_bound", cu_seqlens_cpu=inp["cu_seqlens"].cpu())
    slots = inp["slots"].long()
    with torch.no_grad():
        o_direct, final = chunk_kda(
            inp["q"][None],
            inp["k"][None],
            inp["v"][None],
            inp["f"][None],
            inp["beta"][None],
            initial_state=inp["recurrent_state"][slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            lower_bound=-5.0,
            cu_seqlens=inp["cu_seqlens"],
            A_log=inp["a_log"],
            dt_bias=inp["dt_bias"],
        )
    assert torch.equal(o, o_direct[0])
    assert torch.equal(pool[slots], final)


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny shapes; threads only contend on a small CI machine
    warnings.simplefilter("ignore")  # fla warns that Triton has no GPU here
    print(json.dumps({name: CPU_CASES[name]() for name in sys.argv[1:]}))
