"""Attention-residual mix (AttnRes)."""

from .reference import attn_res_mix

__all__ = ["attn_res_mix"]
