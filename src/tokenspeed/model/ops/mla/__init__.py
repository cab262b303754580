"""Latent attention ops over a latent cache: expanded (prefill) and absorbed (decode) forms."""

from .reference import (
    dequantize_rows,
    gather_pages,
    mla_decode,
    mla_decode_paged,
    mla_prefill,
    quantize_rows_e4m3,
    split_kv_b,
)

__all__ = [
    "dequantize_rows",
    "gather_pages",
    "mla_decode",
    "mla_decode_paged",
    "mla_prefill",
    "quantize_rows_e4m3",
    "split_kv_b",
]
