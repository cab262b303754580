"""Per-request cache bytes at 200k tokens for each cache dtype choice (no device needed).

    python benchmarks/cache_bytes.py [--tokens 200000] [--page-size 64]

For the Kimi Linear and Kimi K3 presets (bf16 model), with the MLA cache in bf16 or FP8 (e4m3
rows + one fp32 scale per row, `EngineConfig.kv_cache_dtype="fp8_e4m3"`) and KDA checkpoints
in fp32 or bf16 (`kda_checkpoint_dtype`): bytes per token of MLA rows (every MLA layer), bytes
of one checkpoint (every KDA layer), and one request's bytes at `--tokens`: its pages, its live
KDA state (always fp32) and its checkpoints (one turn-end checkpoint; and the 16 that
`CheckpointPolicy.max_per_path` lets one prefix path keep). Prints a markdown table.
"""

from __future__ import annotations

import argparse

import torch

from tokenspeed.cache import CacheGeometry, CheckpointPolicy
from tokenspeed.model import get_preset

PRESETS = ("kimi-linear-48b-a3b", "kimi-k3")
CHOICES = (
    ("bf16", None, "fp32", None),
    ("bf16", None, "bf16", torch.bfloat16),
    ("fp8_e4m3", torch.float8_e4m3fn, "fp32", None),
    ("fp8_e4m3", torch.float8_e4m3fn, "bf16", torch.bfloat16),
)


def request_bytes(geometry: CacheGeometry, tokens: int, checkpoints: int) -> int:
    """Pages of `tokens` tokens, the live KDA state and `checkpoints` checkpoints."""
    pages = -(-tokens // geometry.page_size)
    return (
        pages * geometry.mla_page_bytes
        + geometry.kda_state_bytes
        + checkpoints * geometry.kda_checkpoint_bytes
    )


def rows(tokens: int, page_size: int):
    keep = max_checkpoints_per_path()
    for name in PRESETS:
        config = get_preset(name)
        for mla_name, mla_dtype, ck_name, ck_dtype in CHOICES:
            g = CacheGeometry.from_model_config(
                config,
                page_size=page_size,
                dtype=torch.bfloat16,
                mla_dtype=mla_dtype,
                kda_checkpoint_dtype=ck_dtype,
            )
            yield (
                name,
                mla_name,
                ck_name,
                g.mla_token_bytes,
                g.kda_checkpoint_bytes,
                request_bytes(g, tokens, 1),
                request_bytes(g, tokens, keep),
                g.fingerprint,
            )


def max_checkpoints_per_path() -> int:
    return CheckpointPolicy().max_per_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args()
    mib = 1 << 20
    keep = max_checkpoints_per_path()
    print(
        f"| model | MLA cache | KDA checkpoints | MLA bytes / token | bytes / checkpoint | "
        f"request at {args.tokens:,} tokens, 1 checkpoint | with {keep} checkpoints | "
        "fingerprint |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    base = {}
    for name, mla, ck, per_token, per_ckpt, one, many, fp in rows(args.tokens, args.page_size):
        ref = base.setdefault(name, one)
        print(
            f"| {name} | {mla} | {ck} | {per_token:,.0f} | {per_ckpt / mib:,.1f} MiB | "
            f"{one / mib:,.0f} MiB ({one / ref:.2f}x) | {many / mib:,.0f} MiB | `{fp}` |"
        )


if __name__ == "__main__":
    main()
