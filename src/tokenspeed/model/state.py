"""Explicit per-request decoder state, passed into a forward step and handed back by it.

The model owns no cache: a caller (a test, the runtime's cache) keeps these and decides where
they live. KDA layers carry a conv window and a recurrent state per request; MLA layers carry
the latent rows of every token seen so far.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import torch

from .config import ModelConfig


@attrs.define(eq=False)
class KdaState:
    """One KDA layer's state for a batch of B requests.

    conv: [B, 3*H*K, W-1] the last W-1 q/k/v inputs (model dtype);
    recurrent: [B, H, K, V] fp32.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    def select(self, index: int) -> KdaState:
        """Request `index` alone (views); an index outside the batch is an IndexError, not the
        empty state that slicing `index : index + 1` would give."""
        return KdaState(self.conv[index].unsqueeze(0), self.recurrent[index].unsqueeze(0))


@attrs.define(eq=False)
class DecoderState:
    """The state of B requests: per KDA layer a `KdaState`, per MLA layer a list of B latent
    tensors [L_i, kv_lora_rank + qk_rope_head_dim], and the tokens seen by each request."""

    kda: dict[int, KdaState]
    mla: dict[int, list[torch.Tensor]]
    num_tokens: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.num_tokens)

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> DecoderState:
        """Fresh state for requests that have seen no tokens."""
        try:
            count = None if isinstance(batch_size, bool) else operator.index(batch_size)
        except TypeError:
            count = None
        if count is None or count < 0:
            raise ValueError(f"batch_size must be a non-negative integer, got {batch_size!r}")
        batch_size = count
        kda_cfg, mla_cfg = config.kda, config.mla
        kda = {
            layer: KdaState(
                conv=torch.zeros(
                    batch_size,
                    kda_cfg.conv_channels,
                    kda_cfg.conv_kernel - 1,
                    dtype=dtype,
                    device=device,
                ),
                recurrent=torch.zeros(
                    batch_size,
                    kda_cfg.num_heads,
                    kda_cfg.head_dim,
                    kda_cfg.head_dim,
                    dtype=torch.float32,
                    device=device,
                ),
            )
            for layer in config.kda_layers
        }
        mla = {
            layer: [
                torch.zeros(0, mla_cfg.latent_width, dtype=dtype, device=device)
                for _ in range(batch_size)
            ]
            for layer in config.mla_layers
        }
        return cls(kda=kda, mla=mla, num_tokens=[0] * batch_size)

    @classmethod
    def concat(cls, states: Sequence[DecoderState]) -> DecoderState:
        """One batch state from several (in order)."""
        if not states:
            raise ValueError("concat needs at least one state")
        first = states[0]
        kda = {
            layer: KdaState(
                conv=torch.cat([s.kda[layer].conv for s in states]),
                recurrent=torch.cat([s.kda[layer].recurrent for s in states]),
            )
            for layer in first.kda
        }
        mla = {layer: [row for s in states for row in s.mla[layer]] for layer in first.mla}
        return cls(kda=kda, mla=mla, num_tokens=[n for s in states for n in s.num_tokens])

    def split(self) -> list[DecoderState]:
        """One single-request state per request."""
        return [
            DecoderState(
                kda={layer: s.select(i) for layer, s in self.kda.items()},
                mla={layer: [rows[i]] for layer, rows in self.mla.items()},
                num_tokens=[self.num_tokens[i]],
            )
            for i in range(self.batch_size)
        ]

    def clone(self) -> DecoderState:
        return DecoderState(
            kda={
                layer: KdaState(s.conv.clone(), s.recurrent.clone())
                for layer, s in self.kda.items()
            },
            mla={layer: [r.clone() for r in rows] for layer, rows in self.mla.items()},
            num_tokens=list(self.num_tokens),
        )


@attrs.define(eq=False)
class PagedKda:
    """One KDA layer's state in shared slot pools, read and written in place.

    conv: [S, 3*H*K, W-1]; recurrent: [S, H, K, V] fp32; slots: [B] the slot of each request
    (padding rows may all point at one sink slot).

    step_conv [B, T, 3*H*K, W-1] and step_states [B, T, H, K, V] fp32 (both or neither; T at
    least each row's new tokens, at most `RECURRENT_MAX_TOKENS`): a speculative verify step
    also records each row's state after each of its new tokens there, so that the caller can
    roll the slots back to any of them (`ops.kda.decode.kda_decode_rollback`). None (the
    default): the forward is exactly the one without them.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    slots: torch.Tensor
    step_conv: torch.Tensor | None = None
    step_states: torch.Tensor | None = None


# The attribute of an FP8 page pool holding its row scales (set by the runtime's cache,
# `tokenspeed.cache.storage.ROW_SCALES_ATTR`: the model does not import the cache).
ROW_SCALES_ATTR = "tokenspeed_row_scales"


def _row_scales_of(self: PagedMla) -> torch.Tensor | None:
    return getattr(self.pages, ROW_SCALES_ATTR, None)


@attrs.define(eq=False)
class PagedMla:
    """One MLA layer's latent rows in a shared page pool, written in place.

    pages: [NP, P, R + Dr]; page_table: [B, MP] the pages of each request in order (padding rows
    and unused entries may point at a sink page). Token t of request i lives at row t % P of
    page page_table[i, t // P].
    scales: [NP, P] fp32 for float8_e4m3fn pages (an FP8 cache): row = e4m3 row * its scale;
    None for other pages. Default: the pool's `ROW_SCALES_ATTR` attribute when it has one.
    """

    pages: torch.Tensor
    page_table: torch.Tensor
    scales: torch.Tensor | None = attrs.field(
        default=attrs.Factory(_row_scales_of, takes_self=True)
    )

    def __attrs_post_init__(self) -> None:
        fp8 = self.pages.dtype == torch.float8_e4m3fn
        if fp8 != (self.scales is not None):
            raise ValueError(
                "float8_e4m3fn pages need their [NP, P] fp32 row scales (PagedMla.scales); "
                "other pages take none"
            )
        if fp8 and (
            self.scales.dtype != torch.float32
            or tuple(self.scales.shape) != tuple(self.pages.shape[:2])
        ):
            raise ValueError(
                f"PagedMla.scales must be fp32 {tuple(self.pages.shape[:2])} (one per row), got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )

    def rows(self) -> torch.Tensor:
        """The pool's rows as the attention reads them: the pages, dequantised (fp32) when
        FP8."""
        if self.scales is None:
            return self.pages
        return self.pages.float() * self.scales[..., None]


@attrs.define(eq=False)
class PagedState:
    """The state of B requests held in a cache's pools (the runtime's device tier) rather than
    in per-request tensors. A forward over it updates the pools in place and returns it."""

    kda: dict[int, PagedKda]
    mla: dict[int, PagedMla]
