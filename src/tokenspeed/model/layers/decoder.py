"""One decoder layer: token mixer (KDA or MLA) and MLP (dense or MoE), with plain or
attention residuals."""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from .attn_res import AttnResMix
from .kda import KdaAttention
from .mla import GatedMla
from .mlp import GluMlp
from .moe import MoE
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.kind = config.layer_kinds[index]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if self.kind == "kda":
            self.self_attn = KdaAttention(hidden, config.kda, eps)
        else:
            self.self_attn = GatedMla(hidden, config.mla)
        if config.mlp_kinds[index] == "moe":
            self.mlp = MoE(hidden, config.moe, config.activation, eps)
        else:
            self.mlp = GluMlp(hidden, config.dense_intermediate_size, config.activation)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.block_size = config.attn_res_block_size
        if self.block_size is not None:
            self.self_attention_res = AttnResMix(hidden, eps)
            self.mlp_res = AttnResMix(hidden, eps)

    def mix_tokens(self, x: torch.Tensor, batch: ForwardBatch, state):
        """Token mixer on the normalised input; returns (output [T, D], new layer state)."""
        return self.self_attn(self.input_layernorm(x), batch, state)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, state):
        """Plain residual stream: hidden [T, D] -> (hidden, new layer state)."""
        out, new_state = self.mix_tokens(hidden, batch, state)
        hidden = hidden + out
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, new_state

    def forward_attn_res(
        self, partial: torch.Tensor, bank: list[torch.Tensor], batch: ForwardBatch, state
    ):
        """Attention-residual stream.

        partial: [T, D] the running sum of the current block (the embedding before layer 0);
        bank: completed block sums, oldest first (extended in place when this layer opens a
        new block). Each sub-layer reads a softmax mix of bank + [partial] instead of a plain
        residual. Returns (new partial, new layer state).
        """
        x = self.self_attention_res([*bank, partial]) if bank else partial
        if self.index % self.block_size == 0:
            bank.append(partial)  # close the previous block (the embedding at layer 0)
            partial = None
        out, new_state = self.mix_tokens(x, batch, state)
        partial = out if partial is None else partial + out
        x = self.mlp_res([*bank, partial])
        partial = partial + self.mlp(self.post_attention_layernorm(x))
        return partial, new_state
