"""Mixture-of-experts ops: the sigmoid router and the routed experts."""

from .reference import route, routed_experts, routed_experts_dense, routed_experts_grouped

__all__ = ["route", "routed_experts", "routed_experts_dense", "routed_experts_grouped"]
