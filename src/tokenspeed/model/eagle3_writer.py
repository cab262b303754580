"""Write an EAGLE3 drafter in the Hugging Face layout `eagle3_loader.py` reads, and fill one with
random weights (tests, benchmarks), as `hf_writer.py` and `init.py` do for the target."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from .eagle3 import Eagle3Drafter
from .eagle3_loader import EMBEDDING, eagle3_tensor_shapes, eagle3_to_hf_config

WEIGHTS_FILE = "model.safetensors"


def save_eagle3(
    drafter: Eagle3Drafter, path: str | Path, include_embedding: bool | None = None
) -> Path:
    """Save `drafter` under `path`: config.json and one model.safetensors.

    include_embedding: write embed_tokens.weight (None: only when the drafter has its own; a
    drafter saved without it loads with the target's embedding)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if include_embedding is None:
        include_embedding = not drafter.shares_embedding
    state = drafter.state_dict()
    tensors = {
        name: state[name].detach().to("cpu").contiguous()
        for name in eagle3_tensor_shapes(drafter.config)
        if include_embedding or name != EMBEDDING
    }
    save_file(tensors, root / WEIGHTS_FILE, metadata={"format": "pt"})
    config = eagle3_to_hf_config(drafter.config, drafter.lm_head.weight.dtype)
    with (root / "config.json").open("w") as f:
        json.dump(config, f, indent=1)
    return root


@torch.no_grad()
def init_random_eagle3(
    drafter: Eagle3Drafter, seed: int = 0, target_ids: Sequence[int] | None = None
) -> Eagle3Drafter:
    """Fill `drafter` in place from a seeded generator: norms near 1, projections
    N(0, 1/fan_in), its own embedding (not a shared one) N(0, 1). The draft vocabulary is
    `target_ids` (the target id of each draft id), or a seeded random sorted subset of the
    target vocabulary (all of it when the sizes agree)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in drafter.named_parameters():
        if name == EMBEDDING:
            if not drafter.shares_embedding:
                param.copy_(torch.randn(param.shape, generator=gen))
        elif name.endswith("norm.weight"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + 1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    c = drafter.config
    if target_ids is None:
        if c.draft_vocab_size == c.vocab_size:
            target_ids = torch.arange(c.vocab_size)
        else:
            target_ids = torch.randperm(c.vocab_size, generator=gen)[: c.draft_vocab_size].sort()
            target_ids = target_ids.values
    drafter.set_vocab(target_ids)
    return drafter
