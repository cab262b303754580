"""Gated NoPE multi-head latent attention over explicit per-request latent rows."""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import MlaConfig
from ..ops.mla import mla_decode, mla_prefill, split_kv_b
from .norm import RMSNorm

# The q and kv LoRA norms of Kimi checkpoints use eps 1e-6 whatever rms_norm_eps says.
LORA_NORM_EPS = 1e-6
# Steps where every request has at most this many new tokens (decode, verify) attend in the
# absorbed form directly over the latents; longer ones expand keys and values.
ABSORBED_MAX_TOKENS = 4


class GatedMla(nn.Module):
    """MLA without RoPE; K3 adds an output gate: o_proj(attn * sigmoid(g_proj(x))).

    forward(x [T, D], batch, latents) -> (out [T, D], new latents). latents[i] holds request i's
    cached rows [prefix_i, R + Dr]; the new list appends this step's rows (inputs untouched).
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

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, latents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        tokens = x.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(tokens, c.num_heads, c.qk_head_dim)
        rows = self.latent_rows(x).to(latents[0].dtype)
        new_latents = [
            torch.cat([latents[i], rows[seg]]) for i, seg in batch.segments()
        ]
        cu_k = torch.zeros(batch.batch_size + 1, dtype=torch.int64)
        cu_k[1:] = torch.tensor(batch.total_lens).cumsum(0)
        latent = torch.cat(new_latents).to(x.dtype)
        if max(batch.seq_lens) <= ABSORBED_MAX_TOKENS:
            w_uk, w_uv = split_kv_b(
                self.kv_b_proj.weight, c.num_heads, c.qk_nope_head_dim, c.v_head_dim
            )
            o = mla_decode(q, latent, w_uk, w_uv, batch.cu_seqlens, cu_k, c.softmax_scale)
        else:
            o = mla_prefill(
                q, latent, self.kv_b_proj.weight, batch.cu_seqlens, cu_k, c.v_head_dim,
                c.softmax_scale,
            )
        o = o.reshape(tokens, -1)
        if c.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o), new_latents
