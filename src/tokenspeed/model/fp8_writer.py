"""Rewrite a bf16 / fp32 checkpoint (as `hf_writer.save_checkpoint` writes it) in the FP8
block-scaled layout of DeepSeek / Kimi FP8 releases, for tests and benchmarks.

Every weight that such a checkpoint may store in FP8 (`weight_map.fp8_role`: the decoder layers'
linear projections, and the routed experts when `experts` is set) and whose module the ignored
list does not name becomes float8_e4m3fn with `<name>_scale_inv` fp32 [ceil(out/B0),
ceil(in/B1)] beside it (one scale per block: amax / 448); the rest is copied as stored.
config.json gets `quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [B0, B1]}` (and the ignored list, under
`ignored_key`). Other files of the source directory (a tokenizer, say) are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .hf_config import Fp8Config, from_hf_config, load_config_json
from .layers.fp8_linear import quantize_fp8_blockwise
from .loader import INDEX_FILE, CheckpointIndex
from .weight_map import fp8_role, scale_name, tensor_specs


def fp8_weight_names(config, experts: bool = True) -> dict[str, str]:
    """Checkpoint name (every accepted spelling, text-model form) -> our target, of the weights
    an FP8 checkpoint of `config` may store in FP8 (routed experts only when `experts`)."""
    out = {}
    for spec in tensor_specs(config):
        role = fp8_role(spec.target)
        if role is None or (not experts and ".experts." in spec.target):
            continue
        for candidates in spec.parts:
            out.update(dict.fromkeys(candidates, spec.target))
    return out


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    block_size: tuple[int, int] = (128, 128),
    ignored: tuple[str, ...] | list[str] = (),
    ignored_key: str = "ignored_layers",
    experts: bool = False,
) -> Path:
    """Write the FP8 block-scaled form of the checkpoint at `src` to `dst` (shards as in `src`,
    each scale in its weight's shard); returns `dst`.

    ignored: module names kept as stored (listed in config.json under `ignored_key`,
    "ignored_layers" or "modules_to_not_convert"); experts: quantise the routed experts too
    (the loader dequantises them at load).
    """
    src, dst = Path(src), Path(dst)
    raw = load_config_json(src)
    config = from_hf_config(raw)
    fp8 = Fp8Config(block_size=tuple(block_size), ignored=tuple(ignored))
    quantizable = fp8_weight_names(config, experts)
    index = CheckpointIndex.open(src)
    dst.mkdir(parents=True, exist_ok=True)

    by_file: dict[str, list[tuple[str, str]]] = {}
    for normal, (file, stored) in index.entries.items():
        by_file.setdefault(file, []).append((normal, stored))
    weight_map: dict[str, str] = {}
    total = 0
    for file, names in sorted(by_file.items()):
        shard: dict[str, torch.Tensor] = {}
        with safe_open(src / file, "pt", device="cpu") as handle:
            for normal, stored in names:
                tensor = handle.get_tensor(stored)
                target = quantizable.get(normal)
                module = normal.removesuffix(".weight")
                if target is not None and not fp8.ignores(module, target.removesuffix(".weight")):
                    q, s = quantize_fp8_blockwise(tensor, fp8.block_size)
                    shard[stored], shard[scale_name(stored)] = q, s
                else:
                    shard[stored] = tensor
        save_file(shard, dst / file, metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    with (dst / INDEX_FILE).open("w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)

    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fp8.block_size),
    }
    if ignored:
        quant[ignored_key] = list(ignored)
    raw["quantization_config"] = quant
    with (dst / "config.json").open("w") as f:
        json.dump(raw, f, indent=1)
    skip = {"config.json", INDEX_FILE, *by_file}
    for path in src.iterdir():
        if path.is_file() and path.name not in skip and path.suffix != ".safetensors":
            shutil.copy2(path, dst / path.name)
    return dst
