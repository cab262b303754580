"""`exhaust`: run an iterator for its side effects.

The metadata paths update many dict / list entries per call (a page run, a batch of slots);
`exhaust(map(d.__setitem__, keys, values))` does that in C rather than in a Python loop, which
the simulator's profile showed matters at millions of updates (docs/perf/sim_speed.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def exhaust(items: Iterable[object]) -> None:
    """Consume `items`, keeping nothing (a zero-length deque)."""
    deque(items, maxlen=0)
