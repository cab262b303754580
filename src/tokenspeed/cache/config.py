"""Geometry (what one page and one KDA state look like) and configuration (how much to keep).

The cache never knows which model it serves: the runtime builds a `CacheGeometry` from the model
config (for an MLA layer a row is `kv_lora_rank + qk_rope_head_dim` elements per token; a KDA
layer's state is a conv window `[3*H*K, conv_kernel-1]` plus a recurrent state `[H, K, V]` in fp32),
and a `CacheConfig` says how many bytes the device tier may use. Pool sizes derive from both.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import attrs
import torch

from .checkpoints import CheckpointKind
from .errors import BudgetTooSmallError, CacheConfigError

LayerKind = Literal["kda", "mla"]


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CacheConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CacheConfigError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise CacheConfigError(f"{attribute.name} must be a torch.dtype, got {value!r}")


def _positive_shape(length: int):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if (
            not isinstance(value, tuple)
            or len(value) != length
            or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value)
        ):
            raise CacheConfigError(
                f"{attribute.name} must be a tuple of {length} positive integers, got {value!r}"
            )

    return check


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


# MLA rows may be kept in the model's floating dtype or as e4m3 with one fp32 scale per row.
FP8_MLA_DTYPE = torch.float8_e4m3fn
MLA_SCALE_DTYPE = torch.float32
# KDA checkpoints may be kept narrower than the live state (bf16: half the bytes of fp32).
CHECKPOINT_DTYPES = (torch.float32, torch.bfloat16)


def _mla_dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    _dtype(instance, attribute, value)
    if not value.is_floating_point:
        raise CacheConfigError(f"mla_dtype must be a floating dtype, got {value!r}")
    if value.itemsize == 1 and value != FP8_MLA_DTYPE:
        raise CacheConfigError(
            f"mla_dtype {value} is not supported: the only 8-bit MLA cache is {FP8_MLA_DTYPE} "
            "(e4m3 rows with a per-row fp32 scale)"
        )


def _checkpoint_dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and value not in CHECKPOINT_DTYPES:
        raise CacheConfigError(
            f"kda_checkpoint_dtype must be None (as the live state) or one of "
            f"{[str(d) for d in CHECKPOINT_DTYPES]}, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class CacheGeometry:
    """Shape of the cached state of one model, per page and per request.

    page_size: tokens per page (P): the unit of every page id, key, checkpoint and L2 object.
    num_mla_layers / mla_row_width / mla_dtype: an MLA layer caches one row of `mla_row_width`
        elements per token; a page holds `[num_mla_layers, R, mla_row_width]` of them. With
        mla_dtype float8_e4m3fn (an FP8 cache) each row also has one fp32 scale (row ~= e4m3 *
        scale, the per-row scheme of the e4m3 MLA decode kernel), kept beside the page pool as
        `[num_mla_layers, num_pages, R]` and after the rows in a page's L2 object.
    mla_rows_per_page: the MLA rows R a page holds on this device (default P). Below P when C =
        P / R ranks split every request's MLA rows (decode context parallelism: position p on
        member p % C as its local row p // C, so a page of P tokens is R = P / C local rows of
        each member, and the page table of the P-token pages is the members' local one). The
        cache's bookkeeping stays in tokens and pages of P; only the bytes of a page shrink.
    num_kda_layers: KDA layers; each keeps, per request, a conv window `kda_conv_shape`
        (`(3*H*K, conv_kernel-1)`, `kda_conv_dtype`) and a recurrent state `kda_recurrent_shape`
        (`(H, K, V)`, `kda_recurrent_dtype`, fp32 by default).
    kda_checkpoint_dtype: None (the default): checkpoints hold the live state's bytes; bf16:
        checkpoint slots and L2 checkpoint objects hold each KDA tensor wider than bf16 in bf16
        (the live recurrent state stays fp32; a restore converts up).
    layer_kinds: optional model order of the layers ("kda" / "mla"), used to order layer-by-layer
        loads like the forward consumes them; by default the two kinds are interleaved evenly.
    """

    page_size: int = attrs.field(default=64, validator=_positive_int)
    num_mla_layers: int = attrs.field(validator=_positive_int)
    mla_row_width: int = attrs.field(validator=_positive_int)
    mla_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_mla_dtype)
    mla_rows_per_page: int = attrs.field(
        default=attrs.Factory(lambda self: self.page_size, takes_self=True),
        validator=_positive_int,
    )
    num_kda_layers: int = attrs.field(validator=_positive_int)
    kda_conv_shape: tuple[int, int] = attrs.field(converter=tuple, validator=_positive_shape(2))
    kda_recurrent_shape: tuple[int, int, int] = attrs.field(
        converter=tuple, validator=_positive_shape(3)
    )
    kda_conv_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_dtype)
    kda_recurrent_dtype: torch.dtype = attrs.field(default=torch.float32, validator=_dtype)
    kda_checkpoint_dtype: torch.dtype | None = attrs.field(
        default=None, validator=_checkpoint_dtype
    )
    layer_kinds: tuple[LayerKind, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )

    @layer_kinds.validator
    def _check_layer_kinds(self, attribute: attrs.Attribute, value: tuple | None) -> None:
        if value is None:
            return
        if any(kind not in ("kda", "mla") for kind in value):
            raise CacheConfigError(f"layer_kinds may only hold 'kda' and 'mla', got {value!r}")
        if value.count("mla") != self.num_mla_layers or value.count("kda") != self.num_kda_layers:
            raise CacheConfigError(
                f"layer_kinds has {value.count('mla')} mla and {value.count('kda')} kda entries, "
                f"but num_mla_layers={self.num_mla_layers} and num_kda_layers={self.num_kda_layers}"
            )

    @mla_rows_per_page.validator
    def _check_mla_rows(self, attribute: attrs.Attribute, value: int) -> None:
        if value > self.page_size or self.page_size % value:
            raise CacheConfigError(
                f"mla_rows_per_page={value} must divide page_size={self.page_size} (a page's "
                "tokens split evenly over the ranks sharing its MLA rows)"
            )

    @classmethod
    def from_model_dims(
        cls,
        *,
        num_mla_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        num_kda_layers: int,
        kda_num_heads: int,
        kda_head_dim: int,
        kda_conv_kernel: int,
        page_size: int = 64,
        mla_dtype: torch.dtype = torch.bfloat16,
        kda_conv_dtype: torch.dtype = torch.bfloat16,
        layer_kinds: tuple[LayerKind, ...] | None = None,
        mla_share: int = 1,
        kda_checkpoint_dtype: torch.dtype | None = None,
    ) -> CacheGeometry:
        """The geometry of a KDA/MLA hybrid from its attention dimensions (K = V = head_dim).
        mla_share: ranks splitting every request's MLA rows (DCP; must divide page_size)."""
        if not isinstance(mla_share, int) or isinstance(mla_share, bool) or mla_share < 1:
            raise CacheConfigError(f"mla_share must be a positive integer, got {mla_share!r}")
        if page_size % mla_share:
            raise CacheConfigError(
                f"page_size={page_size} is not a multiple of mla_share={mla_share}: each of the "
                "ranks sharing a page's MLA rows keeps page_size / mla_share of them"
            )
        return cls(
            page_size=page_size,
            num_mla_layers=num_mla_layers,
            mla_row_width=kv_lora_rank + qk_rope_head_dim,
            mla_dtype=mla_dtype,
            mla_rows_per_page=page_size // mla_share,
            num_kda_layers=num_kda_layers,
            kda_conv_shape=(3 * kda_num_heads * kda_head_dim, kda_conv_kernel - 1),
            kda_recurrent_shape=(kda_num_heads, kda_head_dim, kda_head_dim),
            kda_conv_dtype=kda_conv_dtype,
            kda_checkpoint_dtype=kda_checkpoint_dtype,
            layer_kinds=layer_kinds,
        )

    @classmethod
    def from_model_config(
        cls,
        config,
        *,
        page_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        mla_share: int = 1,
        mla_dtype: torch.dtype | None = None,
        kda_checkpoint_dtype: torch.dtype | None = None,
    ) -> CacheGeometry:
        """The geometry of a model described by a `tokenspeed.model.ModelConfig` (read by its
        attributes: the cache does not import the model), with MLA rows and conv windows in
        `dtype` and the layers in the model's order; mla_share as for `from_model_dims`.
        mla_dtype: the MLA rows' dtype when not `dtype` (float8_e4m3fn: an FP8 cache);
        kda_checkpoint_dtype: as the field (None: checkpoints as the live state)."""
        return cls.from_model_dims(
            num_mla_layers=len(config.mla_layers),
            kv_lora_rank=config.mla.kv_lora_rank,
            qk_rope_head_dim=config.mla.qk_rope_head_dim,
            num_kda_layers=len(config.kda_layers),
            kda_num_heads=config.kda.num_heads,
            kda_head_dim=config.kda.head_dim,
            kda_conv_kernel=config.kda.conv_kernel,
            page_size=page_size,
            mla_dtype=dtype if mla_dtype is None else mla_dtype,
            kda_conv_dtype=dtype,
            layer_kinds=config.layer_kinds,
            mla_share=mla_share,
            kda_checkpoint_dtype=kda_checkpoint_dtype,
        )

    @property
    def mla_fp8(self) -> bool:
        """Whether MLA rows are e4m3 with a per-row fp32 scale."""
        return self.mla_dtype == FP8_MLA_DTYPE

    @property
    def mla_scale_bytes(self) -> int:
        """Bytes of one row's scale (0 unless the cache is FP8)."""
        return _element_size(MLA_SCALE_DTYPE) if self.mla_fp8 else 0

    @property
    def mla_row_bytes(self) -> int:
        """Bytes of one token's row in one MLA layer (its scale included for an FP8 cache)."""
        return self.mla_row_width * _element_size(self.mla_dtype) + self.mla_scale_bytes

    @property
    def mla_token_bytes(self) -> float:
        """MLA bytes per token on this device: every MLA layer's row (1 / mla_share of it)."""
        return self.mla_page_bytes / self.page_size

    @property
    def mla_share(self) -> int:
        """Ranks splitting every request's MLA rows (page_size / mla_rows_per_page; 1: none)."""
        return self.page_size // self.mla_rows_per_page

    @property
    def mla_page_bytes(self) -> int:
        """Bytes of one page across all MLA layers (its mla_rows_per_page rows of each)."""
        return self.num_mla_layers * self.mla_rows_per_page * self.mla_row_bytes

    @property
    def kda_conv_bytes(self) -> int:
        """Bytes of one request's conv window in one KDA layer."""
        c, w = self.kda_conv_shape
        return c * w * _element_size(self.kda_conv_dtype)

    @property
    def kda_recurrent_bytes(self) -> int:
        """Bytes of one request's recurrent state in one KDA layer."""
        h, k, v = self.kda_recurrent_shape
        return h * k * v * _element_size(self.kda_recurrent_dtype)

    @property
    def kda_layer_state_bytes(self) -> int:
        return self.kda_conv_bytes + self.kda_recurrent_bytes

    @property
    def kda_state_bytes(self) -> int:
        """Bytes of one request's complete KDA state (every layer): one live slot."""
        return self.num_kda_layers * self.kda_layer_state_bytes

    def _narrowed(self, dtype: torch.dtype) -> torch.dtype:
        c = self.kda_checkpoint_dtype
        return dtype if c is None or _element_size(c) >= _element_size(dtype) else c

    @property
    def kda_checkpoint_conv_dtype(self) -> torch.dtype:
        """The conv window's dtype in a checkpoint (the live one unless kda_checkpoint_dtype
        is narrower)."""
        return self._narrowed(self.kda_conv_dtype)

    @property
    def kda_checkpoint_recurrent_dtype(self) -> torch.dtype:
        """The recurrent state's dtype in a checkpoint (fp32, or bf16 with bf16 checkpoints)."""
        return self._narrowed(self.kda_recurrent_dtype)

    @property
    def kda_checkpoint_conv_bytes(self) -> int:
        c, w = self.kda_conv_shape
        return c * w * _element_size(self.kda_checkpoint_conv_dtype)

    @property
    def kda_checkpoint_recurrent_bytes(self) -> int:
        h, k, v = self.kda_recurrent_shape
        return h * k * v * _element_size(self.kda_checkpoint_recurrent_dtype)

    @property
    def kda_checkpoint_layer_bytes(self) -> int:
        return self.kda_checkpoint_conv_bytes + self.kda_checkpoint_recurrent_bytes

    @property
    def kda_checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint (every KDA layer): a checkpoint slot or an L2 object. Equals
        kda_state_bytes unless kda_checkpoint_dtype narrows it."""
        return self.num_kda_layers * self.kda_checkpoint_layer_bytes

    @property
    def checkpoint_narrowed(self) -> bool:
        """Whether checkpoints hold a narrower copy of the live state (a restore converts up)."""
        return (
            self.kda_checkpoint_conv_dtype != self.kda_conv_dtype
            or self.kda_checkpoint_recurrent_dtype != self.kda_recurrent_dtype
        )

    @property
    def copy_order(self) -> tuple[tuple[LayerKind, int], ...]:
        """(kind, index within kind) for every layer, in the order the forward consumes them."""
        kinds = self.layer_kinds
        if kinds is None:
            # Spread the MLA layers evenly among the KDA layers (a 3:1 hybrid gives KKKM KKKM...).
            total = self.num_kda_layers + self.num_mla_layers
            kinds = tuple(
                "mla"
                if (i + 1) * self.num_mla_layers // total > i * self.num_mla_layers // total
                else "kda"
                for i in range(total)
            )
        counters = {"kda": 0, "mla": 0}
        order = []
        for kind in kinds:
            order.append((kind, counters[kind]))
            counters[kind] += 1
        return tuple(order)

    @property
    def fingerprint(self) -> str:
        """Short stable id of the byte layout; objects of different layouts never mix in L2."""
        fields = (
            self.page_size,
            self.num_mla_layers,
            self.mla_row_width,
            str(self.mla_dtype),
            self.num_kda_layers,
            self.kda_conv_shape,
            self.kda_recurrent_shape,
            str(self.kda_conv_dtype),
            str(self.kda_recurrent_dtype),
        )
        if self.mla_rows_per_page != self.page_size:
            # Only then: whole-page layouts keep the ids the objects already stored carry.
            fields = (*fields, self.mla_rows_per_page)
        if self.mla_fp8:
            # str(mla_dtype) differs already; the scale scheme is part of the layout too.
            fields = (*fields, "mla_row_scales", str(MLA_SCALE_DTYPE))
        if self.checkpoint_narrowed:
            fields = (
                *fields,
                "kda_checkpoint",
                str(self.kda_checkpoint_conv_dtype),
                str(self.kda_checkpoint_recurrent_dtype),
            )
        text = repr(fields)
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


@attrs.frozen(kw_only=True)
class CheckpointPolicy:
    """When KDA state is snapshotted, and how many snapshots one prefix path may keep in L1.

    interval_pages: during a long prefill, a checkpoint every this many pages (N), so that a cut or
        preempted prefill, or another request sharing the first part, can resume from there.
    max_per_path: at most this many L1 checkpoints along one request's prefix; beyond it the cache
        thins interval checkpoints first (keeping them spread out), never the newest.
    Checkpoints are also taken at the end of every turn (the last page boundary of the sequence).
    """

    interval_pages: int = attrs.field(default=64, validator=_positive_int)
    max_per_path: int = attrs.field(default=16, validator=_positive_int)

    def points(
        self, start: int, end: int, *, page_size: int, turn_end: bool
    ) -> list[tuple[int, CheckpointKind]]:
        """Where a request computing tokens [start, end) should checkpoint: (length, kind) for
        every multiple of `interval_pages * page_size` in (start, end] (INTERVAL), plus the last
        page boundary <= end when the turn ends there (TURN_END). Prefill chunk ends should be
        aligned to these lengths."""
        if not 0 <= start <= end:
            raise CacheConfigError(f"points needs 0 <= start <= end, got start={start} end={end}")
        step = self.interval_pages * page_size
        points = [
            (length, CheckpointKind.INTERVAL)
            for length in range((start // step + 1) * step, end + 1, step)
        ]
        if turn_end:
            last = end // page_size * page_size
            if last > start:
                if points and points[-1][0] == last:
                    points.pop()
                points.append((last, CheckpointKind.TURN_END))
        return points


@attrs.frozen
class PoolSizes:
    """Entries of each device pool, sink entries included."""

    num_pages: int  # page 0 is the sink page
    num_live_slots: int  # slot 0 is the sink slot
    num_checkpoint_slots: int


@attrs.frozen(kw_only=True)
class CacheConfig:
    """How much device memory the cache may use and how it behaves.

    device_budget_bytes: bytes for the whole device tier: live KDA slots, checkpoint slots, pages.
    max_live_requests: requests that may hold cache at once (one live KDA slot each).
    checkpoint_fraction: share of the budget left after the live slots that goes to checkpoint
        slots (ignored when num_checkpoint_slots is given).
    num_checkpoint_slots: exact number of checkpoint slots, overriding checkpoint_fraction.
    checkpoint_policy: see `CheckpointPolicy`.
    metadata_only: keep no tensors at all (ids, refcounts and keys only): the simulator's mode.
    device: where the device tier's tensors live ("cuda:0"; "cpu" in tests).
    async_loads: copy L2 hits into the device tier in the background, layer by layer, signalling
        one event per layer (a copy stream on CUDA, a worker thread on CPU); otherwise copy inline.
    prefix_caching: index computed pages so that later requests on this rank reuse them (the
        default). Off for a rank that never looks a prefix up (a P/D decode rank, whose requests
        arrive with their whole cache): nothing is matched, pages are freed at release instead of
        cached, and turns are still checkpointed and published to the host tier.
    """

    device_budget_bytes: int = attrs.field(validator=_positive_int)
    max_live_requests: int = attrs.field(validator=_positive_int)
    checkpoint_fraction: float = attrs.field(default=0.2)
    num_checkpoint_slots: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative_int)
    )
    checkpoint_policy: CheckpointPolicy = attrs.field(factory=CheckpointPolicy)
    metadata_only: bool = attrs.field(default=False)
    device: str = attrs.field(default="cpu")
    async_loads: bool = attrs.field(default=True)
    prefix_caching: bool = attrs.field(default=True)

    @metadata_only.validator
    @async_loads.validator
    @prefix_caching.validator
    def _check_bool(self, attribute: attrs.Attribute, value: object) -> None:
        # A string such as "no" is truthy: take only a real bool.
        if not isinstance(value, bool):
            raise CacheConfigError(f"{attribute.name} must be a bool, got {value!r}")

    @checkpoint_fraction.validator
    def _check_fraction(self, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
            raise CacheConfigError(f"checkpoint_fraction must be in [0, 1), got {value!r}")

    @checkpoint_policy.validator
    def _check_policy(self, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, CheckpointPolicy):
            raise CacheConfigError(f"checkpoint_policy must be a CheckpointPolicy, got {value!r}")

    @device.validator
    def _check_device(self, attribute: attrs.Attribute, value: object) -> None:
        try:
            torch.device(value)
        except (RuntimeError, TypeError) as exc:
            raise CacheConfigError(f"device must name a torch device, got {value!r}") from exc

    def pool_sizes(self, geometry: CacheGeometry) -> PoolSizes:
        """Split the budget: live slots (plus one sink slot) first, then checkpoint slots, then
        pages (plus one sink page). Raises BudgetTooSmallError if not even one request fits."""
        state, page = geometry.kda_state_bytes, geometry.mla_page_bytes
        ckpt = geometry.kda_checkpoint_bytes
        live_slots = self.max_live_requests + 1
        rest = self.device_budget_bytes - live_slots * state
        if rest < 2 * page:
            raise BudgetTooSmallError(
                f"device_budget_bytes={self.device_budget_bytes} cannot hold {live_slots} KDA "
                f"slots of {state} bytes (max_live_requests={self.max_live_requests} plus the "
                f"sink) and two pages of {page} bytes (the sink and one usable page)"
            )
        if self.num_checkpoint_slots is not None:
            checkpoints = self.num_checkpoint_slots
        else:
            checkpoints = int(rest * self.checkpoint_fraction) // ckpt
        pages = (rest - checkpoints * ckpt) // page
        if pages < 2:
            raise BudgetTooSmallError(
                f"device_budget_bytes={self.device_budget_bytes} leaves room for {pages} pages "
                f"after {checkpoints} checkpoint slots (num_checkpoint_slots="
                f"{self.num_checkpoint_slots}); at least the sink and one usable page are needed"
            )
        return PoolSizes(
            num_pages=pages, num_live_slots=live_slots, num_checkpoint_slots=checkpoints
        )

    @staticmethod
    def budget_for(
        geometry: CacheGeometry, *, pages: int, live_requests: int, checkpoints: int
    ) -> int:
        """The device budget that yields exactly `pages` usable pages, `live_requests` live slots
        and `checkpoints` checkpoint slots (pass `num_checkpoint_slots=checkpoints` too)."""
        return (
            (pages + 1) * geometry.mla_page_bytes
            + (live_requests + 1) * geometry.kda_state_bytes
            + checkpoints * geometry.kda_checkpoint_bytes
        )
