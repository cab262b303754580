"""Torch references for NoPE multi-head latent attention over a latent cache.

A cache row per token is [R + Dr]: the RMS-normalised latent c (R = kv_lora_rank) followed by the
shared key part k_r (Dr = qk_rope_head_dim, never rotated). kv_b_proj maps c to per-head keys and
values: [H * (Dn + Dv), R]. Queries are [H, Dn + Dr]. For request i, its n_i queries are the last
n_i of its L_i cached rows (causal): query j sees rows 0 .. L_i - n_i + j.

Two equal forms: `mla_prefill` expands every cached row into per-head keys and values (cheap
when many queries share the rows); `mla_decode` absorbs kv_b_proj into the queries and the
output so attention runs directly over the R-wide latents (cheap for few queries per request).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn (`decode.FP8_MAX`)


def quantize_rows_e4m3(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows [..., W] -> (float8_e4m3fn rows [..., W], fp32 scales [...]), row ~= e4m3 *
    scale: the per-row scheme of the e4m3 MLA kernels (`decode.quantize_fp8_rows`, the same
    math without Triton). Each row depends on its own values only, so a row is stored the same
    whichever chunk or step wrote it."""
    amax = rows.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (rows.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_rows(
    pages: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e4m3 pages [NP, P, W] with row scales [NP, P] -> the rows they stand for, in `dtype`
    (the product in fp32, then one rounding)."""
    return (pages.float() * scales[..., None]).to(dtype)


def split_kv_b(
    kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj weight [H * (Dn + Dv), R] -> (w_uk [H, Dn, R], w_uv [H, Dv, R])."""
    w = kv_b_weight.reshape(num_heads, nope_dim + v_dim, -1)
    return w[:, :nope_dim], w[:, nope_dim:]


def _segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        n, length = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if n > length:
            raise ValueError(f"request {i} has {n} queries but only {length} cached rows")
        yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), n, length


def _causal_softmax(scores: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """scores: [H, n, L] in fp32 -> probabilities with query j limited to rows <= L - n + j."""
    rows = torch.arange(length, device=scores.device)
    limit = torch.arange(n, device=scores.device) + (length - n)
    mask = rows[None, :] > limit[:, None]  # [n, L]
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


def mla_prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Attention with keys and values expanded from the latent rows.

    q: [T, H, Dn + Dr]; latent: [Tk, R + Dr]; kv_b_weight: [H * (Dn + Dv), R];
    cu_seqlens_q: [B + 1] query offsets into q; cu_seqlens_k: [B + 1] row offsets into latent.
    Returns [T, H, Dv] in q's dtype (scores and softmax in fp32).
    """
    heads, qk_dim = q.shape[1], q.shape[2]
    rank = kv_b_weight.shape[1]
    rope_dim = latent.shape[1] - rank
    nope_dim = qk_dim - rope_dim
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for qs, ks, n, length in _segments(cu_seqlens_q, cu_seqlens_k):
        c, k_rope = latent[ks, :rank].float(), latent[ks, rank:].float()
        kv = (c @ kv_b_weight.float().t()).reshape(length, heads, nope_dim + v_head_dim)
        k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
        qf = q[qs].float()
        scores = torch.einsum("nhd,lhd->hnl", qf[..., :nope_dim], k_nope)
        scores = scores + torch.einsum("nhd,ld->hnl", qf[..., nope_dim:], k_rope)
        probs = _causal_softmax(scores * scale, n, length)
        out[qs] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed attention directly over latent rows (decode and multi-token verify).

    q: [T, H, Dn + Dr]; latent: [Tk, R + Dr]; w_uk: [H, Dn, R]; w_uv: [H, Dv, R];
    cu_seqlens_q / cu_seqlens_k: [B + 1]. Returns [T, H, Dv] in q's dtype.
    """
    nope_dim, rank = w_uk.shape[1], w_uk.shape[2]
    qf = q.float()
    # Absorb the key up-projection into the queries: [T, H, R].
    q_latent = torch.einsum("thd,hdr->thr", qf[..., :nope_dim], w_uk.float())
    q_rope = qf[..., nope_dim:]
    out = q.new_empty(q.shape[0], q.shape[1], w_uv.shape[1])
    for qs, ks, n, length in _segments(cu_seqlens_q, cu_seqlens_k):
        c, k_rope = latent[ks, :rank].float(), latent[ks, rank:].float()
        scores = torch.einsum("nhr,lr->hnl", q_latent[qs], c)
        scores = scores + torch.einsum("nhd,ld->hnl", q_rope[qs], k_rope)
        probs = _causal_softmax(scores * scale, n, length)
        o_latent = torch.einsum("hnl,lr->nhr", probs, c)
        out[qs] = torch.einsum("nhr,hdr->nhd", o_latent, w_uv.float()).to(q.dtype)
    return out


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Rows of each request in order: pages [NP, P, W], page_table [B, MP] -> [B, MP * P, W]."""
    batch, max_pages = page_table.shape
    return pages[page_table].reshape(batch, max_pages * pages.shape[1], pages.shape[2])


def mla_decode_paged(
    q: torch.Tensor,
    pages: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed attention of n queries per request over a paged latent cache.

    q: [B * n, H, Dn + Dr] (request-major, n the same for every request); pages: [NP, P, R + Dr];
    page_table: [B, MP] the pages of each request in order (unused entries may point anywhere,
    e.g. a sink page); context_lens: [B] rows of each request including this step's n, whose
    queries sit at its last n positions. Shapes are static and nothing syncs with the host, so
    this runs inside a CUDA graph. Returns [B * n, H, Dv] in q's dtype.
    """
    batch = page_table.shape[0]
    n = q.shape[0] // batch
    nope_dim, rank = w_uk.shape[1], w_uk.shape[2]
    rows = gather_pages(pages, page_table).float()  # [B, L, W]
    c, k_rope = rows[..., :rank], rows[..., rank:]
    qf = q.float().reshape(batch, n, q.shape[1], q.shape[2])
    q_latent = torch.einsum("bnhd,hdr->bnhr", qf[..., :nope_dim], w_uk.float())
    scores = torch.einsum("bnhr,blr->bhnl", q_latent, c)
    scores = scores + torch.einsum("bnhd,bld->bhnl", qf[..., nope_dim:], k_rope)
    last = context_lens[:, None] - n + torch.arange(n, device=q.device)  # [B, n] last visible row
    hidden = torch.arange(rows.shape[1], device=q.device)[None, None, :] > last[:, :, None]
    probs = (scores * scale).masked_fill(hidden[:, None], float("-inf")).softmax(-1)
    o_latent = torch.einsum("bhnl,blr->bnhr", probs, c)
    out = torch.einsum("bnhr,hdr->bnhd", o_latent, w_uv.float())
    return out.reshape(batch * n, q.shape[1], w_uv.shape[1]).to(q.dtype)
