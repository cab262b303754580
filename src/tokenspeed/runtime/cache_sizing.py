"""How big an engine's device cache is, and whether the device can hold it."""

from __future__ import annotations

import torch

from tokenspeed.cache import CacheConfig, CacheGeometry, CheckpointPolicy

from .config import EngineConfig, EngineConfigError
from .device import free_memory_bytes


def cache_geometry(model, page_size: int) -> CacheGeometry:
    """The cache geometry of a `KimiForCausalLM` (rows in the model's dtype)."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    if not cfg.mla_layers or not cfg.kda_layers:
        # The cache keys prefixes by MLA pages and restores KDA state checkpoints: it is built
        # for hybrid models (e.g. transformers' Kimi Linear layout cut to 4 layers has no MLA).
        raise EngineConfigError(
            "the engine serves hybrid models with at least one MLA and one KDA layer; this "
            f"model has {len(cfg.mla_layers)} MLA and {len(cfg.kda_layers)} KDA layers"
        )
    return CacheGeometry.from_model_config(cfg, page_size=page_size, dtype=dtype)


def fit_config(config: EngineConfig, model) -> EngineConfig:
    """`config` checked against (and completed from) the model it will serve."""
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
    raise EngineConfigError(
        f"the cache needs {budget / gib:.1f} GiB but the {device.type} device has "
        f"{free / gib:.1f} GiB free: {fix}"
    )


def plan_cache(
    model, config: EngineConfig, device: torch.device
) -> tuple[CacheConfig, CacheGeometry]:
    """The device cache an engine over `model` builds from `config`: checked against the
    device's free memory before anything is allocated."""
    geometry = cache_geometry(model, config.page_size)
    checkpoints = config.checkpoint_slots
    if config.cache_budget_bytes is None:
        checkpoints = checkpoints or 4 * config.max_num_seqs
    budget = config.cache_budget_bytes or CacheConfig.budget_for(
        geometry,
        pages=2 * config.max_num_seqs * config.max_pages_per_request,
        live_requests=config.max_num_seqs,
        checkpoints=checkpoints,
    )
    check_budget_fits(budget, device, explicit=config.cache_budget_bytes is not None)
    cache_config = CacheConfig(
        device_budget_bytes=budget,
        max_live_requests=config.max_num_seqs,
        num_checkpoint_slots=checkpoints,
        checkpoint_policy=CheckpointPolicy(interval_pages=config.checkpoint_interval_pages),
        device=str(device),
    )
    return cache_config, geometry
