"""Fused KDA decode / verify kernel vs the torch references (conv, l2_norm, kda_gate,
kda_recurrent) composed exactly as the KDA layer composes them.

CPU: every case runs the Triton kernel under TRITON_INTERPRET=1 in one subprocess (the
interpreter must be on before the kernel module is imported, and other test modules in this
process may already have imported it compiled), at tiny shapes. GPU (marked `gpu`): K3 shapes
(H=96, K=V=128), bf16 activations, fp32 state, 1-4 tokens, both gate forms, ragged slots.

Run as a script (`python test_kda_decode.py CASE...`) it prints the error report of each case as
JSON; that is what the interpreter subprocess does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tokenspeed
from tokenspeed.model.ops.conv import causal_conv
from tokenspeed.model.ops.kda import kda_gate, kda_recurrent
from tokenspeed.model.ops.kda.decode import kda_decode, kda_decode_rollback
from tokenspeed.model.ops.norm import l2_norm

# fp32 kernel vs fp32 reference: only the order of the sums differs.
FP32_TOL = 2e-5
# bf16 / fp16 outputs: half an ulp of the output dtype relative to the value, plus slack for the
# fp32 differences above.
OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# GPU (K3 shapes): fp32 state after up to 4 tokens, approximate exp/sigmoid/sqrt on the device.
GPU_STATE_TOL = 1e-4
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def make_inputs(batch=3, steps=2, heads=2, k_dim=16, v_dim=16, width=4, pool=7, slots=None,
                dtype=torch.float32, seed=0, device="cpu", pad=0):
    """Random decode inputs. `pad` > 0 makes qkv / f / beta strided row views of wider buffers."""
    gen = torch.Generator().manual_seed(seed)
    channels = heads * (2 * k_dim + v_dim)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    def rows(*shape):
        wide = rand(*shape[:-1], shape[-1] + 2 * pad)
        return wide[..., pad : pad + shape[-1]]

    if slots is None:
        slots = torch.randperm(pool, generator=gen)[:batch]
    return dict(
        qkv=rows(batch, steps, channels),
        f=rows(batch, steps, heads * k_dim),
        beta=rows(batch, steps, heads),
        conv_weight=rand(channels, width, s=0.5),
        a_log=torch.rand(heads, generator=gen),
        dt_bias=torch.randn(heads * k_dim, generator=gen),
        conv_state=rand(pool, channels, width - 1),
        recurrent_state=torch.randn(pool, heads, k_dim, v_dim, generator=gen),
        slots=torch.as_tensor(slots, dtype=torch.int32),
    ) if device == "cpu" else {
        k: v.to(device) for k, v in make_inputs(
            batch, steps, heads, k_dim, v_dim, width, pool, slots, dtype, seed, "cpu", pad
        ).items()
    }


def reference(inp, gate, lower_bound=-5.0, rows=None, scale=None):
    """fp32 torch composition on CPU. Returns (o [B, T, H, V] fp32, conv pool, state pool), the
    pools updated at the slots of `rows` (default: all rows)."""
    inp = {k: v.cpu() for k, v in inp.items()}
    qkv, slots = inp["qkv"].float(), inp["slots"].long()
    batch, steps, _ = qkv.shape
    _, heads, k_dim, v_dim = inp["recurrent_state"].shape
    conv_pool, state_pool = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    mixed = []
    for b in range(batch):
        y, new_conv = causal_conv(qkv[b], inp["conv_weight"].float(), conv_pool[slots[b]].float())
        mixed.append(y)
        if rows is None or b in rows:
            conv_pool[slots[b]] = new_conv.to(conv_pool.dtype)
    mixed = torch.stack(mixed)
    hk = heads * k_dim
    q = l2_norm(mixed[..., :hk].reshape(batch, steps, heads, k_dim))
    k = l2_norm(mixed[..., hk : 2 * hk].reshape(batch, steps, heads, k_dim))
    v = mixed[..., 2 * hk :].reshape(batch, steps, heads, v_dim)
    g = kda_gate(inp["f"].float().reshape(batch, steps, heads, k_dim), inp["a_log"],
                 inp["dt_bias"], gate, lower_bound)
    beta = torch.sigmoid(inp["beta"].float())
    o, final = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=state_pool[slots])
    for b in range(batch) if rows is None else rows:
        state_pool[slots[b]] = final[b]
    return o, conv_pool, state_pool


def run_kernel(inp, **kw):
    """The kernel on copies of the pools: (o, conv pool, state pool)."""
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    args = {**inp, "conv_state": conv, "recurrent_state": state}
    o = kda_decode(**args, **kw)
    return o, conv, state


def out_error(o, ref):
    """Largest |o - ref| beyond half an output ulp (0 when within it), over max |ref|.

    The interpreter converts fp32 to bf16 by truncation, not rounding: there a whole ulp."""
    ulps = 2.0 if INTERPRETED and o.dtype == torch.bfloat16 else 1.0
    excess = (o.float().cpu() - ref).abs() - ulps * OUT_REL[o.dtype] * ref.abs()
    return max(excess.max().item(), 0.0) / ref.abs().max().item()


def compare(inp, gate, rows=None, **kw):
    o, conv, state = run_kernel(inp, gate=gate, **kw)
    o_ref, conv_ref, state_ref = reference(inp, gate, rows=rows, scale=kw.get("scale"))
    rows = list(range(o.shape[0])) if rows is None else rows
    slots = inp["slots"].cpu().long()
    touched = set(slots[rows].tolist())
    others = [s for s in range(conv.shape[0]) if s not in set(slots.tolist())]
    return {
        "out": out_error(o[rows], o_ref[rows]),
        "state": (state.cpu()[sorted(touched)] - state_ref[sorted(touched)]).abs().max().item(),
        "conv_exact": torch.equal(conv.cpu()[sorted(touched)], conv_ref[sorted(touched)]),
        "others_untouched": torch.equal(conv.cpu()[others], inp["conv_state"].cpu()[others])
        and torch.equal(state.cpu()[others], inp["recurrent_state"].cpu()[others]),
    }


def case_sequential(device="cpu", **dims):
    """Four one-token steps give what one four-token verify step gives."""
    inp = make_inputs(steps=4, seed=11, device=device, **dims)
    o4, conv4, state4 = run_kernel(inp, gate="lower_bound")
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    outs = []
    for t in range(4):
        step = {**inp, "conv_state": conv, "recurrent_state": state}
        for name in ("qkv", "f", "beta"):
            step[name] = inp[name][:, t : t + 1]
        outs.append(kda_decode(**step, gate="lower_bound"))
    # Both sides are rounded to the output dtype: allow one ulp between them.
    o1, o4 = torch.cat(outs, 1).float().cpu(), o4.float().cpu()
    excess = (o1 - o4).abs() - 2 * OUT_REL[inp["qkv"].dtype] * o4.abs()
    return {
        "out": max(excess.max().item(), 0.0) / o4.abs().max().item(),
        "state": (state - state4).abs().max().item(),
        "conv_exact": torch.equal(conv, conv4),
    }


def case_rollback(device="cpu", **dims):
    """Verify 4 tokens keeping step states, accept 1, 3 and 4 of them, roll back: the pools equal
    those of a step over only the accepted tokens."""
    inp = make_inputs(steps=4, seed=12, device=device, **dims)
    batch, heads, k_dim, v_dim = 3, *inp["recurrent_state"].shape[1:]
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    step_states = state.new_empty(batch, 4, heads, k_dim, v_dim)
    step_conv = conv.new_empty(batch, 4, *conv.shape[1:])
    kda_decode(**{**inp, "conv_state": conv, "recurrent_state": state}, gate="softplus",
               step_states=step_states, step_conv=step_conv)
    accepted = torch.tensor([1, 3, 4], device=device)
    kda_decode_rollback(conv, state, inp["slots"], step_conv, step_states, accepted)
    report = {"state": 0.0, "conv_exact": True}
    for b, n in enumerate(accepted.tolist()):
        part = {**inp}
        for name in ("qkv", "f", "beta"):
            part[name] = inp[name][b : b + 1, :n]
        part["slots"] = inp["slots"][b : b + 1]
        _, conv_ref, state_ref = reference(part, "softplus")
        slot = int(inp["slots"][b])
        err = (state[slot].cpu() - state_ref[slot]).abs().max().item()
        report["state"] = max(report["state"], err)
        report["conv_exact"] &= torch.equal(conv[slot].cpu(), conv_ref[slot])
    return report


CPU_CASES = {
    **{
        f"{gate}-T{steps}": lambda gate=gate, steps=steps: compare(
            make_inputs(batch=2, steps=steps, seed=steps), gate)
        for gate in ("softplus", "lower_bound")
        for steps in (1, 2, 3, 4)
    },
    # Two V blocks per head: the window of the q/k channels is reused across blocks.
    "v-blocks-T3": lambda: compare(make_inputs(steps=3, seed=5), "lower_bound", block_v=8),
    "v-blocks-softplus-T2": lambda: compare(
        make_inputs(steps=2, seed=6), "softplus", block_v=4, num_warps=2),
    # V != K, conv kernel 3, q scale given.
    "v32-k16-w3": lambda: compare(
        make_inputs(steps=2, v_dim=32, width=3, seed=7), "softplus", block_v=16, scale=0.3),
    "bf16": lambda: compare(make_inputs(steps=3, dtype=torch.bfloat16, seed=8), "lower_bound"),
    "fp16": lambda: compare(make_inputs(steps=2, dtype=torch.float16, seed=9), "softplus"),
    "strided-rows": lambda: compare(make_inputs(steps=2, pad=5, seed=10), "lower_bound"),
    # Padding rows 0 and 2 share sink slot 0; real rows 1 and 3 are exact, other slots untouched.
    "sink-slot": lambda: compare(
        make_inputs(batch=4, steps=1, slots=[0, 5, 0, 2], seed=13), "softplus", rows=[1, 3]),
    "sequential": case_sequential,
    "rollback": case_rollback,
}


def _run_interpreted(names):
    src = str(Path(tokenspeed.__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, *names], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted():
    return _run_interpreted(sorted(CPU_CASES))


def _check(report):
    assert report.get("out", 0.0) <= FP32_TOL, report
    assert report["state"] <= FP32_TOL, report
    assert report["conv_exact"], report
    assert report.get("others_untouched", True), report


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_kernel_matches_reference(interpreted, case):
    _check(interpreted[case])


def test_rejects_bad_shapes():
    inp = make_inputs()
    with pytest.raises(ValueError, match="gate form"):
        kda_decode(**inp, gate="sigmoid")
    with pytest.raises(ValueError, match="slots"):
        kda_decode(**{**inp, "slots": inp["slots"][:2]})
    with pytest.raises(ValueError, match="fp32"):
        kda_decode(**{**inp, "recurrent_state": inp["recurrent_state"].half()})
    with pytest.raises(ValueError, match="powers of two"):
        kda_decode(**inp, block_v=6)


# ---- GPU, K3 shapes ------------------------------------------------------------------------

K3 = dict(heads=96, k_dim=128, v_dim=128, width=4)


def _gpu_check(report):
    # bf16 outputs within half a bf16 ulp of the fp32 reference (+1e-4 of the largest output);
    # fp32 state within GPU_STATE_TOL; conv state exact (it is a copy of inputs).
    assert report.get("out", 0.0) <= 1e-4, report
    assert report["state"] <= GPU_STATE_TOL, report
    assert report["conv_exact"], report
    assert report.get("others_untouched", True), report


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_gpu_k3_matches_reference(gate, steps):
    inp = make_inputs(batch=6, steps=steps, pool=11, slots=[9, 2, 0, 7, 4, 10],
                      dtype=torch.bfloat16, seed=steps, device="cuda", **K3)
    _gpu_check(compare(inp, gate))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(128, 4), (128, 8), (128, 16), (64, 4), (64, 8), (32, 4)])
def test_gpu_k3_every_config_matches_reference(config):
    block_v, num_warps = config
    inp = make_inputs(batch=5, steps=3, pool=9, dtype=torch.bfloat16, seed=21, device="cuda", **K3)
    _gpu_check(compare(inp, "lower_bound", block_v=block_v, num_warps=num_warps))


@pytest.mark.gpu
def test_gpu_k3_many_rows_with_sink_padding():
    slots = [0] * 8 + list(range(1, 57))  # 8 padding rows on sink slot 0, 56 real rows
    inp = make_inputs(batch=64, steps=1, pool=60, slots=slots, dtype=torch.bfloat16, seed=22,
                      device="cuda", **K3)
    _gpu_check(compare(inp, "lower_bound", rows=list(range(8, 64))))


@pytest.mark.gpu
def test_gpu_k3_sequential_and_rollback():
    dims = dict(pool=5, slots=[3, 0, 4], dtype=torch.bfloat16, **K3)
    seq = case_sequential(device="cuda", **dims)
    assert seq["out"] <= 1e-4 and seq["state"] <= GPU_STATE_TOL and seq["conv_exact"], seq
    back = case_rollback(device="cuda", **dims)
    assert back["state"] <= GPU_STATE_TOL and back["conv_exact"], back


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_pdl():
    """Captured with PDL on, replayed on new inputs: same as an eager call on the same inputs."""
    inp = make_inputs(batch=8, steps=2, pool=12, dtype=torch.bfloat16, seed=23, device="cuda",
                      **K3)
    static = {k: v.clone() for k, v in inp.items()}
    out = torch.empty(8, 2, 96, 128, dtype=torch.bfloat16, device="cuda")
    kda_decode(**static, gate="lower_bound", out=out, use_pdl=True)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_decode(**static, gate="lower_bound", out=out, use_pdl=True)
    fresh = make_inputs(batch=8, steps=2, pool=12, dtype=torch.bfloat16, seed=24, device="cuda",
                        **K3)
    for k, v in fresh.items():
        static[k].copy_(v)
    graph.replay()
    o, conv, state = run_kernel(fresh, gate="lower_bound", use_pdl=False)
    torch.cuda.synchronize()
    assert torch.equal(out, o)
    assert torch.equal(static["conv_state"], conv)
    assert torch.equal(static["recurrent_state"], state)


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny shapes; threads only contend on a small CI machine
    print(json.dumps({name: CPU_CASES[name]() for name in sys.argv[1:]}))
