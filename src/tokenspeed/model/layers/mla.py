"""Gated NoPE multi-head latent attention over explicit per-request latent rows."""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import MlaConfig
from ..ops import dispatch
from ..ops.mla import (
    dequantize_rows,
    gather_pages,
    mla_decode,
    mla_prefill,
    quantize_rows_e4m3,
    split_kv_b,
)
from ..state import PagedMla
from .norm import RMSNorm

# The q and kv LoRA norms of Kimi checkpoints use eps 1e-6 whatever rms_norm_eps says.
LORA_NORM_EPS = 1e-6
# Steps where every request has at most this many new tokens (decode, verify) attend in the
# absorbed form directly over the latents; longer ones expand keys and values.
ABSORBED_MAX_TOKENS = 4


class GatedMla(nn.Module):
    """MLA without RoPE; K3 adds an output gate: o_proj(attn * sigmoid(g_proj(x))).

    forward(x [T, D], batch, latents) -> (out [T, D], new latents). Explicit latents are a list
    with request i's cached rows [prefix_i, R + Dr]; the new list appends this step's rows
    (inputs untouched). A `PagedMla` gets this step's rows written into its pages in place;
    FP8 pages (e4m3 with per-row scales) get them quantised, and every step attends to the rows
    as stored, its own included, so chunking, prefix hits and decode all see the same numbers.
    """

    def __init__(self, hidden: int, config: MlaConfig):
        super().__init__()
        self.config = config
        c = config
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, c.num_heads * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, c.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        if c.output_gate:
            self.g_proj = nn.Linear(hidden, c.num_heads * c.v_head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, hidden, bias=False)

    def latent_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The cache rows of new tokens: x [T, D] -> [T, R + Dr] (normalised latent | k_rope)."""
        rank = self.config.kv_lora_rank
        compressed = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(compressed[:, :rank]), compressed[:, rank:]], -1)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.reshape(x.shape[0], c.num_heads, c.qk_head_dim)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, Dn, R], w_uv [H, Dv, R]) views of kv_b_proj (the reference's form)."""
        c = self.config
        return split_kv_b(self.kv_b_proj.weight, c.num_heads, c.qk_nope_head_dim, c.v_head_dim)

    def _absorbed_contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of the absorbed weights for the kernels, made once per weight
        version (computed on the first eager step, before any graph capture)."""
        weight = self.kv_b_proj.weight
        key = (weight.data_ptr(), weight._version)
        cached = getattr(self, "_absorbed_cache", None)
        if cached is None or cached[0] != key:
            w_uk, w_uv = self._absorbed()
            cached = (key, w_uk.contiguous(), w_uv.contiguous())
            self._absorbed_cache = cached
        return cached[1], cached[2]

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        o = o.flatten(1)
        if self.config.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, latents: list[torch.Tensor] | PagedMla
    ) -> tuple[torch.Tensor, list[torch.Tensor] | PagedMla]:
        if isinstance(latents, PagedMla):
            return self._forward_paged(x, batch, latents), latents
        q = self._queries(x)
        rows = self.latent_rows(x)
        new_latents = [
            torch.cat([latents[i], rows[seg].to(latents[i].dtype)]) for i, seg in batch.segments()
        ]
        return self._output(self._attend_rows(q, new_latents, batch, x.dtype), x), new_latents

    def _attend_rows(
        self, q: torch.Tensor, latents: list[torch.Tensor], batch: ForwardBatch, dtype
    ) -> torch.Tensor:
        """Reference attention of the step's queries over each request's rows (its prefix and
        this step's): absorbed for few new tokens per request, expanded otherwise."""
        c = self.config
        cu_k = torch.zeros(batch.batch_size + 1, dtype=torch.int64)
        cu_k[1:] = torch.tensor([r.shape[0] for r in latents]).cumsum(0)
        # The empty piece keeps the concatenation valid for a batch of no requests (a [0, R + Dr]
        # cache); it changes no value (a cast back to `dtype` follows any promotion).
        latent = torch.cat([q.new_empty(0, c.latent_width, dtype=dtype), *latents]).to(dtype)
        if max(batch.seq_lens, default=0) <= ABSORBED_MAX_TOKENS:
            w_uk, w_uv = self._absorbed()
            return mla_decode(q, latent, w_uk, w_uv, batch.cu_seqlens, cu_k, c.softmax_scale)
        return mla_prefill(
            q,
            latent,
            self.kv_b_proj.weight,
            batch.cu_seqlens,
            cu_k,
            c.v_head_dim,
            c.softmax_scale,
        )

    def _forward_paged(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedMla):
        """Write this step's rows into their pages, then attend over the pages."""
        c = self.config
        q = self._queries(x)
        pages = cache.pages
        page_size = pages.shape[1]
        positions = batch.positions
        page = cache.page_table[batch.token_request, positions // page_size].long()
        slot = page * page_size + positions % page_size
        scales = cache.scales
        if scales is None:
            rows = self.latent_rows(x).to(pages.dtype)
        else:
            rows, row_scales = quantize_rows_e4m3(self.latent_rows(x))
            scales.view(-1).index_copy_(0, slot, row_scales)
            # As bytes: index_copy_ has no float8 kernels on every device.
            rows = rows.view(torch.uint8)
        pages.view(-1, pages.shape[-1]).view(rows.dtype).index_copy_(0, slot, rows)
        n = batch.uniform_len
        if n is not None and n <= ABSORBED_MAX_TOKENS:
            gate = self.g_proj(x) if c.output_gate else None
            w_uk, w_uv = (
                self._absorbed_contiguous() if dispatch.half_kernels(x) else self._absorbed()
            )
            o = dispatch.mla_decode(
                q,
                pages,
                cache.page_table,
                batch.context_lens,
                w_uk,
                w_uv,
                c.softmax_scale,
                gate,
                plan=batch.attn_plan,
                page_scales=scales,
            )
            return self.o_proj(o.flatten(1))  # the gate is applied already
        # Lengths from the host: the kernel plans its key chunks on the host, and reading them
        # from the device would wait for every kernel queued so far.
        o = dispatch.mla_prefill_paged(
            q,
            pages,
            cache.page_table,
            batch.cu_seqlens_host,
            torch.tensor(batch.total_lens, dtype=torch.int64),
            self.kv_b_proj.weight,
            c.v_head_dim,
            c.softmax_scale,
            page_scales=scales,
        )
        if o is None:
            # Reference (eager only): gather each request's rows and attend over them.
            if scales is not None:
                pages = dequantize_rows(pages, scales, x.dtype)
            rows = gather_pages(pages, cache.page_table)
            lens = batch.total_lens
            o = self._attend_rows(q, [rows[i, :n] for i, n in enumerate(lens)], batch, x.dtype)
        return self._output(o, x)
