"""The device tier's tensors, and the byte layout of the host objects that mirror them.

Device tensors (absent in metadata-only mode):

    mla              [num_mla_layers, num_pages, R, W]            mla_dtype       (page 0: sink)
    mla_scales       [num_mla_layers, num_pages, R]               fp32 (FP8 caches only, else None)
    conv             [num_kda_layers, num_live_slots, C, Kc]      kda_conv_dtype  (slot 0: sink)
    recurrent        [num_kda_layers, num_live_slots, H, K, V]    kda_recurrent_dtype
    ckpt_conv        [num_kda_layers, num_checkpoint_slots, C, Kc]       kda_checkpoint_conv_dtype
    ckpt_recurrent   [num_kda_layers, num_checkpoint_slots, H, K, V] kda_checkpoint_recurrent_dtype

(R = mla_rows_per_page: the page size P, or P / C on a rank of a DCP group of C; W =
mla_row_width, C x Kc = kda_conv_shape, H x K x V = kda_recurrent_shape.) The layer axis comes
first so that `mla[l]` is the contiguous `[num_pages, R, W]` pool one attention kernel reads.

Host objects (L2 payloads) are flat uint8 CPU tensors:

    page         the page's rows of every MLA layer, as [num_mla_layers, R, W] mla_dtype;
                 an FP8 cache appends the rows' scales, [num_mla_layers, R] fp32
    checkpoint   per KDA layer, the conv bytes then the recurrent bytes: [num_kda_layers, S]
                 with S = geometry.kda_checkpoint_layer_bytes (the checkpoint dtypes)

Copies are bit-exact (raw bytes), so a restored state equals the checkpointed one exactly; with
narrowed (bf16) checkpoints, saving rounds the live state to the checkpoint dtype and restoring
converts it back up, exactly the same way from a checkpoint slot or from L2.
"""

from __future__ import annotations

import functools

import torch

from .config import MLA_SCALE_DTYPE, CacheGeometry, PoolSizes
from .copy_engine import CopyStep

# The attribute of an FP8 page pool [NP, R, W] holding its fp32 row scales [NP, R]; the same
# name as `tokenspeed.model.state.ROW_SCALES_ATTR` (neither package imports the other).
ROW_SCALES_ATTR = "tokenspeed_row_scales"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor."""
    return t.view(torch.uint8).view(-1)


class DeviceStorage:
    def __init__(self, geometry: CacheGeometry, sizes: PoolSizes, device: torch.device) -> None:
        g = geometry
        self.geometry = geometry
        self.device = device
        self._pin = device.type == "cuda"
        self.mla = torch.zeros(
            g.num_mla_layers,
            sizes.num_pages,
            g.mla_rows_per_page,
            g.mla_row_width,
            dtype=g.mla_dtype,
            device=device,
        )
        # Page copies of FP8 rows go through bytes: index kernels need not support float8.
        self._mla_raw = self.mla.view(torch.uint8) if g.mla_fp8 else self.mla
        self.mla_scales: torch.Tensor | None = None
        self._fp8_layers: list[torch.Tensor] | None = None
        if g.mla_fp8:
            self.mla_scales = torch.zeros(
                g.num_mla_layers,
                sizes.num_pages,
                g.mla_rows_per_page,
                dtype=MLA_SCALE_DTYPE,
                device=device,
            )

        def kda(slots: int, conv_dtype, rec_dtype) -> tuple[torch.Tensor, torch.Tensor]:
            conv = torch.zeros(
                g.num_kda_layers, slots, *g.kda_conv_shape, dtype=conv_dtype, device=device
            )
            rec = torch.zeros(
                g.num_kda_layers, slots, *g.kda_recurrent_shape, dtype=rec_dtype, device=device
            )
            return conv, rec

        self.conv, self.recurrent = kda(
            sizes.num_live_slots, g.kda_conv_dtype, g.kda_recurrent_dtype
        )
        self.ckpt_conv, self.ckpt_recurrent = kda(
            sizes.num_checkpoint_slots,
            g.kda_checkpoint_conv_dtype,
            g.kda_checkpoint_recurrent_dtype,
        )

    # ----------------------------------------------------------------- views for the runtime
    def mla_layer(self, layer: int) -> torch.Tensor:
        """[num_pages, R, W] page pool of one MLA layer. An FP8 pool carries its [num_pages, R]
        row scales as the attribute `ROW_SCALES_ATTR` (where `tokenspeed.model.PagedMla` finds
        them), so every holder of the pool reads the scales with it."""
        if self.mla_scales is None:
            return self.mla[layer]
        if self._fp8_layers is None:
            views = []
            for i in range(self.geometry.num_mla_layers):
                view = self.mla[i]
                setattr(view, ROW_SCALES_ATTR, self.mla_scales[i])
                views.append(view)
            self._fp8_layers = views
        return self._fp8_layers[layer]

    def mla_scale_layer(self, layer: int) -> torch.Tensor | None:
        """[num_pages, R] fp32 row scales of one MLA layer (FP8 caches; else None)."""
        return None if self.mla_scales is None else self.mla_scales[layer]

    def kda_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [num_live_slots, C, Kc], recurrent [num_live_slots, H, K, V]) of one KDA layer."""
        return self.conv[layer], self.recurrent[layer]

    # ------------------------------------------------------------------ state within the tier
    def zero_live(self, slot: int) -> None:
        """A request without a reusable prefix starts from zero state."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def save_checkpoint(self, live_slot: int, ckpt_slot: int) -> None:
        self.ckpt_conv[:, ckpt_slot].copy_(self.conv[:, live_slot])
        self.ckpt_recurrent[:, ckpt_slot].copy_(self.recurrent[:, live_slot])

    def restore_checkpoint(self, ckpt_slot: int, live_slot: int) -> None:
        self.conv[:, live_slot].copy_(self.ckpt_conv[:, ckpt_slot])
        self.recurrent[:, live_slot].copy_(self.ckpt_recurrent[:, ckpt_slot])

    # ------------------------------------------------------------------ device -> host objects
    def read_pages(self, pids: list[int]) -> list[torch.Tensor]:
        """Host payloads ([mla_page_bytes] uint8 each) of the given pages."""
        g = self.geometry
        idx = torch.tensor(pids, dtype=torch.long, device=self.device)
        rows = self._mla_raw.index_select(1, idx).permute(1, 0, 2, 3).contiguous()  # [n,Lm,R,W]
        host = rows.cpu().view(len(pids), -1).view(torch.uint8)
        if self.mla_scales is not None:
            scales = self.mla_scales.index_select(1, idx).permute(1, 0, 2).contiguous()
            scale_bytes = scales.cpu().view(len(pids), -1).view(torch.uint8)
            host = torch.cat([host, scale_bytes], dim=1)
        return list(host.view(len(pids), g.mla_page_bytes).unbind(0))

    def read_checkpoint(self, ckpt_slot: int) -> torch.Tensor:
        """Host payload ([kda_checkpoint_bytes] uint8) of one checkpoint slot."""
        n = self.geometry.num_kda_layers
        conv = self.ckpt_conv[:, ckpt_slot].contiguous().view(n, -1).view(torch.uint8)
        rec = self.ckpt_recurrent[:, ckpt_slot].contiguous().view(n, -1).view(torch.uint8)
        return torch.cat([conv, rec], dim=1).reshape(-1).cpu()

    # ------------------------------------------------------------------ host objects -> device
    def page_load_steps(
        self, pids: list[int], payloads: list[torch.Tensor]
    ) -> tuple[list[CopyStep], list[torch.Tensor]]:
        """One step per MLA layer writing the payloads into pages `pids`; plus the host buffers
        the steps read, which must stay alive until the steps have run."""
        g = self.geometry
        n = len(pids)
        raw = torch.stack(payloads)
        shape = (n, g.num_mla_layers, g.mla_rows_per_page)
        rows_bytes = g.num_mla_layers * g.mla_rows_per_page * g.mla_row_width
        rows_bytes *= g.mla_dtype.itemsize
        typed = raw[:, :rows_bytes].contiguous().view(self._mla_raw.dtype)
        staging = typed.view(*shape, g.mla_row_width)
        staging = staging.permute(1, 0, 2, 3).contiguous()  # [Lm, n, R, W]
        scales = None
        if self.mla_scales is not None:
            scales = raw[:, rows_bytes:].contiguous().view(MLA_SCALE_DTYPE).view(shape)
            scales = scales.permute(1, 0, 2).contiguous()  # [Lm, n, R]
        if self._pin:
            staging = staging.pin_memory()
            scales = None if scales is None else scales.pin_memory()
        idx = torch.tensor(pids, dtype=torch.long, device=self.device)
        if scales is None:
            steps = [
                functools.partial(self._copy_page_layer, layer, idx, staging[layer])
                for layer in range(g.num_mla_layers)
            ]
        else:
            steps = [
                functools.partial(
                    self._copy_fp8_page_layer, layer, idx, staging[layer], scales[layer]
                )
                for layer in range(g.num_mla_layers)
            ]
        return steps, [t for t in (staging, scales, idx) if t is not None]

    def _copy_page_layer(self, layer: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        self._mla_raw[layer].index_copy_(0, idx, src.to(self.device, non_blocking=True))

    def _copy_fp8_page_layer(
        self, layer: int, idx: torch.Tensor, src: torch.Tensor, scales: torch.Tensor
    ) -> None:
        self._copy_page_layer(layer, idx, src)
        self.mla_scales[layer].index_copy_(0, idx, scales.to(self.device, non_blocking=True))

    def state_load_steps(
        self, payload: torch.Tensor, live_slot: int, ckpt_slot: int | None
    ) -> tuple[list[CopyStep], list[torch.Tensor]]:
        """One step per KDA layer writing a checkpoint payload into a live slot (and into a
        checkpoint slot too, when the loaded state is also kept in the device tier)."""
        g = self.geometry
        rows = payload.view(g.num_kda_layers, g.kda_checkpoint_layer_bytes)
        if self._pin:
            rows = rows.pin_memory()
        steps = [
            functools.partial(self._copy_state_layer, layer, rows[layer], live_slot, ckpt_slot)
            for layer in range(g.num_kda_layers)
        ]
        return steps, [rows]

    def _copy_state_layer(
        self, layer: int, src: torch.Tensor, live_slot: int, ckpt_slot: int | None
    ) -> None:
        g = self.geometry
        split = g.kda_checkpoint_conv_bytes
        conv_src, rec_src = src[:split], src[split:]
        if g.checkpoint_narrowed:
            # A narrowed checkpoint: its bytes to the device as they are, then converted up.
            conv_dev = conv_src.to(self.device, non_blocking=True)
            rec_dev = rec_src.to(self.device, non_blocking=True)
            conv_typed = conv_dev.view(g.kda_checkpoint_conv_dtype)
            rec_typed = rec_dev.view(g.kda_checkpoint_recurrent_dtype)
            self.conv[layer, live_slot].copy_(conv_typed.view(g.kda_conv_shape))
            self.recurrent[layer, live_slot].copy_(rec_typed.view(g.kda_recurrent_shape))
            conv_src, rec_src = conv_dev, rec_dev
        else:
            _as_bytes(self.conv[layer, live_slot]).copy_(conv_src, non_blocking=True)
            _as_bytes(self.recurrent[layer, live_slot]).copy_(rec_src, non_blocking=True)
        if ckpt_slot is not None:
            _as_bytes(self.ckpt_conv[layer, ckpt_slot]).copy_(conv_src, non_blocking=True)
            _as_bytes(self.ckpt_recurrent[layer, ckpt_slot]).copy_(rec_src, non_blocking=True)
