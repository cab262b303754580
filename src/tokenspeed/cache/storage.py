"""The device tier's tensors, and the byte layout of the host objects that mirror them.

Device tensors (absent in metadata-only mode):

    mla              [num_mla_layers, num_pages, R, W]            mla_dtype       (page 0: sink)
    conv             [num_kda_layers, num_live_slots, C, Kc]      kda_conv_dtype  (slot 0: sink)
    recurrent        [num_kda_layers, num_live_slots, H, K, V]    kda_recurrent_dtype
    ckpt_conv        [num_kda_layers, num_checkpoint_slots, C, Kc]
    ckpt_recurrent   [num_kda_layers, num_checkpoint_slots, H, K, V]

(R = mla_rows_per_page: the page size P, or P / C on a rank of a DCP group of C; W =
mla_row_width, C x Kc = kda_conv_shape, H x K x V = kda_recurrent_shape.) The layer axis comes
first so that `mla[l]` is the contiguous `[num_pages, R, W]` pool one attention kernel reads.

Host objects (L2 payloads) are flat uint8 CPU tensors:

    page         the page's rows of every MLA layer, as [num_mla_layers, R, W] mla_dtype
    checkpoint   per KDA layer, the conv bytes then the recurrent bytes: [num_kda_layers, S]
                 with S = geometry.kda_layer_state_bytes

Copies are bit-exact (raw bytes), so a restored state equals the checkpointed one exactly.
"""

from __future__ import annotations

import functools

import torch

from .config import CacheGeometry, PoolSizes
from .copy_engine import CopyStep


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

        def kda(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
            conv = torch.zeros(
                g.num_kda_layers, slots, *g.kda_conv_shape, dtype=g.kda_conv_dtype, device=device
            )
            rec = torch.zeros(
                g.num_kda_layers,
                slots,
                *g.kda_recurrent_shape,
                dtype=g.kda_recurrent_dtype,
                device=device,
            )
            return conv, rec

        self.conv, self.recurrent = kda(sizes.num_live_slots)
        self.ckpt_conv, self.ckpt_recurrent = kda(sizes.num_checkpoint_slots)

    # ----------------------------------------------------------------- views for the runtime
    def mla_layer(self, layer: int) -> torch.Tensor:
        """[num_pages, R, W] page pool of one MLA layer."""
        return self.mla[layer]

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
        rows = self.mla.index_select(1, idx).permute(1, 0, 2, 3).contiguous()  # [n, Lm, R, W]
        host = rows.cpu().view(len(pids), -1)
        return list(host.view(torch.uint8).view(len(pids), g.mla_page_bytes).unbind(0))

    def read_checkpoint(self, ckpt_slot: int) -> torch.Tensor:
        """Host payload ([kda_state_bytes] uint8) of one checkpoint slot."""
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
        typed = torch.stack(payloads).view(g.mla_dtype)
        staging = typed.view(n, g.num_mla_layers, g.mla_rows_per_page, g.mla_row_width)
        staging = staging.permute(1, 0, 2, 3).contiguous()  # [Lm, n, R, W]
        if self._pin:
            staging = staging.pin_memory()
        idx = torch.tensor(pids, dtype=torch.long, device=self.device)
        steps = [
            functools.partial(self._copy_page_layer, layer, idx, staging[layer])
            for layer in range(g.num_mla_layers)
        ]
        return steps, [staging, idx]

    def _copy_page_layer(self, layer: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        self.mla[layer].index_copy_(0, idx, src.to(self.device, non_blocking=True))

    def state_load_steps(
        self, payload: torch.Tensor, live_slot: int, ckpt_slot: int | None
    ) -> tuple[list[CopyStep], list[torch.Tensor]]:
        """One step per KDA layer writing a checkpoint payload into a live slot (and into a
        checkpoint slot too, when the loaded state is also kept in the device tier)."""
        g = self.geometry
        rows = payload.view(g.num_kda_layers, g.kda_layer_state_bytes)
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
        split = self.geometry.kda_conv_bytes
        conv_src, rec_src = src[:split], src[split:]
        _as_bytes(self.conv[layer, live_slot]).copy_(conv_src, non_blocking=True)
        _as_bytes(self.recurrent[layer, live_slot]).copy_(rec_src, non_blocking=True)
        if ckpt_slot is not None:
            _as_bytes(self.ckpt_conv[layer, ckpt_slot]).copy_(conv_src, non_blocking=True)
            _as_bytes(self.ckpt_recurrent[layer, ckpt_slot]).copy_(rec_src, non_blocking=True)
