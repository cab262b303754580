"""Latent attention ops over a latent cache: expanded (prefill) and absorbed (decode) forms."""

from .reference import gather_pages, mla_decode, mla_decode_paged, mla_prefill, split_kv_b

__all__ = ["gather_pages", "mla_decode", "mla_decode_paged", "mla_prefill", "split_kv_b"]
