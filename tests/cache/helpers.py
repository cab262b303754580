"""Shared test helpers: tiny geometries, managers, and content that is a function of the prefix.

Page content is derived from the page's chained key and KDA state from the token prefix, so equal
prefixes get equal bytes in every request, session and process, and any byte that lands in the
wrong place, or any hit that restores the wrong state, shows up as a mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from tokenspeed.cache import (
    CacheConfig,
    CacheGeometry,
    CacheManager,
    CheckpointPolicy,
    HostCache,
    RequestCache,
)
from tokenspeed.cache.keys import keys_to_ints


def tiny_geometry(page_size: int = 4, **overrides) -> CacheGeometry:
    fields = dict(
        page_size=page_size,
        num_mla_layers=2,
        mla_row_width=4,
        mla_dtype=torch.float16,
        num_kda_layers=3,
        kda_conv_shape=(6, 2),
        kda_recurrent_shape=(2, 2, 2),
        kda_conv_dtype=torch.bfloat16,
    )
    fields.update(overrides)
    return CacheGeometry(**fields)


def make_manager(
    geometry: CacheGeometry | None = None,
    *,
    pages: int = 32,
    live: int = 4,
    checkpoints: int = 8,
    l2: HostCache | None = None,
    metadata_only: bool = False,
    async_loads: bool = False,
    policy: CheckpointPolicy | None = None,
    device: str = "cpu",
    prefix_caching: bool = True,
) -> CacheManager:
    geometry = geometry or tiny_geometry()
    config = CacheConfig(
        device_budget_bytes=CacheConfig.budget_for(
            geometry, pages=pages, live_requests=live, checkpoints=checkpoints
        ),
        max_live_requests=live,
        num_checkpoint_slots=checkpoints,
        metadata_only=metadata_only,
        async_loads=async_loads,
        device=device,
        checkpoint_policy=policy or CheckpointPolicy(interval_pages=2, max_per_path=4),
        prefix_caching=prefix_caching,
    )
    return CacheManager(geometry, config, l2=l2)


def token_stream(seed: int, n: int, *, shared: Sequence[int] = ()) -> list[int]:
    """`shared` followed by pseudo-random tokens that depend on `seed`."""
    g = torch.Generator().manual_seed(seed)
    return list(shared) + torch.randint(0, 50_000, (n - len(shared),), generator=g).tolist()


def _seed(x: int) -> int:
    return x & ((1 << 62) - 1)


def prefix_seed(tokens: Sequence[int]) -> int:
    """A seed that depends only on the token prefix's content."""
    digest = hashlib.blake2b(repr(list(tokens)).encode(), digest_size=8).digest()
    return _seed(int.from_bytes(digest, "little"))


def page_content(geometry: CacheGeometry, key: int) -> torch.Tensor:
    """[num_mla_layers, R, W] rows of the page whose chained key is `key` (R: the rows a device
    page holds, page_size unless the geometry splits them over ranks)."""
    g = torch.Generator().manual_seed(_seed(key))
    shape = (geometry.num_mla_layers, geometry.mla_rows_per_page, geometry.mla_row_width)
    return torch.randn(shape, generator=g).to(geometry.mla_dtype)


def state_content(geometry: CacheGeometry, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [Lk, C, Kc], recurrent [Lk, H, K, V]) KDA state for a prefix seed."""
    g = torch.Generator().manual_seed(_seed(seed))
    conv = torch.randn((geometry.num_kda_layers, *geometry.kda_conv_shape), generator=g)
    rec = torch.randn((geometry.num_kda_layers, *geometry.kda_recurrent_shape), generator=g)
    return conv.to(geometry.kda_conv_dtype), rec.to(geometry.kda_recurrent_dtype)


def write_pages(cache: CacheManager, handle: RequestCache, start: int, end: int) -> None:
    """What the forward does: fill pages [start, end) of the request with their content."""
    storage = cache.storage
    keys = keys_to_ints(handle.page_keys[start:end])
    for i, key in zip(range(start, end), keys, strict=True):
        storage.mla[:, handle.page_ids[i]] = page_content(cache.geometry, key)


def write_live_state(cache: CacheManager, handle: RequestCache, seed: int) -> None:
    conv, rec = state_content(cache.geometry, seed)
    cache.storage.conv[:, handle.live_slot] = conv
    cache.storage.recurrent[:, handle.live_slot] = rec


def write_checkpoint_slot(cache: CacheManager, slot: int, seed: int) -> None:
    conv, rec = state_content(cache.geometry, seed)
    cache.storage.ckpt_conv[:, slot] = conv
    cache.storage.ckpt_recurrent[:, slot] = rec


def pages_match(cache: CacheManager, handle: RequestCache, start: int, end: int) -> bool:
    storage = cache.storage
    device = storage.mla.device
    return all(
        torch.equal(storage.mla[:, handle.page_ids[i]], page_content(cache.geometry, k).to(device))
        for i, k in zip(range(start, end), keys_to_ints(handle.page_keys[start:end]), strict=True)
    )


def live_state_matches(cache: CacheManager, handle: RequestCache, seed: int | None) -> bool:
    """Live slot equals the state for `seed` (None: all zeros, a fresh request)."""
    conv = cache.storage.conv[:, handle.live_slot]
    rec = cache.storage.recurrent[:, handle.live_slot]
    if seed is None:
        return not conv.any() and not rec.any()
    want_conv, want_rec = state_content(cache.geometry, seed)
    return torch.equal(conv.cpu(), want_conv) and torch.equal(rec.cpu(), want_rec)
