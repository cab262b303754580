"""`KdaStateKeeper`: the KDA states an engine keeps for checkpoints it cannot snapshot live.

A checkpoint is normally a snapshot of a request's live KDA state, taken by the cache when the
live state is exactly at the checkpoint's position. Two kinds of checkpoint are not: one at a
position inside a prefill chunk (the scheduler asks for it after the chunk's forward, when the
live state has moved past it), and a turn end at a decode row's last page boundary when the row
ended (or was preempted) past it. For those the engine copies the state while it is there, and
this component keeps the copies until the scheduler's `save_state` asks for them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from tokenspeed.sched import Request
from tokenspeed.sched.cache_adapter import CacheManagerPort

KdaState = tuple[torch.Tensor, torch.Tensor]  # (conv, recurrent) over all KDA layers


class KdaStateKeeper:
    """Keeps KDA states at checkpoint positions and writes them into checkpoint slots.

    Contract (positions are token counts; states are device copies, `CacheManagerPort`'s
    `read_live_state`; every cache call goes through `port`):
    - `stash(rid, position)`: the request's live state is at `position` now (a prefill piece
      ended at a checkpoint position inside its chunk); a copy is kept until `clear_stash`.
      The engine clears at the start of each step's forwards, so the states of a step stay
      available to the `save_state` calls of its completion and of the next `schedule`.
    - `decoded(rids, positions)`: a decode step computed token `positions[i]` of request
      `rids[i]` and the live states are there now: each row whose history now ends on a page
      boundary gets its rolling checkpoint there (`keep_boundary`).
    - `crossings(rids, positions)`: the same moment inside a multi-step run, whose tokens are
      not known yet (the checkpoint needs the page's key): copies of the states of those rows,
      as (row index, boundary, state), for `keep_boundary` once the tokens are known.
    - `keep_boundary(rid, position, state=None)`: make the state at `position` (page-aligned)
      the request's rolling checkpoint; state None: the live state is there now. When the cache
      has no checkpoint at `position` afterwards (no slot was free), the state is kept here
      instead, one per request (the latest), for the turn-end checkpoint; a checkpoint there
      drops a kept one.
    - `save_state(req, position, slot)`: the scheduler's `SaveState` callback: writes the state
      stashed at `position`, else the one kept at `position`, into `slot`. With neither, the
      checkpoint is withdrawn (`discard_checkpoint`) and RuntimeError raised.
    - Any write into a slot the cache handed out that fails withdraws that checkpoint before
      the error propagates, so no request ever starts from a state never written.
    - `forget(rid)`: the request ended; everything kept of it is dropped.
    """

    def __init__(self, port: CacheManagerPort) -> None:
        self.port = port
        self.page_size = port.page_size
        # States inside a step's prefill chunks: rid -> {position: state}.
        self._stash: dict[Hashable, dict[int, KdaState]] = {}
        # A decoding request's state at its last page boundary when the cache had no slot for
        # its rolling checkpoint: rid -> (position, state).
        self._boundary: dict[Hashable, tuple[int, KdaState]] = {}

    def stash(self, rid: Hashable, position: int) -> None:
        self._stash.setdefault(rid, {})[position] = self.port.read_live_state(rid)

    def clear_stash(self) -> None:
        self._stash.clear()

    def decoded(self, rids: Sequence[Hashable], positions: Sequence[int]) -> None:
        page = self.page_size
        for rid, n in zip(rids, positions, strict=True):
            if (n + 1) % page == 0:
                self.keep_boundary(rid, n + 1)

    def crossings(
        self, rids: Sequence[Hashable], positions: Sequence[int]
    ) -> list[tuple[int, int, KdaState]]:
        page = self.page_size
        return [
            (i, n + 1, self.port.read_live_state(rids[i]))
            for i, n in enumerate(positions)
            if (n + 1) % page == 0
        ]

    def keep_boundary(self, rid: Hashable, position: int, state: KdaState | None = None) -> None:
        port = self.port
        slot = port.rolling_checkpoint(rid, position, from_live=state is None)
        if slot is not None and state is not None:
            self._write(rid, position, slot, state)
        if port.has_checkpoint(rid, position):
            self._boundary.pop(rid, None)
        else:
            kept = port.read_live_state(rid) if state is None else state
            self._boundary[rid] = (position, kept)

    def save_state(self, req: Request, position: int, slot: int) -> None:
        state = self._stash.get(req.rid, {}).get(position)
        kept = self._boundary.get(req.rid)
        if state is None and kept is not None and kept[0] == position:
            state = kept[1]
        if state is None:
            self.port.discard_checkpoint(req.rid, position, slot)
            raise RuntimeError(f"no KDA state kept for request {req.rid!r} at position {position}")
        self._write(req.rid, position, slot, state)

    def forget(self, rid: Hashable) -> None:
        self._stash.pop(rid, None)
        self._boundary.pop(rid, None)

    def _write(self, rid: Hashable, position: int, slot: int, state: KdaState) -> None:
        try:
            self.port.write_checkpoint_state(slot, state)
        except BaseException:
            self.port.discard_checkpoint(rid, position, slot)
            raise
