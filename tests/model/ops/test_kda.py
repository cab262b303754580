"""KDA references against fla-core 0.6.0's naive ops (written by others) and each other."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.model.ops.kda import kda_chunked, kda_gate, kda_recurrent

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton has no GPU here
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

TIGHT = 1e-5


def _inputs(seed, batch=2, steps=77, heads=3, kdim=16, vdim=12, gate="softplus"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, steps, heads, kdim, generator=gen)
    k = F.normalize(torch.randn(batch, steps, heads, kdim, generator=gen), dim=-1)
    v = torch.randn(batch, steps, heads, vdim, generator=gen)
    f = torch.randn(batch, steps, heads, kdim, generator=gen) * 2
    a_log = torch.rand(heads, generator=gen) * 2
    dt_bias = torch.randn(heads * kdim, generator=gen)
    g = kda_gate(f, a_log, dt_bias, gate)
    beta = torch.rand(batch, steps, heads, generator=gen)
    h0 = torch.randn(batch, heads, kdim, vdim, generator=gen)
    return q, k, v, g, beta, h0, (f, a_log, dt_bias)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_recurrent_matches_fla_naive(gate):
    q, k, v, g, beta, h0, _ = _inputs(0, gate=gate)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o - o_ref).abs().max() <= TIGHT
    assert (s - s_ref).abs().max() <= TIGHT


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_gates_match_fla(gate):
    _, _, _, g, _, _, (f, a_log, dt_bias) = _inputs(1, gate=gate)
    if gate == "softplus":
        ref = naive_kda_gate(f, a_log, dt_bias)
    else:
        ref = naive_kda_lowerbound_gate(f, a_log, dt_bias, lower_bound=-5.0)
    assert (g - ref).abs().max() <= TIGHT


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("chunk_size", [1, 16, 64, 200])
def test_chunked_equals_recurrent(gate, chunk_size):
    q, k, v, g, beta, h0, _ = _inputs(2, gate=gate, steps=150)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    oc, sc = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    assert (o - oc).abs().max() <= 1e-4
    assert (s - sc).abs().max() <= 1e-4


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_fla_naive_chunk(gate, chunk_size):
    # fla's chunked reference needs T to be a multiple of the chunk size.
    q, k, v, g, beta, h0, _ = _inputs(6, gate=gate, steps=128)
    oc, sc = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    o_ref, s_ref = naive_chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )
    assert (oc - o_ref).abs().max() <= 1e-4
    assert (sc - s_ref).abs().max() <= 1e-4


def test_chunked_survives_strong_decay_over_long_chunks():
    # Per-step log-decay down to -20 over 64 steps would overflow exp(-cumsum) formulations.
    q, k, v, g, beta, h0, _ = _inputs(3, steps=128)
    g = g.clamp(max=0) * 10
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    oc, sc = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=64)
    assert torch.isfinite(oc).all()
    assert (o - oc).abs().max() <= 1e-4
    assert (s - sc).abs().max() <= 1e-4


def test_state_carries_across_calls():
    q, k, v, g, beta, h0, _ = _inputs(4, steps=40)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o1, s1 = kda_chunked(
        q[:, :25], k[:, :25], v[:, :25], g[:, :25], beta[:, :25], initial_state=h0, chunk_size=8
    )
    o2, s2 = kda_recurrent(
        q[:, 25:], k[:, 25:], v[:, 25:], g[:, 25:], beta[:, 25:], initial_state=s1
    )
    assert (torch.cat([o1, o2], 1) - o).abs().max() <= 1e-4
    assert (s2 - s).abs().max() <= 1e-4


def test_output_dtype_follows_values_and_state_is_fp32():
    q, k, v, g, beta, h0, _ = _inputs(5, steps=9)
    o, s = kda_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=h0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
