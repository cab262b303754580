"""Write a model as a Hugging Face layout checkpoint (config.json, safetensors shards, index).

The names and layouts are the ones `loader.py` reads, so save -> load round-trips exactly; MXFP4
experts (`layers.moe.Mxfp4Experts`) are written packed, as compressed-tensors names them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .hf_config import to_hf_config
from .kimi import KimiForCausalLM
from .layers.moe import expert_format
from .loader import INDEX_FILE
from .weight_map import split_parts, tensor_specs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_checkpoint(
    model: KimiForCausalLM,
    path: str | Path,
    layout: str = "k3",
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Save `model` under `path` in the K3 (`language_model.` prefix, nested text_config) or the
    flat Kimi Linear layout, split into shards of at most `max_shard_bytes` with an index."""
    # The config first: a layout it refuses must not leave shards behind in `path`.
    hf = to_hf_config(model.config, layout=layout)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = model.config
    prefix = "language_model." if layout == "k3" else ""
    state = model.state_dict()
    experts = expert_format(model)
    tensors: dict[str, torch.Tensor] = {}
    for spec in tensor_specs(config, experts):
        for candidates, part in zip(spec.parts, split_parts(spec, state[spec.target]), strict=True):
            tensors[prefix + candidates[0]] = part.detach().to("cpu").contiguous()

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, root / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with (root / INDEX_FILE).open("w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)

    hf["dtype"] = _DTYPE_NAMES.get(model.lm_head.weight.dtype, "float32")
    if experts == "mxfp4":
        from .ops.moe.mxfp4 import FORMAT_NAME  # imports Triton: only when needed

        # Read from the top level in either layout (the loader also looks in text_config).
        hf["quantization_config"] = {"quant_method": "compressed-tensors", "format": FORMAT_NAME}
    with (root / "config.json").open("w") as f:
        json.dump(hf, f, indent=1)
    return root
