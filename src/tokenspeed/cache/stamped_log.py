"""Compaction of a stamped log: the append-only (id, stamp) arrays behind the device pages' LRU
queue (`MlaPageManager`) and the host tier's LRU order (`SlotLru`).

Both logs append an entry per touch and leave the superseded ones in place (an entry is live
while its id still carries that stamp), so a touch is an append and the oldest live entries
are the least recently used. When the arrays fill, the live entries move to the front.
"""

from __future__ import annotations

import numpy as np

from .compiled import jit


def compacted(
    ids: np.ndarray, stamps: np.ndarray, head: int, tail: int, live: np.ndarray, extra: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The entries head..tail of a log whose `live` ([tail - head] bool) is set, in order, at the
    front of new arrays with room for `extra` more (never smaller than before; doubled past
    what is needed). Returns (ids, stamps, entries kept)."""
    kept_ids = ids[head:tail][live]
    kept_stamps = stamps[head:tail][live]
    k = len(kept_ids)
    size = max(len(ids), 2 * (k + extra))
    new_ids = np.zeros(size, dtype=np.int64)
    new_stamps = np.zeros(size, dtype=np.int64)
    new_ids[:k] = kept_ids
    new_stamps[:k] = kept_stamps
    return new_ids, new_stamps, k


@jit
def compact_in_place(ids, stamps, head, tail, current):
    """Move the live entries of a log's head..tail to its front, in order, in place (one pass,
    no temporary arrays); an entry is live while its id still carries its stamp.

    ids, stamps: [size] int64, the log; current: [ids] int64, each id's stamp now. Returns how
    many entries were kept (they are now entries 0..kept)."""
    kept = 0
    for h in range(head, tail):
        i = ids[h]
        if current[i] == stamps[h]:
            ids[kept] = i
            stamps[kept] = stamps[h]
            kept += 1
    return kept
