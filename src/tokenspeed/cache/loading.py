"""Putting a hit's state in place in the device tier, and tracking copies still in flight.

An L1 checkpoint is restored inline (on the current stream, ordered before the forward). Pages
and state read from L2 are copied layer by layer by the copy engine, one event per layer. Pages
and promoted checkpoints being filled are indexed at once (so that a second request may share
them); that request then waits on the first one's events too, and a checkpoint restore from a
promoted slot waits for its copies first.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..types import PageId, PageKey, SlotId
from .checkpoints import CheckpointEntry
from .config import CacheGeometry
from .copy_engine import CopyEngine
from .load_handle import LoadHandle
from .stats import CacheCounters
from .storage import DeviceStorage
from .tiering import HitPlan


class Loader:
    def __init__(
        self,
        geometry: CacheGeometry,
        storage: DeviceStorage | None,
        copier: CopyEngine,
        counters: CacheCounters,
    ) -> None:
        self.geometry = geometry
        self.storage = storage
        self.copier = copier
        self.counters = counters
        # Pages / checkpoints whose bytes some request's load is still copying in.
        self._pending_pages: dict[PageId, LoadHandle] = {}
        self._pending_ckpts: dict[PageKey, LoadHandle] = {}

    def start(
        self,
        live_slot: SlotId,
        plan: HitPlan,
        l1_hit: np.ndarray,
        l2_pids: np.ndarray,
        source_ckpt: CheckpointEntry | None,
        promoted: CheckpointEntry | None,
    ) -> LoadHandle:
        """Restore the hit's KDA state into `live_slot` (zeros on a miss) and start copying the
        L2 part (`l2_pids` <- plan.page_payloads, the checkpoint payload into the live slot and
        into `promoted`'s slot). Returns the handle with one event per layer."""
        g = self.geometry
        # Per layer, a tuple of events; most layers of most loads have none.
        mla_events: list[tuple] = [()] * g.num_mla_layers
        kda_events: list[tuple] = [()] * g.num_kda_layers
        pending = self._pending_pages
        deps = (
            {id(d): d for p in l1_hit.tolist() if (d := pending.get(p)) is not None}
            if pending
            else {}
        )
        for dep in deps.values():
            for layer in range(g.num_mla_layers):
                mla_events[layer] = (*mla_events[layer], *dep.mla_events(layer))
        from_l2 = plan.checkpoint_tier == "l2"
        storage = self.storage
        if storage is None:
            return LoadHandle(mla_events, kda_events, l2_pages=len(l2_pids), l2_checkpoint=from_l2)
        if plan.hit_pages == 0:
            storage.zero_live(live_slot)
        elif source_ckpt is not None:
            arriving = self._pending_ckpts.get(source_ckpt.key)
            if arriving is not None:
                for layer in range(g.num_kda_layers):
                    arriving.wait_kda(layer)
            storage.restore_checkpoint(source_ckpt.slot, live_slot)
        steps: dict[tuple[str, int], Callable[[], None]] = {}
        keepalive: list = []
        if len(l2_pids):
            page_steps, keep = storage.page_load_steps(l2_pids, plan.page_payloads)
            keepalive += keep
            steps.update({("mla", i): s for i, s in enumerate(page_steps)})
        if from_l2:
            state_steps, keep = storage.state_load_steps(
                plan.checkpoint_payload, live_slot, promoted.slot if promoted else None
            )
            keepalive += keep
            steps.update({("kda", i): s for i, s in enumerate(state_steps)})
        order = [layer for layer in g.copy_order if layer in steps]
        events = self.copier.submit([steps[layer] for layer in order])
        for (kind, index), event in zip(order, events, strict=True):
            target = mla_events if kind == "mla" else kda_events
            target[index] = (*target[index], event)
        self.counters.bytes_loaded += len(l2_pids) * g.mla_page_bytes + (
            g.kda_checkpoint_bytes if from_l2 else 0
        )
        load = LoadHandle(
            mla_events,
            kda_events,
            l2_pages=len(l2_pids),
            l2_checkpoint=from_l2,
            keepalive=keepalive,
        )
        if events:
            for pid in l2_pids.tolist():
                pending[pid] = load
            if promoted is not None:
                self._pending_ckpts[promoted.key] = load
        return load

    def arriving_checkpoint(self, key: PageKey) -> LoadHandle | None:
        """The load still filling the L1 checkpoint `key`, if any."""
        return self._pending_ckpts.get(key)

    def finish(self, load: LoadHandle) -> tuple[list[PageId], list[PageKey]]:
        """Forget a completed (or failed) load; returns the pages and checkpoints it filled."""
        pids = [p for p, d in self._pending_pages.items() if d is load]
        keys = [k for k, d in self._pending_ckpts.items() if d is load]
        for pid in pids:
            del self._pending_pages[pid]
        for key in keys:
            del self._pending_ckpts[key]
        return pids, keys
