"""Kimi Delta Attention ops: gate, recurrent and chunked forms (torch references)."""

from .reference import kda_chunked, kda_gate, kda_recurrent

__all__ = ["kda_chunked", "kda_gate", "kda_recurrent"]
