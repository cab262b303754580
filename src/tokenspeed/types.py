"""Small types shared across layers (cache, scheduler, simulator, runtime).

Keep this module tiny and dependency-free: it is the one place where layers that may not import each
other agree on names. Anything with behaviour belongs in its own layer.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeAlias

import attrs

RequestId: TypeAlias = Hashable
"""Identifies one request (one turn of a conversation) for as long as it holds cache."""

PageKey: TypeAlias = int
"""Chained content key of one full page: a 128-bit integer that depends on the page's content and
on every page before it, so equal keys mean equal prefixes. Sequences of keys travel as numpy
`PageKeys` arrays, one element per key (see `tokenspeed.cache.keys`)."""

PageId: TypeAlias = int
"""Index of a page in the device page pool (row of the MLA pool tensor)."""

SlotId: TypeAlias = int
"""Index of a KDA state slot (live slot or checkpoint slot) in its pool."""


@attrs.frozen
class TokenSpan:
    """Half-open token range [start, end) of a sequence."""

    start: int
    end: int

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"TokenSpan needs 0 <= start <= end, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start
