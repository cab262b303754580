"""How big an engine's device cache is, and whether the device can hold it.

On a rank of a decode-context-parallel (DCP) group of C ranks, the model's MLA layers keep 1/C
of every request's rows (position p on member p % C as its local row p // C). The cache keeps
its pages of `page_size` tokens (the scheduler, prefix index, KDA checkpoints and L2 see the
same pages on every member) but a device page holds only `page_size / C` rows of each MLA
layer: the rows of that page's positions this member owns, which is exactly the local page the
DCP attention reads (local row k at row k % R of page page_table[k // R], R = page_size / C).
So a page costs 1/C of the MLA bytes, and one budget holds C times the tokens.

On a rank of a TEP group of T ranks (`tokenspeed.parallel.apply_tp`) the model's config
describes the rank's layers (T times fewer KDA and MLA heads), from which the geometry is read:
a KDA slot holds the rank's heads' conv and recurrent state (1/T of each layer's), while an MLA
row (the latent and its rope part) belongs to a token, not a head, and stays whole.

An EAGLE3 drafter keeps its KV rows in a pool of the same pages (`runtime/spec/eagle3.py`), so
with one a page costs its MLA bytes plus the drafter's (`draft_page_bytes`): the budget is split
as before, the pages getting fewer, and the cache is handed the budget less the drafter's pool.
"""

from __future__ import annotations

import math
import sys

import attrs
import torch

from tokenspeed.cache import CacheConfig, CacheGeometry, CheckpointPolicy
from tokenspeed.cache.errors import BudgetTooSmallError

from .config import DEFAULT_MAX_MODEL_LEN, EngineConfig, EngineConfigError
from .device import InsufficientMemoryError, free_memory_bytes


def mla_share(model) -> int:
    """Ranks splitting every request's MLA rows in `model`: the DCP group of its MLA layers
    (`tokenspeed.parallel.apply_dcp`), 1 when they are not split."""
    dcp = sys.modules.get("tokenspeed.parallel.dcp")
    if dcp is None or not hasattr(model, "modules"):
        # Not imported: nothing was split (and a single-rank engine need not load it).
        return 1
    sizes = {m.dcp_group.size for m in model.modules() if isinstance(m, dcp.DcpGatedMla)}
    if len(sizes) > 1:
        raise EngineConfigError(f"the model's MLA layers are split over DCP groups of {sizes}")
    return sizes.pop() if sizes else 1


def cache_geometry(model, page_size: int, dcp: int = 1, **dtypes) -> CacheGeometry:
    """The cache geometry of a `KimiForCausalLM` (rows in the model's dtype); dcp: ranks
    splitting its MLA rows (each device page holds page_size / dcp rows); dtypes:
    `EngineConfig.cache_dtypes` (an FP8 MLA cache, bf16 KDA checkpoints)."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    if not cfg.mla_layers or not cfg.kda_layers:
        # The cache keys prefixes by MLA pages and restores KDA state checkpoints: it is built
        # for hybrid models (e.g. transformers' Kimi Linear layout cut to 4 layers has no MLA).
        raise EngineConfigError(
            "the engine serves hybrid models with at least one MLA and one KDA layer; this "
            f"model has {len(cfg.mla_layers)} MLA and {len(cfg.kda_layers)} KDA layers"
        )
    if page_size % dcp:
        raise EngineConfigError(
            f"EngineConfig.page_size={page_size} is not a multiple of the DCP group size {dcp}: "
            f"each of its ranks keeps page_size / {dcp} MLA rows of every page"
        )
    return CacheGeometry.from_model_config(
        cfg, page_size=page_size, dtype=dtype, mla_share=dcp, **dtypes
    )


def fit_config(config: EngineConfig, model) -> EngineConfig:
    """`config` checked against (and completed from) the model it will serve: max_model_len
    None becomes the model's limit (`max_position_embeddings`, capped at DEFAULT_MAX_MODEL_LEN),
    and a max_model_len above that limit is refused (positions past it were never trained)."""
    limit = model.config.max_position_embeddings
    if config.max_model_len is None:
        return config.evolve(max_model_len=min(limit, DEFAULT_MAX_MODEL_LEN))
    if config.max_model_len > limit:
        raise EngineConfigError(
            f"EngineConfig.max_model_len={config.max_model_len} is above the model's limit of "
            f"{limit} tokens (max_position_embeddings of {model.config.name}): pass at most "
            f"{limit}, or leave max_model_len unset for {min(limit, DEFAULT_MAX_MODEL_LEN)}"
        )
    return config


def check_budget_fits(budget: int, device: torch.device, *, explicit: bool) -> None:
    """Refuse a cache the device cannot hold before allocating it: past the free memory the
    allocation fails deep in torch, or on a host the kernel kills the process for it."""
    free = free_memory_bytes(device)
    if free is None or budget <= free:
        return
    gib = 1 << 30
    fix = (
        "lower cache_budget_bytes"
        if explicit
        else "lower max_model_len or max_num_seqs (the default cache holds 2 x max_num_seqs x "
        "max_model_len tokens), or set cache_budget_bytes"
    )
    raise InsufficientMemoryError(
        f"the cache needs {budget / gib:.1f} GiB but the {device.type} device has "
        f"{free / gib:.1f} GiB free: {fix}"
    )


def plan_cache(
    model,
    config: EngineConfig,
    device: torch.device,
    *,
    dcp: int | None = None,
    draft_page_bytes: int = 0,
) -> tuple[CacheConfig, CacheGeometry]:
    """The device cache an engine over `model` builds from `config`: checked against the
    device's free memory before anything is allocated. dcp: ranks splitting the MLA rows
    (None: as the model's MLA layers are split, `mla_share`). draft_page_bytes: what a page
    costs an EAGLE3 drafter besides (its pool has as many pages as the cache's): the returned
    config's budget is then what is left for the cache once that pool is set aside."""
    dcp = mla_share(model) if dcp is None else dcp
    geometry = cache_geometry(model, config.page_size, dcp, **config.cache_dtypes)
    checkpoints = config.checkpoint_slots
    if config.cache_budget_bytes is None:
        checkpoints = checkpoints or 4 * config.max_num_seqs
    budget = config.cache_budget_bytes
    if budget is None:
        pages = 2 * config.max_num_seqs * config.max_pages_per_request
        budget = CacheConfig.budget_for(
            geometry, pages=pages, live_requests=config.max_num_seqs, checkpoints=checkpoints
        )
        budget += (pages + 1) * draft_page_bytes  # the drafter's rows of those pages
    cache_config = CacheConfig(
        device_budget_bytes=budget,
        max_live_requests=config.max_num_seqs,
        num_checkpoint_slots=checkpoints,
        checkpoint_policy=CheckpointPolicy(interval_pages=config.checkpoint_interval_pages),
        device=str(device),
    )
    if draft_page_bytes:
        cache_config = _beside_drafter(cache_config, geometry, config, draft_page_bytes)
    check_one_request_fits(cache_config, geometry, config)
    check_budget_fits(budget, device, explicit=config.cache_budget_bytes is not None)
    return cache_config, geometry


def _beside_drafter(
    cache_config: CacheConfig, geometry: CacheGeometry, config: EngineConfig, extra: int
) -> CacheConfig:
    """`cache_config` with the budget less a drafter pool of `extra` bytes per page: the live
    and checkpoint slots as the whole budget gives them (their number fixed), then as many
    pages as fit at their MLA bytes plus `extra` each. Refuses a budget whose pages then cannot
    hold one request of max_model_len tokens."""
    try:
        sizes = cache_config.pool_sizes(geometry)
    except BudgetTooSmallError:
        return cache_config  # too small even without the drafter: refused as such
    page = geometry.mla_page_bytes
    slots = (
        sizes.num_live_slots * geometry.kda_state_bytes
        + sizes.num_checkpoint_slots * geometry.kda_checkpoint_bytes
    )
    pages = (cache_config.device_budget_bytes - slots) // (page + extra)
    need = config.max_pages_per_request
    if pages - 1 < need:  # the sink page and the request's
        least = slots + (need + 1) * (page + extra)
        raise EngineConfigError(
            f"cache_budget_bytes={cache_config.device_budget_bytes} cannot hold one request of "
            f"max_model_len={config.max_model_len} tokens beside the EAGLE3 drafter's KV: each "
            f"page costs {page} bytes of the target's rows and {extra} of the drafter's, and "
            f"after {sizes.num_live_slots} live and {sizes.num_checkpoint_slots} checkpoint "
            f"slots it holds {_count(max(pages - 1, 0), 'page')}, not {need}: raise "
            f"cache_budget_bytes to at least {least}, or lower max_model_len or max_num_seqs"
        )
    return attrs.evolve(
        cache_config,
        device_budget_bytes=slots + pages * page,
        num_checkpoint_slots=sizes.num_checkpoint_slots,
    )


def _checkpoint_slots(rest: int, geometry: CacheGeometry) -> int:
    """The checkpoint slots `CacheConfig.pool_sizes` carves from `rest` bytes past the live
    slots when the engine leaves their number to it (its default checkpoint_fraction)."""
    fraction = attrs.fields(CacheConfig).checkpoint_fraction.default
    return int(rest * fraction) // geometry.kda_checkpoint_bytes


def smallest_budget(geometry: CacheGeometry, config: EngineConfig) -> int:
    """The smallest cache_budget_bytes that holds one request of max_model_len tokens: its
    pages, beside what the cache takes first (a live KDA slot for each of max_num_seqs requests
    plus a sink slot, a sink page, and the checkpoint slots: `config.checkpoint_slots`, or those
    `CacheConfig.pool_sizes` carves from such a budget)."""
    state, page = geometry.kda_state_bytes, geometry.mla_page_bytes
    ckpt = geometry.kda_checkpoint_bytes  # below state with kda_checkpoint_dtype="bfloat16"
    live = (config.max_num_seqs + 1) * state
    pages = (config.max_pages_per_request + 1) * page  # and the sink page
    if config.checkpoint_slots is not None:
        return live + pages + config.checkpoint_slots * ckpt
    # With c checkpoint slots the bytes past the live slots must reach pages + c * state; c
    # grows with those bytes, so try c = 0, 1, ... (the ranges of bytes giving each c follow
    # one another: the first c that works gives the smallest budget).
    fraction = attrs.fields(CacheConfig).checkpoint_fraction.default
    slots = 0
    while True:
        rest = pages + slots * ckpt
        carved = _checkpoint_slots(rest, geometry)
        if carved == slots:
            return live + rest
        if carved < slots:
            # The fewest bytes from which the cache carves `slots` slots (more than `rest`).
            low = math.ceil(slots * ckpt / fraction)
            while _checkpoint_slots(low - 1, geometry) >= slots:
                low -= 1
            while _checkpoint_slots(low, geometry) < slots:
                low += 1
            return live + low
        slots += 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_one_request_fits(
    cache_config: CacheConfig, geometry: CacheGeometry, config: EngineConfig
) -> None:
    """Refuse a budget that cannot hold one request of max_model_len tokens. Such a cache
    takes requests and aborts each as it outgrows the cache (finish_reason "abort", nothing
    raised): the issue's 300_000 bytes held 5 live KDA slots and 2 pages of 64 tokens (the sink
    and one usable page), so every request past 64 tokens was aborted."""
    need_pages = config.max_pages_per_request
    try:
        sizes = cache_config.pool_sizes(geometry)
    except BudgetTooSmallError:
        sizes = None
    if sizes is not None and sizes.num_pages - 1 >= need_pages:
        return
    need = smallest_budget(geometry, config)
    state, page = geometry.kda_state_bytes, geometry.mla_page_bytes
    if config.checkpoint_slots is not None:
        checkpoints = (
            f"{_count(config.checkpoint_slots, 'checkpoint slot')} "
            f"(checkpoint_slots={config.checkpoint_slots})"
        )
    else:
        fraction = cache_config.checkpoint_fraction
        carved = _checkpoint_slots(need - (config.max_num_seqs + 1) * state, geometry)
        checkpoints = (
            f"{_count(carved, 'checkpoint slot')} ({fraction:.0%} of the bytes past the live slots)"
        )
    holds = (
        "not even the live slots and two pages"
        if sizes is None
        else f"{_count(sizes.num_pages - 1, 'page')} ({(sizes.num_pages - 1) * config.page_size} "
        f"tokens) after {_count(sizes.num_checkpoint_slots, 'checkpoint slot')}"
    )
    raise EngineConfigError(
        f"cache_budget_bytes={cache_config.device_budget_bytes} cannot hold one request of "
        f"max_model_len={config.max_model_len} tokens: it needs {need_pages} pages of {page} "
        f"bytes ({config.page_size} tokens each) beside {config.max_num_seqs + 1} live KDA "
        f"slots of {state} bytes (max_num_seqs={config.max_num_seqs} and a sink), a sink page "
        f"and {checkpoints}, at least {need} bytes in all, and this budget holds {holds}: "
        f"raise cache_budget_bytes to {need} or more, or lower max_model_len or max_num_seqs"
    )
