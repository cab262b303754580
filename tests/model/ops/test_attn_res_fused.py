"""Fused AttnRes mix + RMSNorm (+ bank update) against the torch references.

CPU interpreter: fp32 (1e-5) and fp16 (1 fp16 ulp of the output scale) on small shapes,
strided bank views, with and without the partial-sum update. GPU: K3 hidden 7168 in bf16,
1-9 entries; the updated partial must equal torch's bf16 add exactly; the output within
2 bf16 ulps (relative 1.6e-2) of the reference; also against fla-core's naive_attnres.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.model.ops.attn_res.fused import (
    AttnResTuning,
    attn_res_mix_norm,
    default_launch,
    mix_norm_reference,
)

from .triton_interpreter import results_for


def make_bank(entries, tokens, dim, seed, dtype, device="cpu", slots=None):
    """A bank view bank_buf[:entries] of a [slots, T, D] buffer, entries of varied scale."""
    gen = torch.Generator().manual_seed(seed)
    slots = slots or entries
    buf = torch.randn(slots, tokens, dim, generator=gen) * (
        torch.rand(slots, tokens, 1, generator=gen) * 4 + 0.1
    )
    query = torch.randn(1, dim, generator=gen) * dim**-0.5 * 4
    mix_w = torch.rand(dim, generator=gen) + 0.5
    norm_w = torch.rand(dim, generator=gen) + 0.5
    delta = torch.randn(tokens, dim, generator=gen)
    cast = [t.to(device, dtype) for t in (buf, query, mix_w, norm_w, delta)]
    return cast[0][:entries], *cast[1:]


def check(
    entries,
    with_delta,
    accumulate,
    dtype,
    tokens=5,
    dim=48,
    slots=None,
    device="cpu",
    atol=None,
    block_entries=None,
    stages=None,
    bank_eviction="evict_first",
):
    bank, query, mix_w, norm_w, delta = make_bank(
        entries, tokens, dim, entries, dtype, device, slots
    )
    delta = delta if with_delta else None
    before = bank.clone()
    want, want_partial = mix_norm_reference(
        bank, query, mix_w, 1e-6, norm_w, 1e-5, delta=delta, accumulate=accumulate
    )
    got = attn_res_mix_norm(
        bank,
        query,
        mix_w,
        1e-6,
        norm_w,
        1e-5,
        delta=delta,
        accumulate=accumulate,
        tuning=AttnResTuning(
            block_entries=block_entries, stages=stages, bank_eviction=bank_eviction
        ),
    )
    assert got.dtype == dtype and got.shape == (tokens, dim)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    assert torch.equal(bank[:-1], before[:-1])  # completed entries untouched
    assert torch.equal(bank[-1], want_partial if with_delta else before[-1])


def _case_decoder_slot_protocol():
    """The wiring described in fused.py: a [slots, T, D] buffer, the partial in slot n, the
    previous MLP output as delta, reproduces `DecoderLayer.forward_attn_res` + the final
    output mix and norm (list-based, written out below)."""
    from tokenspeed.model.ops.attn_res.reference import attn_res_mix
    from tokenspeed.model.ops.norm import rms_norm

    gen = torch.Generator().manual_seed(0)
    tokens, dim, layers, block = 3, 32, 5, 2
    emb = torch.randn(tokens, dim, generator=gen)
    w = [
        {k: torch.rand(dim, generator=gen) + 0.5 for k in ("q1", "m1", "n1", "q2", "m2", "n2")}
        for _ in range(layers)
    ]
    final = {k: torch.rand(dim, generator=gen) + 0.5 for k in ("q", "m", "n")}
    attn = [torch.randn(dim, dim, generator=gen) / dim**0.5 for _ in range(layers)]
    mlp = [torch.randn(dim, dim, generator=gen) / dim**0.5 for _ in range(layers)]

    # list-based, as layers/decoder.py and kimi.py do it
    bank, partial = [], emb
    for i in range(layers):
        x = attn_res_mix([*bank, partial], w[i]["q1"], w[i]["m1"], 1e-6) if bank else partial
        if i % block == 0:
            bank.append(partial)
            partial = None
        out = rms_norm(x, w[i]["n1"], 1e-6) @ attn[i]
        partial = out if partial is None else partial + out
        x = attn_res_mix([*bank, partial], w[i]["q2"], w[i]["m2"], 1e-6)
        partial = partial + rms_norm(x, w[i]["n2"], 1e-6) @ mlp[i]
    want = rms_norm(attn_res_mix([*bank, partial], final["q"], final["m"], 1e-6), final["n"], 1e-6)

    # slot buffer + fused kernel
    buf = torch.empty(layers // block + 2, tokens, dim)
    buf[0] = emb
    n, pending = 0, None
    for i in range(layers):
        x = attn_res_mix_norm(
            buf[: n + 1], w[i]["q1"], w[i]["m1"], 1e-6, w[i]["n1"], 1e-6, delta=pending
        )
        opened = i % block == 0
        n += int(opened)
        out = x @ attn[i]
        x = attn_res_mix_norm(
            buf[: n + 1],
            w[i]["q2"],
            w[i]["m2"],
            1e-6,
            w[i]["n2"],
            1e-6,
            delta=out,
            accumulate=not opened,
        )
        pending = x @ mlp[i]
    got = attn_res_mix_norm(
        buf[: n + 1], final["q"], final["m"], 1e-6, final["n"], 1e-6, delta=pending
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


CASES = {
    "decoder-slot-protocol": _case_decoder_slot_protocol,
    "fp32-one-entry": lambda: check(1, False, True, torch.float32, atol=1e-5),
    "fp32-three-accumulate": lambda: check(3, True, True, torch.float32, atol=1e-5),
    "fp32-five-replace-strided": lambda: check(5, True, False, torch.float32, slots=8, atol=1e-5),
    "fp32-four-no-delta-pow2": lambda: check(4, False, True, torch.float32, dim=64, atol=1e-5),
    "fp16-three-accumulate": lambda: check(3, True, True, torch.float16, atol=2e-3),
    "fp16-nine-no-delta": lambda: check(9, False, True, torch.float16, atol=2e-3),
    # Several completed entries per load: full tiles, a ragged last tile, a lone partial.
    "fp32-five-accumulate-tiles-of-2": lambda: check(
        5, True, True, torch.float32, atol=1e-5, block_entries=2
    ),
    "fp32-nine-replace-strided-tiles-of-4": lambda: check(
        9, True, False, torch.float32, slots=12, atol=1e-5, block_entries=4
    ),
    "fp32-three-accumulate-one-tile-of-4": lambda: check(
        3, True, True, torch.float32, atol=1e-5, block_entries=4
    ),
    "fp32-one-entry-tiles-of-4": lambda: check(
        1, True, True, torch.float32, atol=1e-5, block_entries=4
    ),
    "fp16-three-no-delta-tiles-of-1": lambda: check(
        3, False, True, torch.float16, atol=2e-3, block_entries=1
    ),
    # The unrolled form (block_entries 0); one entry takes no score (its softmax weight is 1).
    "fp32-three-accumulate-unrolled": lambda: check(
        3, True, True, torch.float32, atol=1e-5, block_entries=0
    ),
    "fp32-five-replace-strided-unrolled": lambda: check(
        5, True, False, torch.float32, slots=8, atol=1e-5, block_entries=0
    ),
    "fp32-one-entry-unrolled": lambda: check(
        1, True, True, torch.float32, atol=1e-5, block_entries=0
    ),
    "fp16-nine-no-delta-unrolled": lambda: check(
        9, False, True, torch.float16, atol=2e-3, block_entries=0
    ),
    # The loop form with the pipeliner's prefetch instead of the register one.
    "fp32-five-accumulate-tiles-of-2-stages-3": lambda: check(
        5, True, True, torch.float32, atol=1e-5, block_entries=2, stages=3
    ),
    "fp16-nine-replace-tiles-of-1-stages-2": lambda: check(
        9, True, False, torch.float16, atol=2e-3, block_entries=1, stages=2
    ),
    # The completed entries' cache hint is a tuning knob: no hint gives the same result.
    "fp32-five-accumulate-tiles-of-2-no-hint": lambda: check(
        5, True, True, torch.float32, atol=1e-5, block_entries=2, bank_eviction=""
    ),
}


@pytest.fixture(scope="module")
def interpreter_results():
    return results_for(__name__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attn_res_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] is None, interpreter_results[case]


def test_rejects_bad_banks():
    bank = torch.zeros(2, 3, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="contiguous"):
        attn_res_mix_norm(bank.transpose(1, 2), w, w, 1e-6, w, 1e-6)
    with pytest.raises(ValueError, match="1..16"):
        attn_res_mix_norm(torch.zeros(17, 3, 8), w, w, 1e-6, w, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        attn_res_mix_norm(bank, w, w, 1e-6, w, 1e-6, delta=torch.zeros(3, 4))
    with pytest.raises(TypeError, match="AttnResTuning"):
        attn_res_mix_norm(bank, w, w, 1e-6, w, 1e-6, tuning={"num_warps": 4})


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_entries", 3),
        ("block_entries", -2),
        ("num_warps", 6),
        ("stages", 1),
        ("stages", -1),
        ("bank_eviction", "evict_normal"),
    ],
    ids=str,
)
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AttnResTuning(**{field: value})


def test_tuning_defaults_are_the_measured_ones():
    """By bank size (`default_launch`, pinned below) and evict-first bank loads."""
    assert AttnResTuning() == AttnResTuning(
        block_entries=None, num_warps=None, stages=None, bank_eviction="evict_first"
    )
    assert len(attrs.fields(AttnResTuning)) == 4  # a new knob needs its default pinned here
    assert AttnResTuning().resolve(8, 7168, 16384) == default_launch(8, 7168, 16384)
    # Given knobs win; stages default to the register prefetch once block_entries is given.
    assert AttnResTuning(block_entries=2, num_warps=2).resolve(8, 7168, 16384) == (2, 2, 0)
    assert AttnResTuning(stages=3).resolve(8, 7168, 16384) == (1, 4, 3)
    assert AttnResTuning(block_entries=0, stages=3).resolve(8, 7168, 16384) == (0, 4, 0)


def test_tuning_reaches_the_launch(monkeypatch):
    from tokenspeed.model.ops.attn_res import fused

    seen = {}

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(kw)

    monkeypatch.setattr(fused, "_mix_norm_kernel", Spy())
    bank, w = torch.zeros(5, 3, 8), torch.ones(8)
    tuning = AttnResTuning(block_entries=2, num_warps=2, stages=3, bank_eviction="evict_last")
    attn_res_mix_norm(bank, w, w, 1e-6, w, 1e-6, tuning=tuning)
    assert (seen["BL"], seen["num_warps"], seen["STAGES"]) == (2, 2, 3)
    assert seen["EVICT_BANK"] == "evict_last"
    attn_res_mix_norm(bank, w, w, 1e-6, w, 1e-6)
    assert (seen["BL"], seen["num_warps"], seen["STAGES"]) == (*default_launch(5, 8, 3)[:2], 0)
    assert seen["EVICT_BANK"] == "evict_first"


def test_default_launch_by_bank_size():
    # K3 hidden size (docs/perf/attn_res.md): 8 warps at decode sizes, the register prefetch in
    # between, the pipelined entry loop for 3+ entries from 4k tokens; small rows unrolled.
    assert default_launch(2, 7168, 1) == (0, 8, 0)
    assert default_launch(8, 7168, 16) == (2, 8, 0)
    assert default_launch(3, 7168, 1) == (4, 8, 0)  # one tile holds all entries
    assert default_launch(4, 7168, 64) == (4, 8, 0)
    assert default_launch(8, 7168, 256) == (1, 4, 0)
    assert default_launch(2, 7168, 16384) == (0, 4, 0)
    assert default_launch(4, 7168, 4096) == (1, 4, 3)
    assert default_launch(8, 7168, 16384) == (1, 4, 4)
    assert default_launch(8, 48, 16384) == (0, 2, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("entries", [1, 2, 5, 9])
@pytest.mark.parametrize("tokens", [1, 7, 4096])
@pytest.mark.parametrize("with_delta,accumulate", [(False, True), (True, True), (True, False)])
def test_k3_hidden_bf16(entries, tokens, with_delta, accumulate):
    check(
        entries,
        with_delta,
        accumulate,
        torch.bfloat16,
        tokens=tokens,
        dim=7168,
        slots=10,
        device="cuda",
        atol=1.6e-2,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("entries", [2, 5, 9])
@pytest.mark.parametrize("block_entries", [0, 1, 2, 4])
def test_k3_hidden_bf16_entry_tiles(entries, block_entries):
    check(
        entries,
        True,
        True,
        torch.bfloat16,
        tokens=300,
        dim=7168,
        slots=10,
        device="cuda",
        atol=1.6e-2,
        block_entries=block_entries,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("bank_eviction", ["", "evict_last"])
@pytest.mark.parametrize("block_entries", [0, 2])
def test_k3_hidden_bf16_bank_eviction(bank_eviction, block_entries):
    check(
        5,
        True,
        True,
        torch.bfloat16,
        tokens=36,
        dim=7168,
        slots=10,
        device="cuda",
        atol=1.6e-2,
        block_entries=block_entries,
        bank_eviction=bank_eviction,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("entries", [2, 5, 9])
@pytest.mark.parametrize("block_entries,stages", [(1, 2), (1, 3), (2, 3), (1, 4)])
def test_k3_hidden_bf16_pipelined(entries, block_entries, stages):
    check(
        entries,
        True,
        True,
        torch.bfloat16,
        tokens=300,
        dim=7168,
        slots=10,
        device="cuda",
        atol=1.6e-2,
        block_entries=block_entries,
        stages=stages,
    )


@pytest.mark.gpu
def test_matches_fla_naive_attnres():
    # fla's reference normalises in one fp32 pass (no bf16 rounding of the mix before the
    # norm), so the two agree to bf16 rounding, not bit for bit.
    from fla.ops.attnres import naive_attnres

    bank, query, mix_w, norm_w, _ = make_bank(6, 256, 7168, 3, torch.bfloat16, "cuda")
    got = attn_res_mix_norm(bank, query, mix_w, 1e-6, norm_w, 1e-6)
    want = naive_attnres(query.reshape(-1), list(bank.unbind(0)), mix_w, norm_w, 1e-6)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_cuda_graph_replay():
    bank, query, mix_w, norm_w, delta = make_bank(4, 64, 7168, 5, torch.bfloat16, "cuda")
    eager_bank = bank.clone()
    eager = attn_res_mix_norm(eager_bank, query, mix_w, 1e-6, norm_w, 1e-6, delta=delta)
    static = bank.clone()
    attn_res_mix_norm(static.clone(), query, mix_w, 1e-6, norm_w, 1e-6, delta=delta)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_res_mix_norm(static, query, mix_w, 1e-6, norm_w, 1e-6, delta=delta)
    static.copy_(bank)
    graph.replay()
    assert torch.equal(out, eager) and torch.equal(static, eager_bank)
