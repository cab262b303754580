"""KDA decode / verify kernels (prep + recurrence) vs the torch references (conv, l2_norm,
kda_gate, kda_recurrent) composed exactly as the KDA layer composes them; their tuning knobs.

CPU: every case runs the Triton kernels under TRITON_INTERPRET=1 in one subprocess (the
interpreter must be on before the kernel module is imported, and other test modules in this
process may already have imported it compiled), at tiny shapes. GPU (marked
`gpu`): K3 shapes (H=96, K=V=128), bf16 activations, fp32 state, 1-4 tokens, both gate forms,
ragged slots, sink-slot padding, step states, CUDA graphs with PDL.
The comparison forms (onepass, fused) live in benchmarks/kda_decode_variants.py.

Run as a script (`python test_kda_decode.py CASE...`) it prints the error report of each case as
JSON; that is what the interpreter subprocess does.
"""

from __future__ import annotations

import json
import sys

import attrs
import pytest
import torch

from tokenspeed.model.ops.conv import causal_conv
from tokenspeed.model.ops.interpret import interpreting
from tokenspeed.model.ops.kda import kda_gate, kda_recurrent
from tokenspeed.model.ops.kda.decode import (
    KdaDecodeTuning,
    decode_scratch,
    default_config,
    kda_decode,
    kda_decode_rollback,
    kda_decode_stages,
    scratch_width,
)
from tokenspeed.model.ops.norm import l2_norm

# fp32 kernel vs fp32 reference: only the order of the sums differs.
FP32_TOL = 2e-5
# bf16 / fp16 outputs: half an ulp of the output dtype relative to the value, plus slack for the
# fp32 differences above.
OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# GPU (K3 shapes): fp32 state after up to 4 tokens, approximate exp/sigmoid/sqrt on the device.
GPU_STATE_TOL = 1e-4
INTERPRETED = interpreting()
KNOBS = {a.name for a in attrs.fields(KdaDecodeTuning)}


def make_inputs(
    batch=3,
    steps=2,
    heads=2,
    k_dim=16,
    v_dim=16,
    width=4,
    pool=7,
    slots=None,
    dtype=torch.float32,
    seed=0,
    device="cpu",
    pad=0,
):
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
    return (
        dict(
            qkv=rows(batch, steps, channels),
            f=rows(batch, steps, heads * k_dim),
            beta=rows(batch, steps, heads),
            conv_weight=rand(channels, width, s=0.5),
            a_log=torch.rand(heads, generator=gen),
            dt_bias=torch.randn(heads * k_dim, generator=gen),
            conv_state=rand(pool, channels, width - 1),
            recurrent_state=torch.randn(pool, heads, k_dim, v_dim, generator=gen),
            slots=torch.as_tensor(slots, dtype=torch.int32),
        )
        if device == "cpu"
        else {
            k: v.to(device)
            for k, v in make_inputs(
                batch, steps, heads, k_dim, v_dim, width, pool, slots, dtype, seed, "cpu", pad
            ).items()
        }
    )


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
    g = kda_gate(
        inp["f"].float().reshape(batch, steps, heads, k_dim),
        inp["a_log"],
        inp["dt_bias"],
        gate,
        lower_bound,
    )
    beta = torch.sigmoid(inp["beta"].float())
    o, final = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=state_pool[slots])
    for b in range(batch) if rows is None else rows:
        state_pool[slots[b]] = final[b]
    return o, conv_pool, state_pool


def decode(**kw):
    """`kda_decode` with its tuning knobs given loose: they go into a `KdaDecodeTuning`."""
    knobs = {k: kw.pop(k) for k in list(kw) if k in KNOBS}
    return kda_decode(**kw, tuning=KdaDecodeTuning(**knobs) if knobs else None)


def run_kernel(inp, **kw):
    """The kernel on copies of the pools: (o, conv pool, state pool)."""
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    args = {**inp, "conv_state": conv, "recurrent_state": state}
    o = decode(**args, **kw)
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


def case_sequential(device="cpu", options=None, **dims):
    """Four one-token steps give what one four-token verify step gives (options: more
    `kda_decode` arguments for both)."""
    options = options or {}
    inp = make_inputs(steps=4, seed=11, device=device, **dims)
    o4, conv4, state4 = run_kernel(inp, gate="lower_bound", **options)
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    outs = []
    for t in range(4):
        step = {**inp, "conv_state": conv, "recurrent_state": state}
        for name in ("qkv", "f", "beta"):
            step[name] = inp[name][:, t : t + 1]
        outs.append(decode(**step, gate="lower_bound", **options))
    # Both sides are rounded to the output dtype: allow one ulp between them.
    o1, o4 = torch.cat(outs, 1).float().cpu(), o4.float().cpu()
    excess = (o1 - o4).abs() - 2 * OUT_REL[inp["qkv"].dtype] * o4.abs()
    return {
        "out": max(excess.max().item(), 0.0) / o4.abs().max().item(),
        "state": (state - state4).abs().max().item(),
        "conv_exact": torch.equal(conv, conv4),
    }


def case_rollback(device="cpu", options=None, **dims):
    """Verify 4 tokens keeping step states, accept 1, 3 and 4 of them, roll back: the pools equal
    those of a step over only the accepted tokens (options: more `kda_decode` arguments)."""
    inp = make_inputs(steps=4, seed=12, device=device, **dims)
    batch, heads, k_dim, v_dim = 3, *inp["recurrent_state"].shape[1:]
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    step_states = state.new_empty(batch, 4, heads, k_dim, v_dim)
    step_conv = conv.new_empty(batch, 4, *conv.shape[1:])
    decode(
        **{**inp, "conv_state": conv, "recurrent_state": state},
        gate="softplus",
        step_states=step_states,
        step_conv=step_conv,
        **(options or {}),
    )
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


def case_given_scratch(steps=3):
    """A caller-owned scratch filled with NaN beforehand and reused for two
    consecutive steps: nothing unwritten is read (the padding words stay NaN), and the second
    step continues from the first."""
    inp = make_inputs(steps=steps * 2, seed=14)
    scratch = decode_scratch(3, steps, 2, 16, "cpu", 16).fill_(float("nan"))
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    outs = []
    for half in range(2):
        part = {**inp, "conv_state": conv, "recurrent_state": state}
        for name in ("qkv", "f", "beta"):
            part[name] = inp[name][:, half * steps : (half + 1) * steps]
        outs.append(kda_decode(**part, gate="softplus", scratch=scratch))
    o_ref, conv_ref, state_ref = reference(inp, "softplus")
    slots = inp["slots"].long()
    return {
        "out": out_error(torch.cat(outs, 1), o_ref),
        "state": (state[slots] - state_ref[slots]).abs().max().item(),
        "conv_exact": torch.equal(conv, conv_ref),
        "scratch_padding_unread": bool(scratch[..., 3 * 16 + 2 : scratch_width(16)].isnan().all()),
    }


def case_stages(overlap_prep=True):
    """The two launches run one by one (kda_decode_stages) == kda_decode.
    Waiting on the ready counters, the prep sets them to V // BV and the recurrence's programs
    count them back to 0; with the grid wait neither kernel touches them."""
    inp = make_inputs(steps=2, seed=15)
    o, conv, state = run_kernel(inp, gate="lower_bound", block_v=4)
    mine = {
        **inp,
        "conv_state": inp["conv_state"].clone(),
        "recurrent_state": inp["recurrent_state"].clone(),
    }
    out = torch.empty_like(o)
    counters = torch.zeros(3, 2, dtype=torch.int32)
    stages = kda_decode_stages(
        **mine,
        gate="lower_bound",
        out=out,
        counters=counters,
        tuning=KdaDecodeTuning(block_v=4, overlap_prep=overlap_prep),
    )
    assert len(stages) == 2
    stages[0]()
    ready = bool((counters == (16 // 4 if overlap_prep else 0)).all())
    stages[1]()
    return {
        "out": (out - o).abs().max().item(),
        "state": (mine["recurrent_state"] - state).abs().max().item(),
        "conv_exact": torch.equal(mine["conv_state"], conv),
        "ready_after_prep": ready,
        "counters_zero": bool((counters == 0).all()),
    }


def case_given_counters():
    """Ready counters with several V blocks per head and a caller-owned counter buffer, two
    consecutive steps (the second with a different block count): correct, and the counters are
    back to zero after each launch."""
    inp = make_inputs(steps=4, seed=17)
    counters = torch.zeros(3, 2, dtype=torch.int32)
    conv, state = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    outs, zero = [], True
    for half, block_v in ((0, 8), (1, 4)):
        part = {**inp, "conv_state": conv, "recurrent_state": state}
        for name in ("qkv", "f", "beta"):
            part[name] = inp[name][:, 2 * half : 2 * half + 2]
        outs.append(decode(**part, gate="lower_bound", counters=counters, block_v=block_v))
        zero &= bool((counters == 0).all())
    o_ref, conv_ref, state_ref = reference(inp, "lower_bound")
    slots = inp["slots"].long()
    return {
        "out": out_error(torch.cat(outs, 1), o_ref),
        "state": (state[slots] - state_ref[slots]).abs().max().item(),
        "conv_exact": torch.equal(conv, conv_ref),
        "counters_zero": zero,
    }


def default_cases():
    """The interpreter cases of the default knobs, by name. The lower-bound cases run with two
    V blocks per head (the default config is one block at V=16)."""
    v = {}
    blocks = {"block_v": 8}
    cases = {
        **{
            f"{gate}-T{steps}": lambda gate=gate, steps=steps: compare(
                make_inputs(batch=2, steps=steps, seed=steps),
                gate,
                **v,
                **(blocks if gate == "lower_bound" else {}),
            )
            for gate, all_steps in (("softplus", (1, 2, 4)), ("lower_bound", (1, 3, 4)))
            for steps in all_steps
        },
        # Several V blocks per head: a recurrence program per block.
        "v-blocks-T3": lambda: compare(make_inputs(steps=3, seed=5), "lower_bound", block_v=8, **v),
        "v-blocks-softplus-T2": lambda: compare(
            make_inputs(steps=2, seed=6), "softplus", block_v=4, num_warps=2, **v
        ),
        # V != K, conv kernel 3, q scale given.
        "v32-k16-w3": lambda: compare(
            make_inputs(steps=2, v_dim=32, width=3, seed=7), "softplus", block_v=16, scale=0.3, **v
        ),
        "bf16": lambda: compare(
            make_inputs(steps=3, dtype=torch.bfloat16, seed=8), "lower_bound", **v, **blocks
        ),
        "fp16": lambda: compare(make_inputs(steps=2, dtype=torch.float16, seed=9), "softplus", **v),
        "strided-rows": lambda: compare(
            make_inputs(steps=2, pad=5, seed=10), "lower_bound", **v, **blocks
        ),
        # Padding rows 0 and 2 share sink slot 0; real rows 1 and 3 are exact, other slots
        # untouched.
        "sink-slot": lambda: compare(
            make_inputs(batch=4, steps=1, slots=[0, 5, 0, 2], seed=13),
            "softplus",
            rows=[1, 3],
            **v,
            **blocks,
        ),
        "sequential": lambda: case_sequential(batch=2),
        "rollback": lambda: case_rollback(),
    }
    return cases


CPU_CASES = {
    **{f"split:{name}": fn for name, fn in default_cases().items()},
    "split:given-scratch": case_given_scratch,
    "split:stages": case_stages,
    "split:stages-grid-wait": lambda: case_stages(overlap_prep=False),
    "split:one-warp-T2": lambda: compare(
        make_inputs(steps=2, seed=16), "softplus", block_v=16, num_warps=1
    ),
    "split:given-counters": case_given_counters,
    # The recurrence's two ways to wait for the prep, each where it is not the default.
    "split:ready-counters-T3": lambda: compare(
        make_inputs(steps=3, seed=19), "lower_bound", block_v=8, overlap_prep=True
    ),
    "split:grid-wait-T1": lambda: compare(
        make_inputs(steps=1, seed=20), "softplus", block_v=8, overlap_prep=False
    ),
    # The prep kernel doing the v conv too (the recurrence then reads v from the record): the
    # default for verify steps, here also at one token and with the ready counters.
    "split:v-in-prep-T1": lambda: compare(
        make_inputs(batch=2, steps=1, seed=30),
        "lower_bound",
        block_v=8,
        v_in_prep=True,
    ),
    "split:v-in-prep-T3": lambda: compare(
        make_inputs(steps=3, seed=31), "softplus", block_v=8, v_in_prep=True
    ),
    "split:v-in-prep-sink-slot": lambda: compare(
        make_inputs(batch=4, steps=1, slots=[0, 5, 0, 2], seed=32),
        "lower_bound",
        rows=[1, 3],
        block_v=8,
        v_in_prep=True,
    ),
    "split:v-in-prep-ready-counters-T2": lambda: compare(
        make_inputs(steps=2, seed=33),
        "lower_bound",
        block_v=8,
        v_in_prep=True,
        overlap_prep=True,
    ),
    "split:v-conv-in-recurrence-T2": lambda: compare(
        make_inputs(steps=2, seed=34), "softplus", block_v=8, v_in_prep=False
    ),
    "split:v-in-prep-sequential": lambda: case_sequential(batch=2, options={"v_in_prep": True}),
    "split:v-conv-in-recurrence-rollback": lambda: case_rollback(options={"v_in_prep": False}),
    # Cache eviction hints other than the defaults reach every kernel's loads and stores (the
    # interpreter ignores the hints themselves; the GPU probes time them).
    "split:eviction-hints": lambda: compare(
        make_inputs(steps=1, seed=35),
        "lower_bound",
        block_v=8,
        state_eviction=("evict_first", "evict_last"),
        record_eviction="evict_last",
    ),
}


@pytest.fixture(scope="module")
def interpreted():
    # Imported here, not at the top: the interpreter child runs this file as a plain script.
    from .triton_interpreter import run_script

    return run_script(__file__, *sorted(CPU_CASES))


def _check(report):
    assert report.get("out", 0.0) <= FP32_TOL, report
    assert report["state"] <= FP32_TOL, report
    assert all(flag for flag in report.values() if isinstance(flag, bool)), report


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
        kda_decode(**inp, tuning=KdaDecodeTuning(block_v=32))  # wider than V = 16
    with pytest.raises(ValueError, match="scratch"):
        kda_decode(**inp, scratch=torch.empty(3, 3, 2, scratch_width(16)))
    with pytest.raises(TypeError, match="KdaDecodeTuning"):
        kda_decode(**inp, tuning={"block_v": 8})
    with pytest.raises(TypeError, match="block_v"):
        kda_decode(**inp, block_v=8)  # knobs go through the tuning object only


# Bad knobs, each refused by KdaDecodeTuning with the field's name in the message.
BAD_KNOBS = [
    ("block_v", 6),
    ("block_v", 0),
    ("num_warps", 3),
    ("num_warps", 64),
    ("prep_warps", 0),
    ("overlap_prep", 1),
    ("v_in_prep", "yes"),
    ("state_eviction", ("evict_last",)),
    ("state_eviction", ("evict_last", "evict_never")),
    ("state_eviction", ["evict_last", ""]),
    ("record_eviction", "keep"),
    ("use_pdl", 0),
]


@pytest.mark.parametrize("field,value", BAD_KNOBS, ids=str)
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KdaDecodeTuning(**{field: value})


def test_tuning_defaults_are_the_measured_ones():
    """The documented measured defaults (docs/perf/kda.md): a change here is a retune, made on
    purpose with its measurement, not by accident."""
    assert KdaDecodeTuning() == KdaDecodeTuning(
        block_v=None,
        num_warps=None,
        prep_warps=2,
        overlap_prep=None,
        v_in_prep=None,
        state_eviction=("evict_last", ""),
        record_eviction="",
        use_pdl=None,
    )
    assert len(attrs.fields(KdaDecodeTuning)) == 8  # a new knob needs its default pinned here
    # By shape at K3: 64-column V blocks, 4 warps; the ready counters and the v conv in the
    # recurrence at one token, the grid wait and the v conv in the prep for verify steps.
    one = KdaDecodeTuning().resolve(128, 128, 1)
    assert (one.block_v, one.num_warps, one.overlap_prep, one.v_in_prep) == (64, 4, True, False)
    four = KdaDecodeTuning().resolve(128, 128, 4)
    assert (four.block_v, four.num_warps, four.overlap_prep, four.v_in_prep) == (64, 4, False, True)
    # Given knobs are kept; small shapes clamp the defaults.
    given = KdaDecodeTuning(block_v=16, num_warps=2, overlap_prep=False, v_in_prep=True)
    assert given.resolve(128, 128, 1) == given
    assert KdaDecodeTuning().resolve(16, 16, 1).block_v == 16
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        KdaDecodeTuning().block_v = 8


def test_tuning_reaches_the_launches(monkeypatch):
    """A non-default tuning changes the launch parameters of both kernels (checked on the
    launches `kda_decode` makes, without running them)."""
    from tokenspeed.model.ops.kda import decode as module

    seen = {}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen[self.name] = (grid, kw)

            return launch

    monkeypatch.setattr(module, "_kda_prep_kernel", Spy("prep"))
    monkeypatch.setattr(module, "_kda_recurrent_kernel", Spy("recurrence"))
    inp = make_inputs(steps=1, v_dim=32)
    tuning = KdaDecodeTuning(
        block_v=8,
        num_warps=2,
        prep_warps=4,
        overlap_prep=False,
        v_in_prep=True,
        state_eviction=("evict_first", "evict_last"),
        record_eviction="evict_last",
        use_pdl=False,
    )
    kda_decode(**inp, tuning=tuning, scratch=decode_scratch(3, 1, 2, 16, "cpu", 32, v_in_prep=True))
    prep_grid, prep = seen["prep"]
    rec_grid, rec = seen["recurrence"]
    assert prep["num_warps"] == 4 and prep["EVICT_RECORD"] == "evict_last"
    assert prep["RELEASE"] is False and prep["V_IN_PREP"] is True and prep["NV"] == 4
    assert rec["num_warps"] == 2 and rec["BV"] == 8 and rec["OVERLAP"] is False
    assert (rec["EVICT_LOAD"], rec["EVICT_STORE"]) == ("evict_first", "evict_last")
    assert rec_grid == (3 * 2 * 32 // 8,) and prep_grid == (3 * 2,)
    seen.clear()
    kda_decode(**inp)  # the defaults: one 32-wide block, 1 warp, prep 2 warps, evict-last loads
    assert seen["prep"][1]["num_warps"] == 2 and seen["prep"][1]["EVICT_RECORD"] == ""
    assert seen["recurrence"][1]["BV"] == 32 and seen["recurrence"][1]["num_warps"] == 1
    assert seen["recurrence"][1]["EVICT_LOAD"] == "evict_last"
    assert seen["prep"][1]["RELEASE"] is True and seen["prep"][1]["V_IN_PREP"] is False


def test_defaults_and_scratch_shape():
    assert default_config(128, 128) == (64, 4)
    assert scratch_width(128) % 32 == 0 and scratch_width(128) >= 3 * 128 + 2
    assert decode_scratch(2, 1, 4, 16, "cpu").shape == (2, 1, 4, scratch_width(16))
    # Verify steps keep the conv'd v in the record by default (v_in_prep): V more words.
    assert scratch_width(16, 16) == scratch_width(16) + 16
    assert decode_scratch(2, 3, 4, 16, "cpu", 16).shape == (2, 3, 4, scratch_width(16, 16))
    assert decode_scratch(2, 3, 4, 16, "cpu", 16, v_in_prep=False).shape[-1] == scratch_width(16)
    assert decode_scratch(2, 1, 4, 16, "cpu", 16, v_in_prep=True).shape[-1] == scratch_width(16, 16)
    with pytest.raises(ValueError, match="v_dim"):
        decode_scratch(2, 3, 4, 16, "cpu")


# ---- GPU, K3 shapes ------------------------------------------------------------------------

K3 = dict(heads=96, k_dim=128, v_dim=128, width=4)


def _gpu_check(report):
    # bf16 outputs within half a bf16 ulp of the fp32 reference (+1e-4 of the largest output);
    # fp32 state within GPU_STATE_TOL; conv state exact (it is a copy of inputs).
    assert report.get("out", 0.0) <= 1e-4, report
    assert report["state"] <= GPU_STATE_TOL, report
    assert report["conv_exact"], report
    assert report.get("others_untouched", True), report


# Every gate form x 1-4 tokens.
K3_CASES = [(gate, steps) for gate in ("softplus", "lower_bound") for steps in (1, 2, 3, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("gate,steps", K3_CASES)
def test_gpu_k3_matches_reference(gate, steps):
    inp = make_inputs(
        batch=6,
        steps=steps,
        pool=11,
        slots=[9, 2, 0, 7, 4, 10],
        dtype=torch.bfloat16,
        seed=steps,
        device="cuda",
        **K3,
    )
    _gpu_check(compare(inp, gate))


# Every (block_v, num_warps) the benchmark sweeps.
GPU_CONFIGS = [(16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8), (128, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("block_v,num_warps", GPU_CONFIGS)
def test_gpu_k3_every_config_matches_reference(block_v, num_warps):
    inp = make_inputs(batch=5, steps=3, pool=9, dtype=torch.bfloat16, seed=21, device="cuda", **K3)
    _gpu_check(compare(inp, "lower_bound", block_v=block_v, num_warps=num_warps))


# The v conv in the prep (the default for verify steps) or in the recurrence
# (the default at one token), each where it is not the default.
PREP_OPTIONS = [{"v_in_prep": True}, {"v_in_prep": False}, {"v_in_prep": True, "prep_warps": 1}]


@pytest.mark.gpu
@pytest.mark.parametrize("steps", (1, 2, 4))
@pytest.mark.parametrize("options", PREP_OPTIONS, ids=str)
def test_gpu_k3_prep_options_match_reference(options, steps):
    slots = [0] * 4 + list(range(1, 37))  # 4 padding rows on sink slot 0, 36 real rows
    inp = make_inputs(
        batch=40, steps=steps, pool=40, slots=slots, dtype=torch.bfloat16, seed=23,
        device="cuda", **K3,
    )  # fmt: skip
    _gpu_check(compare(inp, "lower_bound", rows=list(range(4, 40)), **options))


@pytest.mark.gpu
@pytest.mark.parametrize("options", PREP_OPTIONS, ids=str)
def test_gpu_k3_prep_options_sequential_and_rollback(options):
    dims = dict(pool=5, slots=[3, 0, 4], dtype=torch.bfloat16, **K3)
    _gpu_check(case_sequential(device="cuda", batch=3, options=options, **dims))
    _gpu_check(case_rollback(device="cuda", options=options, **dims))


@pytest.mark.gpu
def test_gpu_k3_many_rows_with_sink_padding():
    slots = [0] * 8 + list(range(1, 57))  # 8 padding rows on sink slot 0, 56 real rows
    inp = make_inputs(
        batch=64, steps=1, pool=60, slots=slots, dtype=torch.bfloat16, seed=22, device="cuda", **K3
    )
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
    inp = make_inputs(batch=8, steps=2, pool=12, dtype=torch.bfloat16, seed=23, device="cuda", **K3)
    static = {k: v.clone() for k, v in inp.items()}
    out = torch.empty(8, 2, 96, 128, dtype=torch.bfloat16, device="cuda")
    kw = dict(gate="lower_bound", out=out, tuning=KdaDecodeTuning(use_pdl=True))
    kw["scratch"] = decode_scratch(8, 2, 96, 128, "cuda", 128)
    kw["counters"] = torch.zeros(8, 96, dtype=torch.int32, device="cuda")
    kda_decode(**static, **kw)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_decode(**static, **kw)
    fresh = make_inputs(
        batch=8, steps=2, pool=12, dtype=torch.bfloat16, seed=24, device="cuda", **K3
    )
    for k, v in fresh.items():
        static[k].copy_(v)
    graph.replay()
    o, conv, state = run_kernel(fresh, gate="lower_bound", use_pdl=False)
    torch.cuda.synchronize()
    assert torch.equal(out, o)
    assert torch.equal(static["conv_state"], conv)
    assert torch.equal(static["recurrent_state"], state)
    assert not kw["counters"].any()


@pytest.mark.gpu
def test_gpu_chained_pdl_steps_in_graph_equal_serial_steps():
    """Four one-token steps over 128 rows captured back to back with PDL (each step's state load
    overlaps the previous launch as far as PDL allows; the split recurrence even loads its state
    tile before its PDL wait), replayed: bit-identical to the same steps run without PDL."""
    batch = 128
    inp = make_inputs(
        batch=batch,
        steps=4,
        pool=batch + 1,
        dtype=torch.bfloat16,
        seed=25,
        device="cuda",
        slots=torch.randperm(batch).add(1).tolist(),
        **K3,
    )

    def steps(pools, use_pdl, out):
        for t in range(4):
            step = {**inp, **pools}
            for name in ("qkv", "f", "beta"):
                step[name] = inp[name][:, t : t + 1]
            decode(**step, gate="lower_bound", out=out[t], use_pdl=use_pdl)

    def fresh():
        return {
            "conv_state": inp["conv_state"].clone(),
            "recurrent_state": inp["recurrent_state"].clone(),
        }

    serial, serial_out = (
        fresh(),
        torch.empty(4, batch, 1, 96, 128, dtype=torch.bfloat16, device="cuda"),
    )
    steps(serial, False, serial_out)
    chained, chained_out = fresh(), torch.empty_like(serial_out)
    steps(chained, True, chained_out)  # eagerly with PDL first (also compiles outside capture)
    torch.cuda.synchronize()
    assert torch.equal(chained_out, serial_out)
    assert torch.equal(chained["recurrent_state"], serial["recurrent_state"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps(chained, True, chained_out)
    for _ in range(3):  # replays of the same pools: restore them first
        chained["conv_state"].copy_(inp["conv_state"])
        chained["recurrent_state"].copy_(inp["recurrent_state"])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(chained_out, serial_out)
        assert torch.equal(chained["conv_state"], serial["conv_state"])
        assert torch.equal(chained["recurrent_state"], serial["recurrent_state"])


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny shapes; threads only contend on a small CI machine
    print(json.dumps({name: CPU_CASES[name]() for name in sys.argv[1:]}))
