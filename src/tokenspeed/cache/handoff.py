"""Handing one request's cache from one rank to another, as byte ranges of the device tier.

A request prefilled on one rank (the source) continues on another (the destination). What its
decode needs there is exactly what its prefill left on the source: the MLA rows of its tokens
[0, n) in its pages, and its live KDA state (every KDA layer's conv window and recurrent state)
at n. n is the prompt's length, in general not a multiple of the page size: the last page is
partial, and the state is the live one, not a checkpoint (checkpoints sit on page boundaries).

    layout = cache.handoff_layout()                   # each side: how its tier is laid out
    src = cache.export_extent(handle, n)              # source: pages and live slot of [0, n)
    dst = other.import_extent(other_handle, n)        # destination: allocated as usual
    for r in transfer_ranges(layout, src, other_layout, dst):
        ...copy r.nbytes from the source's region r.region at r.src_offset to the destination's
        at r.dst_offset (a transfer engine, a socket, or `copy_ranges` in one process)...

Regions are the device tier's tensors, named as in `storage.py`: "mla" `[Lm, pages, R, W]`,
"conv" `[Lk, live slots, C, Kc]` and "recurrent" `[Lk, live slots, H, K, V]`, plus
"mla_scales" `[Lm, pages, R]` fp32 for an FP8 cache (its rows' scales); offsets are bytes
into each, whose flat uint8 views `device_regions` gives (the memory a transfer engine
registers). Only the destination's pages from `dst.first_page` on are written: the pages before
are the destination's own prefix hit, shared with other requests, and hold the same tokens.

The cache itself changes nothing for a handoff: the destination is allocated (`allocate`,
`extend`) and later checkpointed and released as any request; the bytes simply arrive in its
pages and live slot instead of being computed there. Its pages become matchable, as always,
once a checkpoint covers them.
"""

from __future__ import annotations

import attrs
import torch

from .errors import CacheConfigError, InvalidRequestError
from .handles import RequestCache
from .storage import DeviceStorage, _as_bytes

REGIONS = ("mla", "conv", "recurrent", "mla_scales")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen(kw_only=True)
class CacheLayout:
    """How one rank's device tier lies in memory: enough to turn pages and slots into byte
    offsets of its regions. Two ranks can hand requests to each other when their `fingerprint`s
    (the geometry: page size, rows per page, widths, dtypes, layer counts) agree; their pool
    sizes may differ."""

    fingerprint: str
    page_size: int
    mla_rows_per_page: int
    mla_row_bytes: int
    num_mla_layers: int
    num_pages: int
    num_kda_layers: int
    num_live_slots: int
    conv_bytes: int  # one live slot's conv window in one KDA layer
    recurrent_bytes: int  # one live slot's recurrent state in one KDA layer
    mla_scale_bytes: int = 0  # one row's scale in an FP8 cache (0: rows carry no scale)

    @classmethod
    def of(cls, storage: DeviceStorage) -> CacheLayout:
        g = storage.geometry
        mla, conv, rec = storage.mla, storage.conv, storage.recurrent
        return cls(
            fingerprint=g.fingerprint,
            page_size=g.page_size,
            mla_rows_per_page=mla.shape[2],
            mla_row_bytes=mla.shape[3] * mla.element_size(),
            num_mla_layers=mla.shape[0],
            num_pages=mla.shape[1],
            num_kda_layers=conv.shape[0],
            num_live_slots=conv.shape[1],
            conv_bytes=conv[0, 0].numel() * conv.element_size(),
            recurrent_bytes=rec[0, 0].numel() * rec.element_size(),
            mla_scale_bytes=g.mla_scale_bytes,
        )

    @property
    def page_bytes(self) -> int:
        """One page of one MLA layer."""
        return self.mla_rows_per_page * self.mla_row_bytes

    def region_bytes(self) -> dict[str, int]:
        regions = {
            "mla": self.num_mla_layers * self.num_pages * self.page_bytes,
            "conv": self.num_kda_layers * self.num_live_slots * self.conv_bytes,
            "recurrent": self.num_kda_layers * self.num_live_slots * self.recurrent_bytes,
        }
        if self.mla_scale_bytes:
            regions["mla_scales"] = (
                self.num_mla_layers * self.num_pages * self.mla_rows_per_page * self.mla_scale_bytes
            )
        return regions

    def rows_of_page(self, page: int, num_tokens: int) -> int:
        """MLA rows of page `page` (index in the request's table) that tokens [0, num_tokens)
        fill: a full page but for the last one. With R < P rows per page (a rank of a DCP group
        of P / R), an upper bound over the group's members."""
        tokens = min(num_tokens - page * self.page_size, self.page_size)
        return _ceil_div(tokens * self.mla_rows_per_page, self.page_size)

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CacheLayout:
        return cls(**data)


@attrs.frozen(kw_only=True)
class CacheExtent:
    """Where one request's handed-off cache is on one rank: the MLA rows of tokens
    [0, num_tokens) in pages `page_ids` (the request's pages first_page, first_page + 1, ...,
    up to the one holding token num_tokens - 1) and its KDA state at num_tokens in live slot
    `live_slot`."""

    num_tokens: int
    first_page: int
    page_ids: tuple[int, ...] = attrs.field(converter=tuple)
    live_slot: int

    def as_dict(self) -> dict:
        return {**attrs.asdict(self), "page_ids": list(self.page_ids)}

    @classmethod
    def from_dict(cls, data: dict) -> CacheExtent:
        return cls(**data)


@attrs.frozen
class ByteRange:
    """Copy `nbytes` of region `region` from the source's `src_offset` to the destination's
    `dst_offset`."""

    region: str
    src_offset: int
    dst_offset: int
    nbytes: int


def device_regions(storage: DeviceStorage) -> dict[str, torch.Tensor]:
    """The device tier's regions a handoff reads or writes, as flat uint8 views (same memory)."""
    regions = {
        "mla": _as_bytes(storage.mla),
        "conv": _as_bytes(storage.conv),
        "recurrent": _as_bytes(storage.recurrent),
    }
    if storage.mla_scales is not None:
        regions["mla_scales"] = _as_bytes(storage.mla_scales)
    return regions


def _quiesce(storage: DeviceStorage, handle: RequestCache) -> None:
    """Wait until nothing the cache or the device queued still writes into the request's pages
    or live slot (its load from L2, a checkpoint restore, the forward that computed them)."""
    handle.load.synchronize()
    if storage.device.type == "cuda":
        torch.cuda.synchronize(storage.device)


def extent(
    storage: DeviceStorage, handle: RequestCache, num_tokens: int, *, first_page: int
) -> CacheExtent:
    """The extent of a live handle's tokens [0, num_tokens), pages from `first_page` on, once
    quiescent (see `CacheManager.export_extent` / `import_extent`)."""
    P = storage.geometry.page_size
    ok = isinstance(num_tokens, int) and not isinstance(num_tokens, bool)
    if not ok or not 0 < num_tokens <= handle.num_tokens:
        raise InvalidRequestError(
            f"handoff of request {handle.request_id!r} at {num_tokens!r} tokens: must be "
            f"positive and at most the {handle.num_tokens} tokens its pages cover"
        )
    pages = _ceil_div(num_tokens, P)
    if not 0 <= first_page < pages:
        raise InvalidRequestError(
            f"handoff of request {handle.request_id!r}: first page {first_page} outside its "
            f"{pages} pages"
        )
    _quiesce(storage, handle)
    return CacheExtent(
        num_tokens=num_tokens,
        first_page=first_page,
        page_ids=handle.page_ids[first_page:pages].tolist(),
        live_slot=int(handle.live_slot),
    )


def transfer_ranges(
    src_layout: CacheLayout, src: CacheExtent, dst_layout: CacheLayout, dst: CacheExtent
) -> list[ByteRange]:
    """The byte ranges that move a request from `src` to `dst`: per MLA layer the rows of pages
    dst.first_page.. (runs of consecutive pages on both sides merged), then per KDA layer the
    live slot's conv window and recurrent state. Raises CacheConfigError when the layouts
    differ, InvalidRequestError when the extents do not describe the same tokens."""
    if src_layout.fingerprint != dst_layout.fingerprint or attrs.evolve(
        src_layout, num_pages=0, num_live_slots=0
    ) != attrs.evolve(dst_layout, num_pages=0, num_live_slots=0):
        raise CacheConfigError(
            f"cache layouts differ (source {src_layout.fingerprint}, destination "
            f"{dst_layout.fingerprint}): the two ranks serve different models or page sizes"
        )
    n, lay = src.num_tokens, src_layout
    pages = _ceil_div(n, lay.page_size)
    if dst.num_tokens != n or dst.first_page < src.first_page:
        raise InvalidRequestError(
            f"source holds {n} tokens from page {src.first_page}, destination expects "
            f"{dst.num_tokens} from page {dst.first_page}"
        )
    for name, e in (("source", src), ("destination", dst)):
        if len(e.page_ids) != pages - e.first_page:
            raise InvalidRequestError(
                f"{name} lists {len(e.page_ids)} pages from page {e.first_page}; {n} tokens "
                f"take {pages}"
            )
    out: list[ByteRange] = []

    def add(region: str, src_offset: int, dst_offset: int, nbytes: int) -> None:
        if out:
            last = out[-1]
            if (
                last.region == region
                and last.src_offset + last.nbytes == src_offset
                and last.dst_offset + last.nbytes == dst_offset
            ):
                out[-1] = ByteRange(region, last.src_offset, last.dst_offset, last.nbytes + nbytes)
                return
        out.append(ByteRange(region, src_offset, dst_offset, nbytes))

    page_bytes = lay.page_bytes
    src_pids = src.page_ids[dst.first_page - src.first_page :]
    rows = [lay.rows_of_page(j, n) * lay.mla_row_bytes for j in range(dst.first_page, pages)]
    for layer in range(lay.num_mla_layers):
        s_base = layer * src_layout.num_pages * page_bytes
        d_base = layer * dst_layout.num_pages * page_bytes
        for s_pid, d_pid, nbytes in zip(src_pids, dst.page_ids, rows, strict=True):
            add("mla", s_base + s_pid * page_bytes, d_base + d_pid * page_bytes, nbytes)
    if lay.mla_scale_bytes:  # an FP8 cache: the same rows' scales
        scale_page = lay.mla_rows_per_page * lay.mla_scale_bytes
        counts = [
            lay.rows_of_page(j, n) * lay.mla_scale_bytes for j in range(dst.first_page, pages)
        ]
        for layer in range(lay.num_mla_layers):
            s_base = layer * src_layout.num_pages * scale_page
            d_base = layer * dst_layout.num_pages * scale_page
            for s_pid, d_pid, nbytes in zip(src_pids, dst.page_ids, counts, strict=True):
                add(
                    "mla_scales",
                    s_base + s_pid * scale_page,
                    d_base + d_pid * scale_page,
                    nbytes,
                )
    for region, size in (("conv", lay.conv_bytes), ("recurrent", lay.recurrent_bytes)):
        for layer in range(lay.num_kda_layers):
            add(
                region,
                (layer * src_layout.num_live_slots + src.live_slot) * size,
                (layer * dst_layout.num_live_slots + dst.live_slot) * size,
                size,
            )
    return out


def check_ranges(ranges: list[ByteRange], region_bytes: dict[str, int], side: str) -> None:
    """Raise InvalidRequestError unless every range lies inside its region on `side` ("src" or
    "dst")."""
    for r in ranges:
        offset = r.src_offset if side == "src" else r.dst_offset
        size = region_bytes.get(r.region)
        if size is None or offset < 0 or r.nbytes <= 0 or offset + r.nbytes > size:
            raise InvalidRequestError(
                f"byte range {r} is outside the {side} region {r.region!r} ({size} bytes)"
            )


def copy_ranges(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], ranges: list[ByteRange]
) -> None:
    """Copy `ranges` between two sets of regions (`device_regions` of each side) in one
    process."""
    check_ranges(ranges, {k: v.numel() for k, v in src.items()}, "src")
    check_ranges(ranges, {k: v.numel() for k, v in dst.items()}, "dst")
    for r in ranges:
        dst[r.region][r.dst_offset : r.dst_offset + r.nbytes].copy_(
            src[r.region][r.src_offset : r.src_offset + r.nbytes]
        )
