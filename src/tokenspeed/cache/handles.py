"""What the facade hands out: a match result (a plan) and a per-request handle (a reservation).

The scheduler reads the few public fields and passes the objects back; it never reaches inside.
"""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np

from ..types import PageKey, RequestId, SlotId
from .checkpoints import CheckpointEntry
from .keys import KeyBuffer, PageKeys
from .load_handle import LoadHandle


@attrs.frozen(eq=False)
class PrefixMatch:
    """The reusable prefix `match` found for a prompt.

    num_tokens: the hit L, a multiple of the page size and smaller than the prompt (at least one
        token is always left to compute, to produce logits); 0 means a miss. MLA pages cover
        [0, L) and a complete KDA checkpoint exists at exactly L.
    l1_tokens / l2_tokens: how much of the hit is already in the device tier / must be loaded from
        the host tier (page granularity; l1_tokens + l2_tokens == num_tokens).
    checkpoint_tier: where the checkpoint at L is ("l1", "l2"; None on a miss).
    mla_covered_tokens: how far MLA pages alone reach (>= num_tokens); the excess has no
        checkpoint at its end and is worth nothing (`kv_only_tokens`).

    A match is a plan, not a reservation: `allocate` reuses it if neither tier has changed since
    (no page or checkpoint indexed or evicted, no host object stored or gone), and re-matches
    otherwise; the handle says what was actually reused.
    """

    num_tokens: int
    l1_tokens: int
    l2_tokens: int
    checkpoint_tier: Literal["l1", "l2"] | None
    mla_covered_tokens: int
    # What the plan was made from (index versions); None: cannot tell, never reused.
    epoch: tuple[int, int, int | None] | None = attrs.field(repr=False)
    owner: object = attrs.field(repr=False)
    # (pages considered, key of the last one): ties the plan to the prompt it was made for.
    scope: tuple[int, PageKey | None] = attrs.field(repr=False)
    # [hit pages] int64: per hit page its L1 page id, or -1 where the page comes from L2.
    sources: np.ndarray = attrs.field(repr=False)

    @property
    def hit(self) -> bool:
        return self.num_tokens > 0

    @property
    def kv_only_tokens(self) -> int:
        """MLA-covered tokens beyond the hit: a KV hit without a checkpoint, never reused."""
        return self.mla_covered_tokens - self.num_tokens


class RequestCache:
    """The cache a request holds, from `allocate` to `release`. Opaque to the scheduler.

    Public, read-only:
      request_id
      num_tokens         tokens the page table covers (reserved; grows with `extend`)
      num_cached_tokens  prefix reused at allocate (L); tokens [L, ...) must be computed
      l2_cached_tokens   the part of that prefix loaded from the host tier
      page_ids           the page table, [pages] int64: page_ids[i] holds tokens [i*P, (i+1)*P)
      page_keys          the keys of its full pages known so far (`num_keys` of them)
      live_slot          the KDA state slot the forward reads and advances
      load               LoadHandle: per-layer events for the copies the hit needs
      released           True after `release`
    """

    __slots__ = (
        "_held",
        "_keys",
        "_num_pages",
        "_owner",
        "_path",
        "_registered",
        "_rolling",
        "_table",
        "l2_cached_tokens",
        "live_slot",
        "load",
        "num_cached_tokens",
        "num_tokens",
        "released",
        "request_id",
    )

    def __init__(
        self,
        *,
        owner: object,
        request_id: RequestId,
        keys: KeyBuffer,
        page_ids: np.ndarray,
        num_tokens: int,
        num_cached_tokens: int,
        l2_cached_tokens: int,
        live_slot: SlotId,
        load: LoadHandle,
    ) -> None:
        self._owner = owner
        self.request_id = request_id
        self._keys = keys
        # The page table lives in a buffer with room to grow (decode extends it page by page).
        self._table = page_ids
        self._num_pages = len(page_ids)
        self.num_tokens = num_tokens
        self.num_cached_tokens = num_cached_tokens
        self.l2_cached_tokens = l2_cached_tokens
        self.live_slot = live_slot
        self.load = load
        self.released = False
        # Leading pages whose keys are in the L1 index (registered or shared at allocate).
        self._registered = num_cached_tokens
        # (n, key of page n - 1) where this request's prefix has an L1 checkpoint, sorted by n
        # (scanned lazily; `CheckpointPaths` keeps it).
        self._path: list[tuple[int, PageKey]] | None = None
        self._rolling: CheckpointEntry | None = None
        # Checkpoint entries this request pins while it runs (rolling, or filled by its load).
        self._held: list[CheckpointEntry] = []

    @property
    def page_ids(self) -> np.ndarray:
        """The page table, [pages] int64 (read-only: a view of the handle's buffer)."""
        view = self._table[: self._num_pages]
        view.flags.writeable = False
        return view

    def _append_pages(self, ids: np.ndarray) -> None:
        """Grow the page table by `ids` (amortised: the buffer doubles when full)."""
        n, k = self._num_pages, len(ids)
        if n + k > len(self._table):
            grown = np.empty(max(2 * len(self._table), n + k, 16), dtype=np.int64)
            grown[:n] = self._table[:n]
            self._table = grown
        self._table[n : n + k] = ids
        self._num_pages = n + k

    def _append_page(self, pid: int) -> None:
        """`_append_pages` of one page."""
        n = self._num_pages
        if n == len(self._table):
            grown = np.empty(max(2 * n, 16), dtype=np.int64)
            grown[:n] = self._table
            self._table = grown
        self._table[n] = pid
        self._num_pages = n + 1

    @property
    def num_keys(self) -> int:
        """len(page_keys), without building the view."""
        return len(self._keys)

    @property
    def page_keys(self) -> PageKeys:
        """Keys of this request's full pages known so far ([n] `KEY_DTYPE`, read-only)."""
        return self._keys.array

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return (
            f"RequestCache({self.request_id!r}, {state}, tokens={self.num_tokens}, "
            f"cached={self.num_cached_tokens}, pages={len(self.page_ids)}, slot={self.live_slot})"
        )
