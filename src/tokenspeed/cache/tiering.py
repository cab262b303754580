"""Traffic between the device tier (L1) and the host tier (L2).

- lookups across both tiers: how far pages reach (`coverage`), the deepest checkpoint they cover;
- reads: `fetch` turns a `PrefixMatch` into a `HitPlan` with verified L2 payloads, shrinking the hit
  to the deepest checkpoint still fully readable when an object is missing or rejected (an L2
  failure costs reuse, never correctness);
- writes: write-back of evicted pages and checkpoints that L2 lacks, and write-through of a turn's
  prefix at publish. Pages go before checkpoints, so a reader never finds a checkpoint whose pages
  were not offered first.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Literal

import attrs
import numpy as np
import torch

from ..types import PageKey
from .checkpoints import CheckpointEntry, CheckpointKind, CheckpointManager
from .compiled import jit
from .config import CacheGeometry
from .handles import PrefixMatch
from .keys import PageKeys, key_int
from .l2.base import HostCache, HostObject, ObjectKind
from .l2.guarded import GuardedL2
from .mla_pages import MlaPageManager
from .stats import CacheCounters
from .storage import DeviceStorage

Tier = Literal["l1", "l2"]


@jit
def _gaps(pids, bounds):
    """The runs of -1 in `pids` as (start, end) pairs into `bounds`; returns how many."""
    gaps = 0
    i = 0
    n = pids.shape[0]
    while i < n:
        if pids[i] >= 0:
            i += 1
            continue
        j = i + 1
        while j < n and pids[j] < 0:
            j += 1
        bounds[2 * gaps] = i
        bounds[2 * gaps + 1] = j
        gaps += 1
        i = j
    return gaps


@attrs.define
class HitPlan:
    """A hit whose L2 part has been read and verified.

    sources: [hit pages] int64: per hit page, its L1 page id or -1 (to be filled from
        `page_payloads`, in order; a metadata-only cache reads no payloads: empty).
    checkpoint_payload: the checkpoint's bytes when it comes from L2 (an empty tensor in
        metadata-only mode), else None.
    """

    sources: np.ndarray
    checkpoint_tier: Tier | None
    page_payloads: list[torch.Tensor]
    checkpoint_payload: torch.Tensor | None

    @property
    def hit_pages(self) -> int:
        return len(self.sources)


class Tiering:
    def __init__(
        self,
        geometry: CacheGeometry,
        pages: MlaPageManager,
        checkpoints: CheckpointManager,
        storage: DeviceStorage | None,
        l2: HostCache | None,
        counters: CacheCounters,
    ) -> None:
        self.geometry = geometry
        self.pages = pages
        self.ckpts = checkpoints
        self.storage = storage
        self.counters = counters
        self.l2 = GuardedL2(l2, self._count_error) if l2 is not None else None
        self._no_payload = torch.empty(0, dtype=torch.uint8)  # metadata-only checkpoint reads

    def l2_version(self) -> int | None:
        """The host tier's `presence_version` (None without a host tier)."""
        return self.l2.presence_version() if self.l2 is not None else None

    def _count_error(self) -> None:
        self.counters.l2_errors += 1

    # -------------------------------------------------------------------------- lookups
    def coverage(self, keys: PageKeys, pids: np.ndarray) -> int:
        """Pages [0, n) covered by L1 or L2, given the L1 lookup `pids` ([n] int64, -1: absent)
        of `keys`. Each gap in L1 is asked of L2 in order until one is not fully covered; gaps
        are found with whole-array steps, so a long history costs a step per gap, not per page."""
        n = len(keys)
        bounds = np.empty(n + 1, dtype=np.int64)
        gaps = _gaps(pids, bounds)
        if not gaps:
            return n
        if self.l2 is None:
            return int(bounds[0])
        for start, end in bounds[: 2 * gaps].reshape(gaps, 2).tolist():
            found = self.l2.prefix_present(ObjectKind.PAGE, keys[start:end])
            if found < end - start:
                return start + found
        return n

    def deepest_checkpoint(self, keys: PageKeys, limit: int) -> tuple[int, Tier | None]:
        """Largest i < limit with a checkpoint at keys[i] in L1 or L2, and its tier (L1 wins
        ties); (-1, None) if none."""
        in_l1 = self.ckpts.deepest(keys, limit)
        if self.l2 is not None and limit - 1 > in_l1:
            j = self.l2.last_present(ObjectKind.CHECKPOINT, keys[in_l1 + 1 : limit])
            if j >= 0:
                return in_l1 + 1 + j, "l2"
        return (in_l1, "l1") if in_l1 >= 0 else (-1, None)

    # ---------------------------------------------------------------------------- reads
    def fetch(self, keys: PageKeys, match: PrefixMatch) -> HitPlan:
        """Read and verify the L2 part of a hit; shrink the hit when something is unreadable."""
        sources = match.sources
        tier = match.checkpoint_tier
        hit = len(sources)
        from_l2_mask = sources < 0
        if self.l2 is None or hit == 0 or (tier == "l1" and not np.count_nonzero(from_l2_mask)):
            return HitPlan(sources, tier, [], None)
        P = self.geometry.page_size
        from_l2 = np.flatnonzero(from_l2_mask)  # hit pages that come from L2, ascending
        # [hit] bool, the L2 pages read and verified in earlier passes: made when a first pass
        # fails (the usual fetch reads every L2 page of the hit once and is done).
        kept: np.ndarray | None = None
        payloads: dict[int, torch.Tensor] | None = {} if self.storage is not None else None
        checkpoint = None
        need = from_l2  # the L2 pages still to read below `hit`
        while hit > 0:
            good = need
            first_bad = -1
            if len(need):
                ok, got = self._read(ObjectKind.PAGE, keys[need], need)
                bad = np.flatnonzero(~ok)
                if len(bad):
                    good = need[: bad[0]]
                    first_bad = int(need[bad[0]])
                if payloads is not None:
                    payloads.update(zip(good.tolist(), got, strict=False))
            if first_bad < 0 and tier == "l2":
                ok, got = self._read(ObjectKind.CHECKPOINT, keys[hit - 1 : hit], [hit * P])
                if ok[0]:
                    checkpoint = got[0] if got is not None else self._no_payload
                    break
            elif first_bad < 0:
                break
            # Something vanished or failed verification: fall back to a shallower checkpoint
            # that the remaining readable pages still cover.
            self.counters.l2_fetch_failures += 1
            if kept is None:
                kept = np.zeros(len(sources), dtype=bool)
            kept[good] = True
            limit = first_bad if first_bad >= 0 else hit - 1
            best, tier = self.deepest_checkpoint(keys, limit)
            hit = best + 1
            need = from_l2[: np.searchsorted(from_l2, hit)]
            need = need[~kept[need]]
        else:
            return HitPlan(sources[:0], None, [], None)
        sources = sources[:hit]
        if payloads is None:
            return HitPlan(sources, tier, [], checkpoint)
        hit_l2 = from_l2[: np.searchsorted(from_l2, hit)].tolist()
        return HitPlan(sources, tier, list(map(payloads.__getitem__, hit_l2)), checkpoint)

    def _read(
        self, kind: ObjectKind, keys: PageKeys, positions: np.ndarray | list[int]
    ) -> tuple[np.ndarray, list[torch.Tensor | None] | None]:
        """([n] bool: read and verified, the payloads or None for a metadata-only cache)."""
        if self.storage is None:
            return self.l2.get_present(kind, keys, positions), None
        got = self.l2.get(kind, keys, positions)
        return np.array(list(map(operator.is_not, got, repeat(None))), dtype=bool), got

    def promote_checkpoint(self, key: PageKey, num_tokens: int) -> CheckpointEntry | None:
        """An L1 slot for a checkpoint being loaded from L2 (filled by the same load), so later
        requests on this rank find it in L1. None if it is already there or no slot is free."""
        if self.ckpts.get(key) is not None:
            return None
        entry = self.ckpts.add(key, num_tokens, CheckpointKind.TURN_END, self.writeback_checkpoints)
        if entry is not None:
            self.counters.checkpoints_promoted += 1
        return entry

    # --------------------------------------------------------------------------- writes
    def writeback_pages(self, pids: np.ndarray, keys: PageKeys, positions: np.ndarray) -> None:
        """Eviction hook: store evicted pages that L2 lacks before their slots are reused."""
        self.counters.pages_evicted += len(pids)
        if self.l2 is None:
            return
        present = self.l2.contains(ObjectKind.PAGE, keys)
        if present.all():
            return
        if not present.any():
            self.counters.pages_written_back += self._put_pages(keys, positions, pids)
            return
        missing = np.flatnonzero(~present)
        self.counters.pages_written_back += self._put_pages(
            keys[missing], positions[missing], pids[missing]
        )

    def writeback_checkpoints(self, entries: list[CheckpointEntry]) -> None:
        """Eviction hook: store evicted checkpoints that L2 lacks before their slots are reused."""
        self.counters.checkpoints_evicted += len(entries)
        if self.l2 is None:
            return
        present = self.l2.contains(ObjectKind.CHECKPOINT, self.ckpts.keys_of(entries))
        missing = [e for e, p in zip(entries, present.tolist(), strict=True) if not p]
        if missing:
            self.counters.checkpoints_written_back += self._put_checkpoints(missing)

    def publish(self, keys: PageKeys, page_ids: np.ndarray, path: list[int]) -> int:
        """Write-through of a request's prefix up to its deepest checkpoint `path[-1]` (pages)
        and of its checkpoints at `path`; returns how many objects were newly stored: of the
        objects L2 lacked, those each write reports stored when it returned (`HostCache.put`).
        Pages that the checkpoint write then evicts still count; in an LRU tier that takes a
        publish larger than the whole tier, and finding them would cost a lookup per publish."""
        l2 = self.l2
        assert l2 is not None
        deepest = path[-1]
        # Earlier turns usually published the start already: skip the present prefix cheaply.
        first = l2.prefix_present(ObjectKind.PAGE, keys[:deepest])
        present = l2.contains(ObjectKind.PAGE, keys[first:deepest])
        missing = np.flatnonzero(~present)
        missing += first
        # One checkpoint (the usual publish): a slice, no index array.
        ckpt_keys = (
            keys[deepest - 1 : deepest]
            if len(path) == 1
            else keys[np.array(path, dtype=np.int64) - 1]
        )
        present = l2.contains(ObjectKind.CHECKPOINT, ckpt_keys)
        index = self.ckpts.index
        entries = [index[key_int(ckpt_keys[i])] for i, p in enumerate(present.tolist()) if not p]
        # Both lookups come before the writes (what is written does not depend on what the
        # writes evict); pages first, then checkpoints.
        # The missing pages are usually one stretch of the chain: a run for the host tier, and
        # slices (views) of the keys and page ids instead of gathered copies.
        k = len(missing)
        if k > 1 and int(missing[-1] - missing[0]) == k - 1:
            start = int(missing[0])
            stored = self._put_pages(
                keys[start : start + k], missing, page_ids[start : start + k], chain=True
            )
        else:
            stored = self._put_pages(keys[missing], missing, page_ids[missing])
        stored += self._put_checkpoints(entries) if entries else 0
        self.counters.objects_published += stored
        return stored

    def _put_pages(
        self,
        keys: PageKeys,
        positions: np.ndarray,
        pids: np.ndarray,
        *,
        chain: bool = False,
    ) -> int:
        """Store pages (device ids `pids`, [n] int64) in L2; returns how many of them are stored
        when the write returns (`HostCache.put`). chain: they are consecutive pages of one chain
        (a hint for the host tier)."""
        if not len(keys):
            return 0
        payloads = self.storage.read_pages(pids) if self.storage is not None else None
        return self.l2.put_many(ObjectKind.PAGE, keys, positions, payloads, chain=chain)

    def _put_checkpoints(self, entries: list[CheckpointEntry]) -> int:
        """Store checkpoints in L2 (metadata-only: one batched write); returns how many of them
        are stored when the write returns."""
        if self.storage is None:
            keys = self.ckpts.keys_of(entries)
            positions = [e.num_tokens for e in entries]
            return self.l2.put_many(ObjectKind.CHECKPOINT, keys, positions)
        return self.l2.put([self._checkpoint_object(e) for e in entries])

    def _checkpoint_object(self, entry: CheckpointEntry) -> HostObject:
        payload = self.storage.read_checkpoint(entry.slot) if self.storage is not None else None
        return HostObject(
            ObjectKind.CHECKPOINT,
            entry.key,
            entry.num_tokens,
            self.geometry.kda_checkpoint_bytes,
            payload,
        )
