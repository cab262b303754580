"""`CacheManager`: the one object the scheduler and the runtime talk to.

Lifecycle of one request (one turn):

    m = cache.match(keys, prompt_tokens)          # how much is reusable? (no side effects)
    h = cache.allocate(rid, keys, prompt_tokens)  # pin the hit, reserve pages + a live KDA slot,
                                                  # start loading the L2 part of the hit
    ... forward over tokens [h.num_cached_tokens, ...), waiting on h.load per layer ...
    cache.extend(h, n, new_page_keys)             # more tokens (next chunk, decode)
    cache.checkpoint(h, L, kind=...)              # KDA state at page boundary L: [0, L) reusable
    cache.publish(h)                              # turn end: write-through to L2
    cache.release(h)                              # unpin; cached pages stay until evicted

Under the facade: one manager per state type (`MlaPageManager`, `LiveSlotManager`,
`CheckpointManager`) over `SlotPool`s, the device tensors (`DeviceStorage`, absent in
metadata-only mode), and an optional host tier (`HostCache`) that may be shared by several
managers. The hybrid rule (a prefix is reusable only up to a KDA checkpoint that MLA pages fully
cover) lives in `prefix_index.py`; fetching the L2 part of a hit lives in `tiering.py`.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from ..types import PageKey, RequestId, SlotId
from .checkpoints import CheckpointKind, CheckpointManager
from .config import CacheConfig, CacheGeometry
from .copy_engine import make_copy_engine
from .errors import (
    BudgetTooSmallError,
    CacheConfigError,
    CacheError,
    CacheFullError,
    DuplicateRequestError,
    ForeignHandleError,
    IntegrityError,
    InvalidRequestError,
    RequestReleasedError,
    TransferError,
)
from .handles import PrefixMatch, RequestCache
from .handoff import CacheExtent, CacheLayout, extent
from .host_copy import to_device
from .kda_slots import SINK_SLOT, LiveSlotManager
from .keys import KeyBuffer, PageKeys, as_page_keys
from .l2.base import HostCache
from .load_handle import LoadHandle
from .loading import Loader
from .mla_pages import SINK_PAGE, MlaPageManager
from .paths import CheckpointPaths
from .prefix_index import NO_SOURCES, PrefixIndex
from .stats import CacheCounters, CacheStats, Occupancy
from .storage import DeviceStorage
from .tiering import Tiering

logger = logging.getLogger("tokenspeed.cache")


def _is_count(value: object) -> bool:
    """A Python int that is not a bool (True is an int to Python, never a token count)."""
    return isinstance(value, int) and value.__class__ is not bool


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _l1_pages(sources: np.ndarray) -> np.ndarray:
    """The L1 page ids of a hit's sources ([hit] int64, -1 where from L2), in order."""
    return sources[sources >= 0]


class CacheManager:
    """Two-tier cache of one rank: MLA pages, KDA live slots and checkpoints, optional L2.

    Contract:
    - Handles (`RequestCache`) are opaque; a handle is valid from `allocate` to `release` and
      belongs to the manager that made it.
    - Every operation either completes or raises a `CacheError` leaving all pools as they were
      (`check_integrity()` holds after every call, successful or not).
    - L2 failures never raise: they shrink hits to what could be verified and drop writes, and
      are counted in `stats().l2` and `stats().counters`.
    - Pages and checkpoints held by a live request are never evicted; cached ones are evicted
      least-recently-used first (written back to L2 first when L2 lacks them).
    - The manager is driven from one thread. `l2` is owned by the caller (close it yourself) and
      may be shared by several managers with the same geometry.
    """

    def __init__(
        self, geometry: CacheGeometry, config: CacheConfig, *, l2: HostCache | None = None
    ) -> None:
        if not isinstance(geometry, CacheGeometry):
            raise CacheConfigError(f"geometry must be a CacheGeometry, got {type(geometry)}")
        if not isinstance(config, CacheConfig):
            raise CacheConfigError(f"config must be a CacheConfig, got {type(config)}")
        self.geometry = geometry
        self.config = config
        self.page_size = geometry.page_size
        self.sizes = config.pool_sizes(geometry)
        self._pages = MlaPageManager(self.sizes.num_pages)
        self._live = LiveSlotManager(self.sizes.num_live_slots)
        self._ckpts = CheckpointManager(self.sizes.num_checkpoint_slots, self.page_size)
        device = torch.device(config.device)
        self._storage = (
            None if config.metadata_only else DeviceStorage(geometry, self.sizes, device)
        )
        self._copier = make_copy_engine(
            device,
            async_loads=config.async_loads and not config.metadata_only,
            name=f"tokenspeed-cache-copy-{id(self):x}",
        )
        # Stop the copy worker with the manager, even if nobody calls close().
        weakref.finalize(self, self._copier.close)
        if l2 is not None:
            l2.bind(geometry, metadata_only=config.metadata_only)
        self._l2 = l2
        self.counters = CacheCounters()
        self._tiering = Tiering(
            geometry, self._pages, self._ckpts, self._storage, l2, self.counters
        )
        self._loader = Loader(geometry, self._storage, self._copier, self.counters)
        self._paths = CheckpointPaths(
            self._ckpts, config.checkpoint_policy.max_per_path, self.page_size, self.counters
        )
        self._requests: dict[RequestId, RequestCache] = {}
        self._token = object()  # identifies this manager's handles and matches
        self._index = PrefixIndex(
            self._pages,
            self._ckpts,
            self._tiering,
            page_size=self.page_size,
            enabled=config.prefix_caching,
            has_l2=l2 is not None,
            owner=self._token,
        )

    # ------------------------------------------------------------------------------ queries
    @property
    def sink_page(self) -> int:
        """Page that padded rows of a captured graph point at; never handed to a request."""
        return SINK_PAGE

    @property
    def sink_slot(self) -> SlotId:
        """Live KDA slot that padded rows write to; never handed to a request."""
        return SINK_SLOT

    @property
    def l2(self) -> HostCache | None:
        return self._l2

    @property
    def storage(self) -> DeviceStorage | None:
        """The device tensors (None in metadata-only mode)."""
        return self._storage

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable."""
        return self._pages.num_free + self._pages.num_cached

    @property
    def available_slots(self) -> int:
        return self._live.num_free

    def get(self, request_id: RequestId) -> RequestCache | None:
        return self._requests.get(request_id)

    def match(
        self, page_keys: PageKeys | KeyBuffer | Sequence[PageKey], prompt_tokens: int
    ) -> PrefixMatch:
        """The longest reusable prefix of a prompt (the hybrid rule), without changing anything.

        page_keys: chained keys of the prompt's full pages (more may be given; they are ignored).
        prompt_tokens: the prompt length; the hit is at most the last page boundary before it,
            so at least one token is left to compute.
        """
        return self._index.match(page_keys, prompt_tokens)

    def can_allocate(
        self,
        page_keys: PageKeys | KeyBuffer | Sequence[PageKey],
        prompt_tokens: int,
        *,
        reserve_tokens: int | None = None,
        match: PrefixMatch | None = None,
    ) -> bool:
        """Whether `allocate` with these arguments would find room now (L2 reads may still
        shrink the hit, which only needs more pages if the hit exceeded the reservation)."""
        m = self._index.usable(match, as_page_keys(page_keys), prompt_tokens)
        reserve = prompt_tokens if reserve_tokens is None else reserve_tokens
        total = max(_ceil_div(reserve, self.page_size), m.num_tokens // self.page_size)
        if total > self._pages.capacity or self._live.num_free == 0:
            return False
        l1 = _l1_pages(m.sources)
        return total - len(l1) <= self._pages.room_besides(l1)

    # ---------------------------------------------------------------------------- lifecycle
    def allocate(
        self,
        request_id: RequestId,
        page_keys: PageKeys | KeyBuffer | Sequence[PageKey],
        prompt_tokens: int,
        *,
        reserve_tokens: int | None = None,
        match: PrefixMatch | None = None,
    ) -> RequestCache:
        """Reserve cache for a request and reuse the longest valid prefix.

        page_keys: keys of the request's full pages known so far (the prompt's, and possibly
            more; later ones arrive with `extend`).
        prompt_tokens: prompt length (caps the hit, see `match`).
        reserve_tokens: tokens the page table must cover now (default: the prompt; a chunked
            prefill may reserve less and `extend` later). The table always covers the hit.
        match: a `match` result to reuse if still valid (otherwise the prefix is matched again).

        The live KDA slot is set to the checkpoint's state at the hit (zeros on a miss). Pages and
        state coming from L2 are read and verified now; their copies into the device tier run
        asynchronously, signalled per layer by `handle.load`.

        Raises DuplicateRequestError, InvalidRequestError, BudgetTooSmallError (the request can
        never fit), CacheFullError (not now); nothing is changed when it raises. If starting the
        load fails (a device error), that error propagates and everything taken is given back.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} already holds cache")
        if not _is_count(prompt_tokens) or prompt_tokens < 1:
            raise InvalidRequestError(f"prompt_tokens must be >= 1, got {prompt_tokens!r}")
        reserve = prompt_tokens if reserve_tokens is None else reserve_tokens
        if not _is_count(reserve) or reserve < 1:
            raise InvalidRequestError(f"reserve_tokens must be >= 1, got {reserve_tokens!r}")
        P = self.page_size
        if _ceil_div(reserve, P) > self._pages.capacity:
            raise BudgetTooSmallError(
                f"request {request_id!r} needs {_ceil_div(reserve, P)} pages for {reserve} "
                f"tokens but the device pool holds {self._pages.capacity}"
            )
        if self._live.num_free == 0:
            raise CacheFullError(f"no live KDA slot free for request {request_id!r}")
        keys = KeyBuffer.over(as_page_keys(page_keys))  # the handle's; copied if it grows
        arr = keys.array
        m = self._index.usable(match, arr, prompt_tokens)
        plan = self._tiering.fetch(arr, m)  # L2 reads happen here; nothing changed yet
        hit = plan.hit_pages
        total = max(_ceil_div(reserve, P), hit)
        from_l2 = plan.sources < 0
        all_l1 = not np.count_nonzero(from_l2)
        l1_hit = plan.sources if all_l1 else plan.sources[~from_l2]
        if total - len(l1_hit) > self._pages.room_besides(l1_hit):
            raise CacheFullError(
                f"request {request_id!r} needs {total - len(l1_hit)} new pages; "
                f"{self.available_pages} are free or evictable, some of them its own hit"
            )
        self._pages.pin(l1_hit)
        source_ckpt = self._ckpts.get(keys[hit - 1]) if plan.checkpoint_tier == "l1" else None
        if source_ckpt is not None:
            self._ckpts.pin(source_ckpt)
        try:
            fresh = self._pages.allocate(total - len(l1_hit), self._tiering.writeback_pages)
        except BaseException:
            # Not only CacheFullError: the write-back of an evicted page reads it off the
            # device, and a device error there must not leave the hit pinned by nobody.
            self._pages.unpin(l1_hit)
            if source_ckpt is not None:
                self._ckpts.unpin(source_ckpt)
            raise
        slot, l2_pids, promoted = None, NO_SOURCES, None
        try:
            slot = self._live.acquire(request_id)

            # Page table: the hit's L1 pages in place, fresh pages for L2 pages and the rest.
            table = np.empty(total, dtype=np.int64)
            table[:hit] = plan.sources
            if all_l1:
                table[hit:] = fresh
            else:
                # The L2 part of the hit takes the first fresh pages, in order.
                at = np.flatnonzero(from_l2)
                table[at] = fresh[: len(at)]
                table[hit:] = fresh[len(at) :]
                # Matchable at once: their content arrives with this load.
                self._pages.register_at(fresh[: len(at)], arr[at], at)
                l2_pids = fresh[: len(at)]

            handle = RequestCache(
                owner=self._token,
                request_id=request_id,
                keys=keys,
                page_ids=table,
                num_tokens=max(reserve, hit * P),
                num_cached_tokens=hit * P,
                l2_cached_tokens=len(l2_pids) * P,
                live_slot=slot,
                load=LoadHandle((), ()),
            )
            handle._registered = hit
            if plan.checkpoint_tier == "l2":
                promoted = self._tiering.promote_checkpoint(keys[hit - 1], hit * P)
                if promoted is not None:
                    self._ckpts.pin(promoted)
                    handle._held.append(promoted)
            handle.load = self._loader.start(slot, plan, l1_hit, l2_pids, source_ckpt, promoted)
        except BaseException:
            # Starting the load failed (a device error): give everything back, as if never
            # allocated, once no copy of it can still be landing in what is given back.
            self._loader.copier.drain()
            for pid in l2_pids.tolist():
                self._pages.unregister(pid)  # their content never arrived
            if promoted is not None:
                self._ckpts.unpin(promoted)
                if promoted.refcount == 0:
                    self._ckpts.remove(promoted)
            self._pages.unpin(np.concatenate((l1_hit, fresh)))
            if slot is not None:
                self._live.release(slot)
            if source_ckpt is not None:
                self._ckpts.unpin(source_ckpt)
            raise
        if source_ckpt is not None:
            self._ckpts.unpin(source_ckpt)
            self._ckpts.touch(source_ckpt)
        self._requests[request_id] = handle

        c = self.counters
        c.allocations += 1
        c.prompt_tokens += prompt_tokens
        c.hit_tokens += hit * P
        c.l2_hit_tokens += len(l2_pids) * P
        c.l1_hit_tokens += (hit - len(l2_pids)) * P
        c.kv_only_tokens += m.kv_only_tokens
        return handle

    def extend(
        self,
        handle: RequestCache,
        num_tokens: int,
        page_keys: PageKeys | KeyBuffer | Sequence[PageKey] = (),
    ) -> None:
        """Grow the request to `num_tokens` tokens (allocating pages as needed) and append the
        keys of pages that became full. Raises RequestReleasedError, InvalidRequestError (a
        shrink), BudgetTooSmallError, CacheFullError; nothing changes when it raises."""
        self._check_live(handle)
        if not _is_count(num_tokens) or num_tokens < handle.num_tokens:
            raise InvalidRequestError(
                f"extend of request {handle.request_id!r} to {num_tokens!r} tokens: it already "
                f"holds {handle.num_tokens} (extend never shrinks)"
            )
        if len(page_keys):
            # Read the keys before taking pages: keys that cannot be read (not page keys) must
            # raise with the request as it was, not after its table grew.
            page_keys = as_page_keys(page_keys)
        total = -(-num_tokens // self.page_size)
        need = total - handle._num_pages  # not len(page_ids): that builds a view, per step
        if need > 0:
            if total > self._pages.capacity:
                raise BudgetTooSmallError(
                    f"request {handle.request_id!r} would need {total} pages; the device pool "
                    f"holds {self._pages.capacity}"
                )
            if need == 1:  # a decode step crossing a page boundary
                handle._append_page(self._pages.allocate_one(self._tiering.writeback_pages))
            else:
                handle._append_pages(self._pages.allocate(need, self._tiering.writeback_pages))
        if len(page_keys):
            handle._keys.extend(page_keys)
        handle.num_tokens = num_tokens

    def checkpoint(
        self,
        handle: RequestCache,
        num_tokens: int,
        *,
        kind: CheckpointKind = CheckpointKind.INTERVAL,
        from_live: bool = True,
    ) -> SlotId | None:
        """Record that tokens [0, num_tokens) are computed and that the KDA state at exactly
        num_tokens (a page boundary) is available, making that prefix reusable.

        The pages of [0, num_tokens) become matchable (with prefix caching on). With `from_live`
        (default) the live slot is snapshotted into a new checkpoint slot now, so call this when
        the live state is at num_tokens; otherwise the caller must write the state into the
        returned slot before the next cache call (e.g. from a chunked kernel's intermediate
        states).
        Returns the new checkpoint slot, or None if none was stored (one already exists for this
        prefix, or every checkpoint slot is pinned: a dropped checkpoint is not an error).
        """
        self._check_live(handle)
        P = self.page_size
        n, rest = divmod(num_tokens, P) if _is_count(num_tokens) else (0, 1)
        if rest or not 0 < num_tokens <= handle.num_tokens or n > len(handle._keys):
            raise InvalidRequestError(
                f"checkpoint of request {handle.request_id!r} at {num_tokens!r} tokens: must be a "
                f"positive multiple of {P}, at most the {handle.num_tokens} tokens reserved, with "
                f"keys known for its {n} pages ({len(handle._keys)} known)"
            )
        if not isinstance(kind, CheckpointKind):
            raise InvalidRequestError(f"kind must be a CheckpointKind, got {kind!r}")
        if from_live:
            handle.load.wait_all_kda()  # the live state must have arrived before a snapshot
        keys = handle._keys
        start = handle._registered
        if n > start and self.config.prefix_caching:
            self._pages.register_many(handle._table[start:n], keys[start:n], start)
            handle._registered = n
        self._paths.path(handle)  # find the path's checkpoints before adding one
        entry = self._ckpts.get(keys[n - 1])
        if entry is not None:
            self._ckpts.touch(entry)
            if kind is CheckpointKind.TURN_END and entry.kind is CheckpointKind.INTERVAL:
                entry.kind = kind  # now a turn's end too: the cap keeps it longer
            if kind is CheckpointKind.ROLLING:
                self._paths.set_rolling(handle, entry)
            self._paths.note(handle, n)
            return None
        entry = self._ckpts.add(keys[n - 1], num_tokens, kind, self._tiering.writeback_checkpoints)
        if entry is None:
            self.counters.checkpoints_dropped += 1
            return None
        self.counters.checkpoints_taken += 1
        if self._storage is not None and from_live:
            try:
                self._storage.save_checkpoint(handle.live_slot, entry.slot)
            except BaseException:
                self._ckpts.remove(entry)  # never let a request match a state never written
                raise
        if kind is CheckpointKind.ROLLING:
            self._paths.set_rolling(handle, entry)
        self._paths.note(handle, n)
        self._paths.enforce_cap(handle, newest=n)
        return entry.slot

    def discard_checkpoint(self, handle: RequestCache, num_tokens: int, slot: SlotId) -> bool:
        """Undo `checkpoint(handle, num_tokens, from_live=False)` whose state could not be
        written into the returned `slot` (the copy failed): the entry goes, so no request ever
        matches a state that was never written. Returns False, changing nothing, when the
        checkpoint at that prefix is not in `slot` (there is nothing of this write to undo)."""
        self._check_live(handle)
        n, rest = divmod(num_tokens, self.page_size)
        if rest or not 0 < n <= len(handle._keys):
            return False
        entry = self._ckpts.get(handle._keys[n - 1])
        if entry is None or entry.slot != slot:
            return False
        own = handle._rolling is entry
        if entry.refcount > own:  # checked before anything changes: a refusal changes nothing
            raise IntegrityError(
                f"checkpoint slot {slot} of request {handle.request_id!r} is held by another "
                "request: it cannot be a state this request has just failed to write"
            )
        if own:
            handle._rolling = None
            self._ckpts.unpin(entry)
        self._ckpts.remove(entry)
        self.counters.checkpoints_discarded += 1
        return True

    def has_checkpoint(self, handle: RequestCache, num_tokens: int) -> bool:
        """Whether a KDA checkpoint exists at exactly `num_tokens` of this request's prefix."""
        self._check_live(handle)
        n, rest = divmod(num_tokens, self.page_size)
        if rest or not 0 < n <= len(handle._keys):
            return False
        return self._ckpts.get(handle._keys[n - 1]) is not None

    def publish(self, handle: RequestCache) -> int:
        """Write-through at a turn end: store in L2 the pages of the request's deepest
        checkpointed prefix and its checkpoints, where L2 lacks them. Makes a rolling checkpoint a
        turn-end one. Returns how many objects were newly stored (0 without L2, or when L2 is
        unavailable: L2 failures never raise)."""
        self._check_live(handle)
        if handle._rolling is not None and handle._rolling.kind is CheckpointKind.ROLLING:
            handle._rolling.kind = CheckpointKind.TURN_END
        if self._l2 is None:
            return 0
        entries = self._paths.entries(handle)
        if not entries:
            return 0
        handle.load.synchronize()  # the pages must have arrived before they are read back
        for _, key in entries:
            arriving = self._loader.arriving_checkpoint(key)
            if arriving is not None:
                arriving.synchronize()
        path = [n for n, _ in entries]
        return self._tiering.publish(handle._keys.array, handle.page_ids, path)

    def release(self, handle: RequestCache, *, publish: bool = False) -> None:
        """Give the request's cache back: pages it wrote and registered stay cached (evictable),
        the rest is freed; its live slot is freed; a rolling checkpoint becomes a turn-end one.
        With publish=True, `publish` first (preemption: the state goes to L2, never dropped),
        unless the request's load failed (then nothing is published). Raises
        RequestReleasedError when released twice."""
        self._check_live(handle)
        try:
            handle.load.synchronize()
            failed = False
        except TransferError:
            failed = True
        if publish and not failed:
            # Only this request's own failed load skips the publish (its pages cannot be
            # trusted; the release below drops them). Any other error of publish propagates
            # with the handle still live, as before.
            self.publish(handle)
        filled_pages, filled_ckpts = self._loader.finish(handle.load)
        if failed:
            # The copied bytes cannot be trusted: never let another request match them.
            logger.warning("load of request %r failed; dropping its pages", handle.request_id)
            for pid in filled_pages:
                self._pages.unregister(pid)
        self._paths.end_rolling(handle)
        for entry in handle._held:
            self._ckpts.unpin(entry)
            if failed and entry.key in filled_ckpts and entry.refcount == 0:
                self._ckpts.remove(entry)
        handle._held = []
        self._pages.unpin(handle.page_ids)
        self._live.release(handle.live_slot)
        del self._requests[handle.request_id]
        handle.released = True

    def evict(self, *, pages: int = 0, checkpoints: int = 0) -> tuple[int, int]:
        """Evict up to this many cached pages and checkpoints (LRU, written back to L2 first when
        L2 lacks them). Held entries are never evicted. Returns (pages, checkpoints) evicted."""
        if not (_is_count(pages) and _is_count(checkpoints)) or pages < 0 or checkpoints < 0:
            raise InvalidRequestError(
                f"evict counts must be ints >= 0, got {pages!r}, {checkpoints!r}"
            )
        n_pages = self._pages.evict(pages, self._tiering.writeback_pages)
        n_ckpts = self._ckpts.evict(checkpoints, self._tiering.writeback_checkpoints)
        return n_pages, n_ckpts

    # ------------------------------------------------------------------- checkpoint helpers
    def checkpoint_points(
        self, start: int, end: int, *, turn_end: bool
    ) -> list[tuple[int, CheckpointKind]]:
        """(length, kind) where a request computing tokens [start, end) should checkpoint (see
        `CheckpointPolicy.points`); the scheduler aligns prefill chunk ends to these lengths."""
        return self.config.checkpoint_policy.points(
            start, end, page_size=self.page_size, turn_end=turn_end
        )

    # --------------------------------------------------------------------- runtime helpers
    def mla_layer(self, layer: int) -> torch.Tensor:
        """[num_pages, P, W] page pool of one MLA layer (index it with the page tables)."""
        return self._require_storage().mla_layer(layer)

    def kda_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [num_live_slots, C, Kc], recurrent [num_live_slots, H, K, V]) of one KDA layer
        (index them with the live slots)."""
        return self._require_storage().kda_layer(layer)

    def page_table_tensor(
        self,
        handles: Sequence[RequestCache],
        *,
        num_rows: int | None = None,
        num_cols: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """[num_rows, num_cols] int32 page table of a batch; padding (extra rows for a captured
        graph size, columns past a request's pages) points at the sink page."""
        rows = len(handles) if num_rows is None else num_rows
        cols = max((len(h.page_ids) for h in handles), default=0) if num_cols is None else num_cols
        if rows < len(handles) or any(len(h.page_ids) > cols for h in handles):
            raise InvalidRequestError(f"page table [{rows}, {cols}] cannot hold this batch")
        table = np.full((rows, cols), SINK_PAGE, dtype=np.int32)
        for r, h in enumerate(handles):
            self._check_live(h)
            table[r, : len(h.page_ids)] = h.page_ids
        return to_device(torch.from_numpy(table), device or self.config.device)

    def live_slot_tensor(
        self,
        handles: Sequence[RequestCache],
        *,
        num_rows: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """[num_rows] int32 live KDA slots of a batch; padding rows point at the sink slot."""
        rows = len(handles) if num_rows is None else num_rows
        if rows < len(handles):
            raise InvalidRequestError(f"{rows} rows cannot hold {len(handles)} requests")
        slots = [SINK_SLOT] * rows
        for r, h in enumerate(handles):
            self._check_live(h)
            slots[r] = h.live_slot
        return to_device(torch.tensor(slots, dtype=torch.int32), device or self.config.device)

    # ------------------------------------------------------- handoff to another rank (P/D)
    def handoff_layout(self) -> CacheLayout:
        """How the device tier lies in memory, for handing requests to or from another rank
        (`handoff.py`)."""
        return CacheLayout.of(self._require_storage())

    def export_extent(self, handle: RequestCache, num_tokens: int) -> CacheExtent:
        """The source of a handoff: the pages holding the request's tokens [0, num_tokens) and
        its live slot, whose state must be at num_tokens (the caller keeps the handle, hence
        the pages, until the transfer is done). Waits until nothing still writes into them."""
        self._check_live(handle)
        return extent(self._require_storage(), handle, num_tokens, first_page=0)

    def import_extent(self, handle: RequestCache, num_tokens: int) -> CacheExtent:
        """The destination of a handoff into a handle allocated for it (reserving num_tokens):
        its pages past its own prefix hit (that hit is shared; it stays) and its live slot.
        Waits until nothing the cache started (the hit's load, the slot's restore) still
        writes into them, so that the transfer's bytes are the last to land."""
        self._check_live(handle)
        first = handle.num_cached_tokens // self.page_size
        return extent(self._require_storage(), handle, num_tokens, first_page=first)

    def _require_storage(self) -> DeviceStorage:
        if self._storage is None:
            raise CacheError("a metadata-only cache has no tensors")
        return self._storage

    # ------------------------------------------------------------------ accounting, checks
    def stats(self) -> CacheStats:
        pages, ckpts, live = self._pages, self._ckpts, self._live
        # First, so that a failure it counts shows in the counters below.
        l2 = self._tiering.l2.stats() if self._tiering.l2 is not None else None
        return CacheStats(
            pages=Occupancy(pages.capacity, pages.num_free, pages.num_used, pages.num_cached),
            checkpoints=Occupancy(ckpts.capacity, ckpts.num_free, ckpts.num_used, ckpts.num_cached),
            live_slots=Occupancy(live.capacity, live.num_free, live.capacity - live.num_free, 0),
            requests=len(self._requests),
            counters=attrs.evolve(self.counters),
            l2=l2,
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every pool is consistent with the live requests: free +
        used + cached == total, refcounts equal the holders, nothing owned twice, nothing held
        evictable, the sinks untouched."""
        P = self.page_size
        refs: Counter = Counter()
        pins: Counter = Counter()
        owners: dict[SlotId, RequestId] = {}
        for rid, h in self._requests.items():
            if h.released or h.request_id != rid:
                raise IntegrityError(f"request table entry {rid!r} is stale")
            if len(h.page_ids) != _ceil_div(h.num_tokens, P):
                raise IntegrityError(
                    f"request {rid!r}: {len(h.page_ids)} pages for {h.num_tokens} tokens"
                )
            table = h.page_ids.tolist()
            if len(set(table)) != len(table) or SINK_PAGE in table:
                raise IntegrityError(f"request {rid!r}: a page appears twice, or the sink page")
            if h._registered > min(len(h.page_ids), len(h._keys)):
                raise IntegrityError(f"request {rid!r}: more pages registered than known")
            registered = h.page_ids[: h._registered]
            indexed = self._pages.indexed[registered]
            if np.count_nonzero(
                self._pages.key_of[registered][indexed] != h._keys.array[: h._registered][indexed]
            ):
                raise IntegrityError(f"request {rid!r}: a page is indexed under a foreign key")
            if np.count_nonzero(
                self._pages.position_of[registered][indexed] != np.flatnonzero(indexed)
            ):
                raise IntegrityError(f"request {rid!r}: a page is indexed at a foreign position")
            refs.update(table)
            for entry in h._held + ([h._rolling] if h._rolling is not None else []):
                pins[entry.key] += 1
            owners[h.live_slot] = rid
        self._pages.check_integrity(refs)
        self._ckpts.check_integrity(pins)
        self._live.check_integrity(owners)
        if self._l2 is not None:
            self._l2.check_integrity()

    def _check_live(self, handle: RequestCache) -> None:
        if not isinstance(handle, RequestCache) or handle._owner is not self._token:
            raise ForeignHandleError(f"{handle!r} was not allocated by this CacheManager")
        if handle.released:
            raise RequestReleasedError(
                f"request {handle.request_id!r} was already released (released twice, or used "
                "after release)"
            )

    def close(self) -> None:
        """Stop the copy worker (the L2 tier belongs to the caller)."""
        self._copier.close()
