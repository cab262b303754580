"""Latent attention: the expanded and absorbed forms against a from-scratch attention."""

import math

import pytest
import torch

from tokenspeed.model.ops.mla import mla_decode, mla_prefill, split_kv_b

H, R, DN, DR, DV = 3, 10, 6, 4, 5


def _setup(lengths, queries, seed=0):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(sum(lengths), R + DR, generator=gen)
    q = torch.randn(sum(queries), H, DN + DR, generator=gen)
    w = torch.randn(H * (DN + DV), R, generator=gen) / R**0.5
    cu_q = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, latent, w, cu_q, cu_k


def _naive(q, latent, w, cu_q, cu_k, scale):
    out = torch.zeros(q.shape[0], H, DV)
    kv = (latent[:, :R] @ w.t()).view(-1, H, DN + DV)
    for i in range(len(cu_q) - 1):
        n, length = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i])
        for j in range(n):
            visible = length - n + j + 1
            rows = slice(int(cu_k[i]), int(cu_k[i]) + visible)
            for h in range(H):
                keys = torch.cat([kv[rows, h, :DN], latent[rows, R:]], -1)
                p = torch.softmax(keys @ q[int(cu_q[i]) + j, h] * scale, 0)
                out[int(cu_q[i]) + j, h] = p @ kv[rows, h, DN:]
    return out


@pytest.mark.parametrize("queries", [[1, 1, 1], [4, 2, 3], [9, 1, 20]])
def test_both_forms_match_naive_attention(queries):
    lengths = [12, 1, 40] if queries[1] == 1 else [12, 5, 40]
    q, latent, w, cu_q, cu_k = _setup(lengths, queries)
    scale = 1 / math.sqrt(DN + DR)
    want = _naive(q, latent, w, cu_q, cu_k, scale)
    w_uk, w_uv = split_kv_b(w, H, DN, DV)
    assert (mla_prefill(q, latent, w, cu_q, cu_k, DV, scale) - want).abs().max() <= 1e-5
    assert (mla_decode(q, latent, w_uk, w_uv, cu_q, cu_k, scale) - want).abs().max() <= 1e-5


def test_more_queries_than_rows_is_rejected():
    q, latent, w, cu_q, cu_k = _setup([2], [3])
    with pytest.raises(ValueError, match="3 queries but only 2 cached rows"):
        mla_prefill(q, latent, w, cu_q, cu_k, DV, 1.0)
