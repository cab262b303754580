"""`KimiForCausalLM`: Kimi Linear and Kimi K3 as one decoder over packed variable-length batches.

The forward takes the step's tokens, their layout (`ForwardBatch`) and the requests' state
(`DecoderState`) and hands back logits and the advanced state. The model owns no cache, so the
same forward serves full prefill, extension of a cached prefix, single-token decode and
multi-token verification.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import nn

from .batch import BatchError, ForwardBatch
from .config import ModelConfig
from .layers.attn_res import AttnResMix
from .layers.decoder import DecoderLayer
from .layers.moe import MoE
from .layers.norm import RMSNorm
from .ops import dispatch
from .state import DecoderState, PagedState


@attrs.frozen(eq=False)
class ForwardOutput:
    """logits: [N, vocab] for the selected tokens (all T by default); state: after the step."""

    logits: torch.Tensor
    state: DecoderState | PagedState


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.uses_attn_res:
            self.output_attn_res = AttnResMix(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        state: DecoderState | PagedState,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, DecoderState | PagedState]:
        """input_ids: [T] -> (final hidden states [T, D] after the output norm, new state).

        A `PagedState` is updated in place and returned as the new state. `before_layer(i)` runs
        before layer i reads its state (the runtime waits there for that layer's prefix copies).
        """
        hidden = self.embed_tokens(input_ids)
        if self.config.uses_attn_res and dispatch.half_kernels(hidden):
            return self._forward_fused_attn_res(hidden, batch, state, before_layer)
        kda, mla = {}, {}
        bank: list[torch.Tensor] = []
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer.index)
            states = state.kda if layer.kind == "kda" else state.mla
            layer_state = states[layer.index]
            if self.config.uses_attn_res:
                hidden, new = layer.forward_attn_res(hidden, bank, batch, layer_state)
            else:
                hidden, new = layer(hidden, batch, layer_state)
            (kda if layer.kind == "kda" else mla)[layer.index] = new
        if self.config.uses_attn_res:
            hidden = self.output_attn_res([*bank, hidden])
        if isinstance(state, PagedState):
            return self.norm(hidden), state
        new_state = DecoderState(kda=kda, mla=mla, num_tokens=list(batch.total_lens))
        return self.norm(hidden), new_state

    def _forward_fused_attn_res(self, hidden, batch, state, before_layer):
        """The attention-residual stream with each mix, its following RMSNorm and the residual
        add fused in one kernel (ops.attn_res.fused) over a preallocated bank: slots 0..n-1
        hold completed block sums (slot 0 the embedding), slot n the running partial sum."""
        cfg = self.config
        block = cfg.attn_res_block_size
        eps = cfg.rms_norm_eps
        slots = -(-cfg.num_layers // block) + 1
        bank = hidden.new_empty(slots, *hidden.shape)
        bank[0] = hidden
        n, pending = 0, None
        kda, mla = {}, {}
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer.index)
            site = layer.self_attention_res
            x = dispatch.attn_res_mix_norm(
                bank[: n + 1],
                site.proj.weight,
                site.norm.weight,
                eps,
                layer.input_layernorm.weight,
                layer.input_layernorm.eps,
                delta=pending,
            )
            # A layer at a block boundary closes the running sum into a completed entry (at layer
            # 0: the embedding) and starts a new partial with its attention output.
            opened = layer.index % block == 0
            n += opened
            states = state.kda if layer.kind == "kda" else state.mla
            out, new = layer.self_attn(x, batch, states[layer.index])
            (kda if layer.kind == "kda" else mla)[layer.index] = new
            site = layer.mlp_res
            x = dispatch.attn_res_mix_norm(
                bank[: n + 1],
                site.proj.weight,
                site.norm.weight,
                eps,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.eps,
                delta=out,
                accumulate=not opened,
            )
            pending = layer.mlp(x)
        site = self.output_attn_res
        hidden = dispatch.attn_res_mix_norm(
            bank[: n + 1],
            site.proj.weight,
            site.norm.weight,
            eps,
            self.norm.weight,
            self.norm.eps,
            delta=pending,
        )
        if isinstance(state, PagedState):
            return hidden, state
        return hidden, DecoderState(kda=kda, mla=mla, num_tokens=list(batch.total_lens))


class KimiForCausalLM(nn.Module):
    """The decoder plus the LM head.

    forward(input_ids [T], batch, state, logits_indices=None) -> ForwardOutput. Pass
    `logits_indices` (e.g. `batch.last_token_indices`) to compute logits for some tokens only.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = KimiModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def check_inputs(
        self, input_ids: torch.Tensor, batch: ForwardBatch, state: DecoderState | PagedState
    ):
        """Raise BatchError naming the problem when the step's inputs are inconsistent."""
        if input_ids.dim() != 1:
            raise BatchError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() != batch.num_tokens:
            raise BatchError(
                f"input_ids has {input_ids.numel()} tokens but the batch layout has "
                f"{batch.num_tokens}"
            )
        if input_ids.numel():
            low, high = int(input_ids.min()), int(input_ids.max())
            vocab = self.config.vocab_size
            if low < 0 or high >= vocab:
                bad = input_ids[(input_ids < 0) | (input_ids >= vocab)].unique().tolist()[:8]
                raise BatchError(f"token ids {bad} are outside the vocabulary [0, {vocab})")
        if isinstance(state, PagedState):
            return  # the cache that built the pools and tables owns their consistency
        if state.batch_size != batch.batch_size:
            raise BatchError(
                f"state holds {state.batch_size} requests but the batch has {batch.batch_size}"
            )
        if tuple(state.num_tokens) != batch.prefix_lens:
            raise BatchError(
                f"state has seen {state.num_tokens} tokens per request but the batch says "
                f"prefix_lens={list(batch.prefix_lens)}"
            )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        state: DecoderState | PagedState,
        logits_indices: torch.Tensor | None = None,
        check: bool = True,
        before_layer: Callable[[int], None] | None = None,
    ) -> ForwardOutput:
        """check=False skips the input checks (they read values back from the device, which a
        CUDA graph capture cannot do; the runner validates before filling its buffers)."""
        if check:
            self.check_inputs(input_ids, batch, state)
        hidden, new_state = self.model(input_ids, batch, state, before_layer)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return ForwardOutput(logits=self.lm_head(hidden), state=new_state)

    def overlap_shared_experts(self, enabled: bool = True) -> None:
        """Run every MoE layer's shared experts on one second CUDA stream, overlapping the
        routed experts (captured into CUDA graphs as a fork/join)."""
        from .ops.moe.overlap import SideStream

        device = self.lm_head.weight.device
        side = SideStream(device, enabled=enabled) if device.type == "cuda" else None
        for module in self.modules():
            if isinstance(module, MoE):
                module.side_stream = side

    def empty_state(self, batch_size: int = 1) -> DecoderState:
        """Fresh state for `batch_size` new requests, on the model's device and dtype."""
        weight = self.lm_head.weight
        return DecoderState.empty(self.config, batch_size, weight.dtype, weight.device)
