"""Mixture-of-experts ops: the sigmoid router and the routed experts."""

from .reference import route, routed_experts

__all__ = ["route", "routed_experts"]
