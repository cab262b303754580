"""Checkpoints along one request's prefix: the per-path cap and the rolling checkpoint.

A request's path is its chain of page keys; the checkpoints on it are those whose key is
`keys[n - 1]` for some page count n. The cap keeps a long prefill (a checkpoint every N pages)
from filling the checkpoint pool with one request's snapshots: beyond `max_per_path`, unpinned
interval checkpoints go first, and among equals the one closest to its predecessor, so the
survivors stay spread over the prefix (useful branch points for other requests) rather than
bunched at its end.
"""

from __future__ import annotations

from .checkpoints import CheckpointEntry, CheckpointKind, CheckpointManager
from .handles import RequestCache
from .stats import CacheCounters


class CheckpointPaths:
    def __init__(
        self, ckpts: CheckpointManager, max_per_path: int, page_size: int, counters: CacheCounters
    ) -> None:
        self.ckpts = ckpts
        self.max_per_path = max_per_path
        self.page_size = page_size
        self.counters = counters

    def path(self, handle: RequestCache) -> list[int]:
        """Sorted page counts n where the request's prefix has an L1 checkpoint. Found once per
        request (lazily, over its registered pages), then maintained as it adds checkpoints."""
        return [n for n, _ in self.entries(handle)]

    def entries(self, handle: RequestCache) -> list[tuple[int, int]]:
        """The path as sorted (n, key of page n - 1) pairs, dropping checkpoints evicted since."""
        index = self.ckpts.index
        if handle._path is None:
            keys = handle._keys
            found = self.ckpts.on_path(keys.array, handle._registered)
            handle._path = [(n, keys[n - 1]) for n in found]
        else:
            handle._path = [entry for entry in handle._path if entry[1] in index]
        return handle._path

    def note(self, handle: RequestCache, n: int) -> None:
        path = self.entries(handle)
        if all(m != n for m, _ in path):
            path.append((n, handle._keys[n - 1]))
            path.sort()

    def enforce_cap(self, handle: RequestCache, *, newest: int) -> None:
        path = self.entries(handle)
        index = self.ckpts.index
        while len(path) > self.max_per_path:
            best = None
            prev = 0
            for i, (n, key) in enumerate(path):
                entry = index[key]
                if n != newest and entry.refcount == 0:
                    rank = (entry.kind is not CheckpointKind.INTERVAL, n - prev, n)
                    if best is None or rank < best[0]:
                        best = (rank, i, entry)
                prev = n
            if best is None:
                return  # everything else is pinned
            self.ckpts.remove(best[2])
            del path[best[1]]
            self.counters.checkpoints_thinned += 1

    def set_rolling(self, handle: RequestCache, entry: CheckpointEntry) -> None:
        """Make `entry` the request's rolling checkpoint (pinned while the request runs); the
        previous rolling one, superseded, is dropped unless someone else holds it."""
        old = handle._rolling
        if old is entry:
            return
        self.ckpts.pin(entry)
        handle._rolling = entry
        if old is not None:
            self.ckpts.unpin(old)
            if old.kind is CheckpointKind.ROLLING and old.refcount == 0:
                self.ckpts.remove(old)
                self.counters.checkpoints_thinned += 1

    def end_rolling(self, handle: RequestCache) -> None:
        """At release: the rolling checkpoint stays as the turn's end, unpinned."""
        rolling = handle._rolling
        if rolling is not None:
            if rolling.kind is CheckpointKind.ROLLING:
                rolling.kind = CheckpointKind.TURN_END
            self.ckpts.unpin(rolling)
            handle._rolling = None
