"""Choose the rank for each request: prefill by least outstanding work, decode by load.

The router holds no view of the ranks of its own: callers pass the current loads (each prefill
scheduler reports `outstanding_tokens()`, each decode scheduler `load()`), so one router serves a
simulator and an engine alike. Ties go to the lowest rank after a rotating start, so that an idle
cluster spreads requests instead of piling them on rank 0. Conversation affinity (the baseline a
shared L2 makes unnecessary) places a conversation's first turn by least work and keeps it there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from tokenspeed.sched.config import RouterConfig, RoutingPolicy


class DecodeLoad(NamedTuple):
    """What a decode rank reports to the router (a tuple: every arrival builds one per decode
    rank)."""

    running: int  # requests decoding or admitted (reserved) on the rank
    free_pages: int  # device pages the rank can still hand out


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._affinity: dict[Hashable, int] = {}
        self._next_prefill = 0
        self._next_decode = 0

    def pick_prefill(self, loads: Sequence[int], session: Hashable | None = None) -> int:
        """Rank for a prefill, given each prefill rank's outstanding tokens (queued + running)."""
        if len(loads) != self.config.num_prefill_ranks:
            raise ValueError(f"got {len(loads)} loads for {self.config.num_prefill_ranks} ranks")
        if self.config.policy is RoutingPolicy.AFFINITY and session is not None:
            rank = self._affinity.get(session)
            if rank is None:
                rank = self._least(loads)
                self._affinity[session] = rank
            return rank
        return self._least(loads)

    def pick_decode(self, loads: Sequence[DecodeLoad]) -> int:
        """Fewest running requests; among those, the most free pages."""
        if len(loads) != self.config.num_decode_ranks:
            raise ValueError(f"got {len(loads)} loads for {self.config.num_decode_ranks} ranks")
        n = len(loads)
        if n == 0:  # the tie rotation below would divide by zero
            raise ValueError("no decode ranks to pick from (num_decode_ranks=0: aggregated)")
        start = self._next_decode
        self._next_decode = (start + 1) % n
        order = [(start + i) % n for i in range(n)]
        return min(order, key=lambda r: (loads[r].running, -loads[r].free_pages))

    def forget(self, session: Hashable) -> None:
        """Drop a finished conversation's affinity entry."""
        self._affinity.pop(session, None)

    def _least(self, loads: Sequence[int]) -> int:
        n = len(loads)
        start = self._next_prefill
        self._next_prefill = (start + 1) % n
        best = start
        for i in range(1, n):
            r = (start + i) % n
            if loads[r] < loads[best]:
                best = r
        return best
