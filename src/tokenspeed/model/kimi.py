"""`KimiForCausalLM`: Kimi Linear and Kimi K3 as one decoder over packed variable-length batches.

The forward takes the step's tokens, their layout (`ForwardBatch`) and the requests' state
(`DecoderState`) and hands back logits and the advanced state. The model owns no cache, so the
same forward serves full prefill, extension of a cached prefix, single-token decode and
multi-token verification.

For speculative decoding (EAGLE3) the forward can also hand back the hidden states at a few
capture points (`aux_hidden_layers`, see `AuxCapture`); off by default, and then nothing of it
runs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

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
    """logits: [N, vocab] for the selected tokens (all T by default); state: after the step;
    aux_hidden: with `aux_hidden_layers`, [T, len(aux_hidden_layers) * D] the hidden states at
    those capture points concatenated in the order given, for every token of the step (not only
    the `logits_indices` ones); None otherwise."""

    logits: torch.Tensor
    state: DecoderState | PagedState
    aux_hidden: torch.Tensor | None = None


class AuxCapture:
    """Hidden states taken at capture points during one forward (EAGLE3's auxiliary states).

    Point i < num_layers is the residual stream entering layer i: what its input norm reads
    (with attention residuals, the pre-norm mix of the bank that layer reads; at layer 0, the
    embedding). Point num_layers is the final hidden state before the output norm. This is
    SGLang's `layers_to_capture` convention: "the output of layer j" is point j + 1.
    """

    def __init__(self, points: Sequence[int], num_layers: int):
        if isinstance(points, str | bytes) or not isinstance(points, Sequence) or not points:
            raise BatchError(f"aux_hidden_layers must be a non-empty sequence, got {points!r}")
        checked = []
        for point in points:
            try:
                if isinstance(point, bool):
                    raise TypeError
                checked.append(operator.index(point))
            except TypeError:
                raise BatchError(f"aux_hidden_layers holds {point!r}, not an integer") from None
        bad = [p for p in checked if not 0 <= p <= num_layers]
        if bad:
            raise BatchError(
                f"aux_hidden_layers {bad} are outside 0..{num_layers} (layer inputs 0.."
                f"{num_layers - 1}, {num_layers}: the final hidden state)"
            )
        if len(set(checked)) != len(checked):
            raise BatchError(f"aux_hidden_layers {checked} repeats a point")
        self.points = tuple(checked)
        self._wanted = frozenset(checked)
        self.taken: dict[int, torch.Tensor] = {}

    def wants(self, point: int) -> bool:
        return point in self._wanted

    def take(self, point: int, hidden: torch.Tensor) -> None:
        if point in self._wanted:
            self.taken[point] = hidden

    def stacked(self) -> torch.Tensor:
        """[T, len(points) * D]: the captured states side by side, in the order asked."""
        return torch.cat([self.taken[p] for p in self.points], dim=-1)


def _prefix_lens(batch: ForwardBatch) -> tuple[int, ...]:
    """Tokens each request had before the step (a graph runner's batch leaves `prefix_lens`
    None: they are then read back from its context lengths)."""
    if batch.prefix_lens is not None:
        return batch.prefix_lens
    return tuple(t - n for t, n in zip(batch.total_lens, batch.seq_lens, strict=True))


def _check_layers(kind: str, states: dict, layers: tuple[int, ...]) -> None:
    missing = sorted(set(layers) - set(states))
    if missing:
        raise BatchError(f"state has no {kind.upper()} state for layers {missing} (state.{kind})")


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str = "") -> None:
    if tuple(tensor.shape) != expected:
        raise BatchError(
            f"{name} has shape {tuple(tensor.shape)} but the batch needs {expected}{why}"
        )


def _mix_norm(
    bank: torch.Tensor,
    site: AttnResMix,
    mix_eps: float,
    norm: RMSNorm,
    delta: torch.Tensor | None,
    accumulate: bool = True,
) -> torch.Tensor:
    """One fused AttnRes site (`dispatch.attn_res_mix_norm`): `site` mixes `bank` (after adding
    `delta` to its partial entry), then `norm` normalises the mix for the module that reads it."""
    return dispatch.attn_res_mix_norm(
        bank,
        site.proj.weight,
        site.norm.weight,
        mix_eps,
        norm.weight,
        norm.eps,
        delta=delta,
        accumulate=accumulate,
    )


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
        capture: AuxCapture | None = None,
    ) -> tuple[torch.Tensor, DecoderState | PagedState]:
        """input_ids: [T] -> (final hidden states [T, D] after the output norm, new state).

        A `PagedState` is updated in place and returned as the new state. `before_layer(i)` runs
        before layer i reads its state (the runtime waits there for that layer's prefix copies).
        `capture` (None: off) is filled with the hidden states at its points.
        """
        hidden = self.embed_tokens(input_ids)
        if self.config.uses_attn_res and dispatch.half_kernels(hidden):
            return self._forward_fused_attn_res(hidden, batch, state, before_layer, capture)
        kda, mla = {}, {}
        bank: list[torch.Tensor] = []
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer.index)
            if capture is not None and capture.wants(layer.index):
                # The layer's own input (a fresh tensor each layer: never updated in place).
                mixed = self.config.uses_attn_res and bank
                capture.take(
                    layer.index, layer.self_attention_res([*bank, hidden]) if mixed else hidden
                )
            states = state.kda if layer.kind == "kda" else state.mla
            layer_state = states[layer.index]
            if self.config.uses_attn_res:
                hidden, new = layer.forward_attn_res(hidden, bank, batch, layer_state)
            else:
                hidden, new = layer(hidden, batch, layer_state)
            (kda if layer.kind == "kda" else mla)[layer.index] = new
        if self.config.uses_attn_res:
            hidden = self.output_attn_res([*bank, hidden])
        if capture is not None:
            capture.take(len(self.layers), hidden)
        if isinstance(state, PagedState):
            return self.norm(hidden), state
        new_state = DecoderState(kda=kda, mla=mla, num_tokens=list(batch.total_lens))
        return self.norm(hidden), new_state

    def _forward_fused_attn_res(self, hidden, batch, state, before_layer, capture=None):
        """The attention-residual stream with each mix, its following RMSNorm and the residual
        add fused in one kernel (ops.attn_res.fused) over a preallocated bank: slots 0..n-1
        hold completed block sums (slot 0 the embedding), slot n the running partial sum.
        A capture point takes the reference mix of the bank as that site reads it (the fused
        kernel never writes the pre-norm mix out)."""
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
            x = _mix_norm(
                bank[: n + 1], layer.self_attention_res, eps, layer.input_layernorm, pending
            )
            if capture is not None and capture.wants(layer.index):
                capture.take(layer.index, layer.self_attention_res(list(bank[: n + 1])))
            # A layer at a block boundary closes the running sum into a completed entry (at layer
            # 0: the embedding) and starts a new partial with its attention output.
            opened = layer.index % block == 0
            n += opened
            states = state.kda if layer.kind == "kda" else state.mla
            out, new = layer.self_attn(x, batch, states[layer.index])
            (kda if layer.kind == "kda" else mla)[layer.index] = new
            x = _mix_norm(
                bank[: n + 1],
                layer.mlp_res,
                eps,
                layer.post_attention_layernorm,
                out,
                accumulate=not opened,
            )
            pending = layer.mlp(x)
        hidden = _mix_norm(bank[: n + 1], self.output_attn_res, eps, self.norm, pending)
        if capture is not None and capture.wants(len(self.layers)):
            capture.take(len(self.layers), self.output_attn_res(list(bank[: n + 1])))
        if isinstance(state, PagedState):
            return hidden, state
        return hidden, DecoderState(kda=kda, mla=mla, num_tokens=list(batch.total_lens))


class KimiForCausalLM(nn.Module):
    """The decoder plus the LM head.

    forward(input_ids [T], batch, state, logits_indices=None) -> ForwardOutput. Pass
    `logits_indices` (e.g. `batch.last_token_indices`) to compute logits for some tokens only,
    and `aux_hidden_layers` (capture points, `AuxCapture`) to get the hidden states an EAGLE3
    drafter reads as `ForwardOutput.aux_hidden`.
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
            self._check_paged_state(batch, state)
        else:
            self._check_decoder_state(batch, state)

    def _check_decoder_state(self, batch: ForwardBatch, state: DecoderState) -> None:
        """Every tensor of the state must be sized for the batch's requests and their prefixes:
        a KDA state of the wrong batch size fails deep in a kernel, and MLA rows fewer or more
        than a request's prefix silently attend at the wrong positions."""
        size = batch.batch_size
        if state.batch_size != size:
            raise BatchError(f"state holds {state.batch_size} requests but the batch has {size}")
        prefix = _prefix_lens(batch)
        if tuple(state.num_tokens) != prefix:
            raise BatchError(
                f"state has seen {state.num_tokens} tokens per request but the batch says "
                f"prefix_lens={list(prefix)}"
            )
        config = self.config
        _check_layers("kda", state.kda, config.kda_layers)
        _check_layers("mla", state.mla, config.mla_layers)
        kda = config.kda
        conv = (size, kda.conv_channels, kda.conv_kernel - 1)
        recurrent = (size, kda.num_heads, kda.head_dim, kda.head_dim)
        for layer in config.kda_layers:
            _check_shape(f"state.kda[{layer}].conv", state.kda[layer].conv, conv)
            _check_shape(f"state.kda[{layer}].recurrent", state.kda[layer].recurrent, recurrent)
        width = config.mla.latent_width
        for layer in config.mla_layers:
            rows = state.mla[layer]
            if len(rows) != size:
                raise BatchError(
                    f"state.mla[{layer}] holds rows of {len(rows)} requests but the batch has "
                    f"{size}"
                )
            for i, (latents, seen) in enumerate(zip(rows, prefix, strict=True)):
                why = f" (one row per token of request {i}'s prefix of {seen})"
                _check_shape(f"state.mla[{layer}][{i}]", latents, (seen, width), why)

    def _check_paged_state(self, batch: ForwardBatch, state: PagedState) -> None:
        """The pools' contents belong to the cache that built them; only what the batch's layout
        fixes is checked here, from shapes alone: a slot per request for every KDA layer,
        and per request a page-table row long enough for all its tokens after the step."""
        size = batch.batch_size
        _check_layers("kda", state.kda, self.config.kda_layers)
        _check_layers("mla", state.mla, self.config.mla_layers)
        for layer, kda in state.kda.items():
            _check_shape(f"state.kda[{layer}].slots", kda.slots, (size,))
        if not state.mla:
            return
        longest = max(batch.total_lens, default=0)
        for layer, mla in state.mla.items():
            table = mla.page_table
            if table.dim() != 2 or table.shape[0] != size:
                raise BatchError(
                    f"state.mla[{layer}].page_table has shape {tuple(table.shape)} but the batch "
                    f"needs one row per request: ({size}, pages)"
                )
            capacity = table.shape[1] * mla.pages.shape[1]
            if capacity < longest:
                raise BatchError(
                    f"state.mla[{layer}].page_table holds {table.shape[1]} pages of "
                    f"{mla.pages.shape[1]} tokens ({capacity} tokens) but a request reaches "
                    f"{longest} tokens after the step"
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
        aux_hidden_layers: Sequence[int] | None = None,
    ) -> ForwardOutput:
        """check=False skips the input checks (they read values back from the device, which a
        CUDA graph capture cannot do; the runner validates before filling its buffers).
        aux_hidden_layers: capture points (`AuxCapture`; EAGLE3's default is
        `eagle3.default_aux_layers(num_layers)`), returned as `aux_hidden` [T, n * D]."""
        if check:
            self.check_inputs(input_ids, batch, state)
        if aux_hidden_layers is None:
            hidden, new_state = self.model(input_ids, batch, state, before_layer)
            if logits_indices is not None:
                hidden = hidden[logits_indices]
            return ForwardOutput(logits=self.lm_head(hidden), state=new_state)
        capture = AuxCapture(aux_hidden_layers, self.config.num_layers)
        hidden, new_state = self.model(input_ids, batch, state, before_layer, capture)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return ForwardOutput(
            logits=self.lm_head(hidden), state=new_state, aux_hidden=capture.stacked()
        )

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
