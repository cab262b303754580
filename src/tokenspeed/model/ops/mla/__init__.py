"""Latent attention ops over a latent cache: expanded (prefill) and absorbed (decode) forms."""

from .reference import mla_decode, mla_prefill, split_kv_b

__all__ = ["mla_decode", "mla_prefill", "split_kv_b"]
