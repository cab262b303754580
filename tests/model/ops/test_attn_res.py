"""AttnRes mix against fla-core's naive reference."""

import warnings

import pytest
import torch

from tokenspeed.model.ops.attn_res import attn_res_mix

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fla.ops.attnres.naive import naive_attnres


@pytest.mark.parametrize("entries", [1, 2, 5, 9])
def test_matches_fla_naive(entries):
    gen = torch.Generator().manual_seed(entries)
    bank = [torch.randn(11, 32, generator=gen) * (i + 1) for i in range(entries)]
    query = torch.randn(1, 32, generator=gen)
    norm = torch.rand(32, generator=gen) + 0.5
    got = attn_res_mix(bank, query, norm, 1e-6)
    want = naive_attnres(query.reshape(-1), bank, norm, rms_eps=1e-6)
    assert (got - want).abs().max() <= 1e-5


def test_weights_sum_to_one_so_equal_entries_pass_through():
    x = torch.randn(4, 16)
    got = attn_res_mix([x, x, x], torch.randn(16), torch.ones(16), 1e-6)
    assert torch.allclose(got, x, atol=1e-6)


def test_bf16_bank_mixes_in_fp32():
    gen = torch.Generator().manual_seed(0)
    bank = [torch.randn(3, 64, generator=gen) for _ in range(4)]
    q, w = torch.randn(64, generator=gen), torch.rand(64, generator=gen)
    got = attn_res_mix([b.bfloat16() for b in bank], q, w, 1e-6)
    want = attn_res_mix([b.bfloat16().float() for b in bank], q, w, 1e-6)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2e-2
