"""What a transform did to one rank: the weight bytes it kept."""

from __future__ import annotations

import attrs
from torch import nn


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (meta tensors count their would-be size)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@attrs.frozen
class TransformReport:
    """strategy: the transform's name. weight_bytes_before / after: this rank's bytes of the
    whole model before and after the transform. Communication is counted at run time, per
    exchange, by the `CommLog` the transform was given."""

    strategy: str
    weight_bytes_before: int
    weight_bytes_after: int

    @property
    def saved_bytes(self) -> int:
        return self.weight_bytes_before - self.weight_bytes_after
